"""Embeddings throughput: all-MiniLM-L6-v2 through the Engine against sentence-transformers'
`encode` (torch, in the reference venv .st-venv), side by side in one run.

    python benchmarks/bench_embeddings.py [--sentences 1000] [--rounds 3] [--threads 2] \
        [--layouts 2x1,1x2] [--st-batch 16,32,64] [--lengths 8-256] \
        [--out benchmarks/results/serve/embeddings.txt]

The sentences (seeded, no download) are 8 to 256 tokens long as MiniLM's tokenizer counts
them, lengths uniform over that range (`--lengths 8-48`: short texts, queries and titles). Both
sides start from text and end with normalised float32 embeddings: sentence-transformers'
`encode(batch_size=B, normalize_embeddings=True)` with `torch.set_num_threads(threads)`; the
engine's `EncoderText.encode_batch` then every sentence's `engine.prefill(ids)` at once (the
model's own mean pooling + Normalize), with `num_workers x num_threads == threads` CPU threads
(each layout given). First each side is warmed and sentence-transformers' batch sizes are tried
once (its best is used); then rounds of A B B A (sentence-transformers, engine layouts, engine
layouts, sentence-transformers), and the medians, sentences/s and ratios are reported. The
embeddings of both sides are compared too (cosine). sentence-transformers runs in a child
process of .st-venv (built as FINDINGS says: `python3.11 -m venv .st-venv && .st-venv/bin/pip
install torch==2.13.0 transformers sentence-transformers`), driven over stdin; nothing of torch
enters this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aioprefill import Engine, EngineConfig, PaddleModel, Tokenizer  # noqa: E402
from aioprefill.text.encoder_text import EncoderText  # noqa: E402
from tests.encoder_models import minilm_dir  # noqa: E402

ST_PYTHON = ROOT / ".st-venv" / "bin" / "python"
if not ST_PYTHON.exists():
    ST_PYTHON = Path("/work/main/.st-venv/bin/python")

WORDS = (  # noqa: SIM905
    "the of and to in a is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "time people year way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "river mountain forest ocean desert volcano glacier harbor bridge tunnel railway airport "
    "coffee bread cheese apple orange banana pepper garlic onion tomato potato noodle quickly "
    "embedding retrieval ranking transformer attention gradient tokenizer encoder decoder "
    "Paris Berlin Tokyo 2026 3.14 café naïve internationalization photosynthesis"
).split()

ST_CHILD = r"""
import json, resource, sys, time
import numpy as np, torch
from sentence_transformers import SentenceTransformer
model_dir, sentences, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(threads)
texts = json.load(open(sentences))
m = SentenceTransformer(model_dir, device="cpu")
m.encode(texts[:64], batch_size=32, normalize_embeddings=True)
print(json.dumps({"ready": True, "torch": torch.__version__}), flush=True)
for line in sys.stdin:
    bs, out, n = line.split()
    t, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    e = m.encode(texts[: int(n)], batch_size=int(bs), normalize_embeddings=True)
    dt, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    np.save(out, e.astype(np.float32))
    print(json.dumps({"seconds": dt, "cpu": cpu}), flush=True)
"""


def make_sentences(
    n: int, text: EncoderText, seed: int = 34, lengths: tuple[int, int] = (8, 256)
) -> list[str]:
    """`n` sentences whose token counts ([CLS] and [SEP] included) are uniform in `lengths`
    (8..256 unless told)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target = rng.randint(*lengths)
        words: list[str] = []
        while True:
            words.append(rng.choice(WORDS))
            if len(text.encode(" ".join(words))) >= target:
                break
        out.append(" ".join(words).capitalize() + ".")
    return out


class SentenceTransformers:
    def __init__(self, sentences_file: str, threads: int) -> None:
        self.proc = subprocess.Popen(
            [str(ST_PYTHON), "-c", ST_CHILD, str(minilm_dir()), sentences_file, str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = json.loads(self._line())

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("sentence-transformers child died")
        return line

    def encode(self, batch: int, out: str, n: int) -> tuple[float, float]:
        """(wall seconds, CPU seconds of the process: every torch thread)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{batch} {out} {n}\n")
        self.proc.stdin.flush()
        answer = json.loads(self._line())
        return answer["seconds"], answer["cpu"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (every thread), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


async def engine_run(engine: Engine, text: EncoderText, sentences: list[str]) -> tuple:
    """(wall seconds, CPU seconds of this process and the workers, embeddings, results)."""
    pids = [os.getpid(), *engine.worker_pids()]
    t, c = time.perf_counter(), cpu_seconds(pids)
    ids = text.encode_batch(sentences)
    results = await asyncio.gather(*(engine.prefill(x) for x in ids))
    dt, cpu = time.perf_counter() - t, cpu_seconds(pids) - c
    return dt, cpu, np.stack([r.embedding for r in results]), results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layouts", default="2x1,1x2", help="engine workers x threads, comma list")
    p.add_argument("--st-batch", default="16,32,64")
    p.add_argument("--st-try", type=int, default=300, help="sentences the batch sizes try")
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--lengths", default="8-256", help="LO-HI tokens a sentence (short: 8-48)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    lo, hi = (int(v) for v in args.lengths.split("-"))
    layouts = [tuple(int(v) for v in s.split("x")) for s in args.layouts.split(",")]
    assert all(w * t == args.threads for w, t in layouts), "layouts must use --threads threads"
    spec = PaddleModel.from_pretrained(minilm_dir())
    tok = Tokenizer.from_pretrained(minilm_dir())
    text = EncoderText.for_model(tok, spec)
    sentences = make_sentences(args.sentences, text, lengths=(lo, hi))
    lengths = [len(x) for x in text.encode_batch(sentences)]
    lines = [
        f"# {' '.join(sys.argv)}",
        f"# {platform.node()} {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at start; "
        f"{len(sentences)} sentences, {sum(lengths)} tokens ({min(lengths)}..{max(lengths)}, "
        f"mean {statistics.mean(lengths):.0f})",
    ]

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    for line in lines:
        print(line)
    tmp = tempfile.mkdtemp(prefix="bench-emb-")
    sent_file = os.path.join(tmp, "sentences.json")
    Path(sent_file).write_text(json.dumps(sentences))
    st = SentenceTransformers(sent_file, args.threads)
    say(f"# sentence-transformers: torch {st.info['torch']}, {args.threads} threads")
    try:
        batches = [int(b) for b in args.st_batch.split(",")]
        n_try = min(len(sentences), args.st_try)
        tried = {b: st.encode(b, os.path.join(tmp, "st.npy"), n_try) for b in batches}
        best = min(tried, key=lambda b: tried[b][0])
        say(
            f"# st batch sizes tried once on the first {n_try} sentences: "
            + ", ".join(f"{b}: {s:.2f} s ({c:.1f} CPU-s)" for b, (s, c) in tried.items())
        )
        times: dict[str, list[float]] = {f"st_bs{best}": []}
        cpus: dict[str, list[float]] = {f"st_bs{best}": []}
        ref = np.zeros((len(sentences), spec.hidden_size), np.float32)
        engines = {}

        async def run_all() -> None:
            for w, t in layouts:
                cfg = EngineConfig(
                    model=PaddleModel.from_pretrained(minilm_dir(), num_threads=t),
                    num_workers=w,
                    max_batch_tokens=args.max_batch_tokens,
                )
                eng = Engine(cfg)
                await eng.start()
                await engine_run(eng, text, sentences[:64])  # warm
                engines[f"engine_{w}x{t}"] = eng
                times[f"engine_{w}x{t}"] = []
                cpus[f"engine_{w}x{t}"] = []
            try:
                for r in range(args.rounds):
                    order = ["st", *engines, *reversed(engines), "st"]
                    for name in order:
                        if name == "st":
                            s, c = st.encode(best, os.path.join(tmp, "st.npy"), len(sentences))
                            times[f"st_bs{best}"].append(s)
                            cpus[f"st_bs{best}"].append(c)
                            ref[:] = np.load(os.path.join(tmp, "st.npy"))
                        else:
                            s, c, emb, res = await engine_run(engines[name], text, sentences)
                            cos = (emb * ref).sum(1)
                            times[name].append(s)
                            cpus[name].append(c)
                            sizes = [x.batch_size for x in res]
                            say(
                                f"round {r} {name}: {s:.2f} s, {c:.1f} CPU-s, min cosine vs st "
                                f"{cos.min():.7f}, batches of {statistics.median(sizes):.0f} "
                                "(median) requests"
                            )
                            continue
                        say(f"round {r} {name}: {s:.2f} s, {c:.1f} CPU-s")
            finally:
                for eng in engines.values():
                    await eng.close()

        asyncio.run(run_all())
    finally:
        st.close()
    st_med = statistics.median(times[f"st_bs{best}"])
    st_cpu = statistics.median(cpus[f"st_bs{best}"])
    say(
        "# medians: wall seconds, sentences/s and the ratio to sentence-transformers; CPU "
        "seconds (every thread of every process: load-proof) and sentences per CPU-second"
    )
    n = len(sentences)
    for name, ts in times.items():
        med, cpu = statistics.median(ts), statistics.median(cpus[name])
        say(
            f"{name:>14}: {med:7.2f} s {n / med:7.1f} sentences/s x{st_med / med:.2f} | "
            f"{cpu:7.1f} CPU-s {n / cpu:6.1f} sentences/CPU-s x{st_cpu / cpu:.2f}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
