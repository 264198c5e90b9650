"""How far a prefix-cache hit's answer is from the cache-off one on the real SmolLM2-135M
(runner level, no engine), per output, and what the default mode's exactness costs.

1. `diffs`: for the 126-token golden prompt and a 1,050-token one (real text), the largest
   |hit - miss| of every output (next token's logprob, top-5, prompt logprobs, prompt top-5,
   mean and last embeddings, the returned KV) over these hits: 1 block, all blocks but a
   partial last one, all but the last token, a hit followed by two more chunks, and the prompt
   chunked with the cache off. The miss is the whole prompt computed with the cache off.
2. `cost`: runner-level tokens per CPU-second (process CPU time, median of `--repeats`
   forwards after a warm-up; half as many of the full batch) of a lone 37-token request, a
   50-token suffix after a cached 1,000-token prefix, a full batch of 8 x 280 tokens, and the
   37-token request with prompt log-probabilities, and a lone 1,024-token prompt (where
   attention weighs most). To compare two versions of the code,
   alternate processes with each on PYTHONPATH (the command used is in the results).
3. `attention`: which of attention's steps change a row's bits with the shape they run in.

    python benchmarks/studies/prefix/bench_hit_exact.py diffs [--deterministic] [--threads 1]
    python benchmarks/studies/prefix/bench_hit_exact.py cost [--repeats 5] [--threads 1]
    python benchmarks/studies/prefix/bench_hit_exact.py attention [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: common.py
from common import ROOT

B = 16  # block tokens


def _runner(deterministic: bool, threads: int, blocks: int, block_tokens: int = B):
    from aioprefill import PaddleModel
    from aioprefill.workers.paddle.runner import PaddleRunner
    from tests.hf.smollm2 import gguf_path

    spec = PaddleModel.from_pretrained(
        gguf_path(), device="cpu", deterministic=deterministic, num_threads=threads
    )
    bytes_ = blocks * 776_834 * block_tokens // B
    runner = PaddleRunner(spec, prefix_cache_bytes=bytes_, block_tokens=block_tokens)
    floor, tiles = getattr(runner, "_floor", None), getattr(runner._mm, "tile_rows", None)
    print(f"products: at least {floor} rows, fixed tiles: {tiles}", flush=True)
    return runner


def _text(n: int) -> np.ndarray:
    """n real token ids: the golden prompts back to back."""
    from tests.hf.smollm2 import goldens

    ids = [i for c in goldens()["cases"] for i in c["ids"]]
    return np.asarray((ids * (n // len(ids) + 1))[:n], dtype=np.int32)


def diffs(args: argparse.Namespace) -> None:
    from aioprefill.shm.segments import SHM_DIR, attach_segment, segment_name
    from aioprefill.wire import protocol
    from aioprefill.wire.kv import kv_layout
    from tests.model.batches import make_batch
    from tests.model.prefix import ALL, FIELDS, concat_outputs, planned, with_options

    runner = _runner(args.deterministic, args.threads, 80)
    layout = kv_layout(runner.spec)
    rid = itertools.count(1)
    names: list[str] = []

    def run(chunks, plans=None, options=ALL):
        """One request in chunks ((tokens, start)), with plans (reads, writes, first); the
        joined outputs and the returned KV [layers, kv_heads, tokens, dim] x 2."""
        r, outs = next(rid), []
        name = segment_name("kv.hit-exact")
        names.append(name)
        for j, (tokens, start) in enumerate(chunks):
            last = j == len(chunks) - 1
            batch = make_batch([tokens], ids=[r], starts=[start], last=[last])
            kv = (name,) if last else ()
            opts = options | (protocol.OPT_RETURN_KV if last else 0)
            batch = with_options(batch, [opts], [5], kv)
            if plans is not None:
                batch = planned(batch, [plans[j][0]], [plans[j][1]], [plans[j][2]])
            outs.append(runner.forward(batch))
        n = chunks[-1][1] + len(chunks[-1][0])
        mm = attach_segment(name)
        kv = [a.copy() for a in layout.views(mm, n)]
        mm.close()
        return concat_outputs(outs), kv

    def report(what: str, got, want) -> None:
        cols = []
        for field in FIELDS[2:]:
            a, b = getattr(got[0], field), getattr(want[0], field)
            if a.dtype.kind in "iu":
                cols.append(f"{field}={'same' if np.array_equal(a, b) else 'DIFFER'}")
            else:
                cols.append(f"{field}={np.abs(a.astype(np.float64) - b).max(initial=0):.1e}")
        kv = max(float(np.abs(x - y).max()) for x, y in zip(got[1], want[1], strict=True))
        print(f"  {what:28s} {' '.join(cols)} kv={kv:.1e}", flush=True)

    slots = itertools.count()
    try:
        for n, last_opts in ((126, 0), (1050, 0), (126, protocol.OPT_EMBED_LAST)):
            p = _text(n) if n != 126 else _golden()
            options = ALL if not last_opts else protocol.OPT_PROMPT_LOGPROBS | last_opts
            full = n // B
            print(f"{n} tokens ({'embed last' if last_opts else 'embed mean'}):", flush=True)
            want = run([(p, 0)], options=options)
            writes = [next(slots) for _ in range(full)]
            report("writer (whole prompt)", run([(p, 0)], [([], writes, 0)], options), want)
            report("hit 1 block", run([(p[B:], B)], [(writes[:1], [], 0)], options), want)
            cut = full * B if full * B < n else (full - 1) * B
            hit = run([(p[cut:], cut)], [(writes[: cut // B], [], 0)], options)
            report(f"hit {cut // B} blocks ({n - cut} left)", hit, want)
            short = p[: cut + 1]
            hit = run([(short[cut:], cut)], [(writes[: cut // B], [], 0)], options)
            report("all but the last token", hit, run([(short, 0)], options=options))
            mid = (cut // 2 // B) * B
            chunks = [(p[B:mid], B), (p[mid : mid + 7], mid), (p[mid + 7 :], mid + 7)]
            plans = [(writes[:1], [], 0), ([], [], 0), ([], [], 0)]
            report("hit then 2 chunks", run(chunks, plans, options), want)
            bounds = [0, 40, 47, n]
            chunks = [(p[a:b], a) for a, b in itertools.pairwise(bounds)]
            report("cache off, chunks 40/7/rest", run(chunks, options=options), want)
    finally:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / name).unlink()


def _golden() -> np.ndarray:
    from tests.hf.smollm2 import goldens

    case = max(goldens()["cases"], key=lambda c: len(c["ids"]))
    return np.asarray(case["ids"], dtype=np.int32)


def cost(args: argparse.Namespace) -> None:
    from aioprefill.wire import protocol
    from tests.model.batches import make_batch
    from tests.model.prefix import planned, with_options

    runner = _runner(args.deterministic, args.threads, 130, block_tokens=8)
    prefix = _text(1050)
    runner.forward(planned(make_batch([prefix[:1000]], ids=[1]), [[]], [list(range(125))]))
    rng = np.random.default_rng(0)
    vocab = runner.spec.vocab_size
    batches = {
        "1x37": make_batch([rng.integers(0, vocab, 37).astype(np.int32)], ids=[2]),
        "50 after 1000": planned(  # 125 cached blocks of 8 tokens
            make_batch([prefix[1000:]], ids=[3], starts=[1000]), [list(range(125))]
        ),
        "8x280": make_batch([rng.integers(0, vocab, 280).astype(np.int32) for _ in range(8)]),
    }
    one = make_batch([rng.integers(0, vocab, 37).astype(np.int32)], ids=[4])
    batches["1x37 scored"] = with_options(one, [protocol.OPT_PROMPT_LOGPROBS], [0])
    batches["1x1024"] = make_batch([rng.integers(0, vocab, 1024).astype(np.int32)], ids=[5])
    for label, batch in batches.items():
        runner.forward(batch)
        cpus = []
        for _ in range(args.repeats if len(batch.tokens) < 1000 else max(1, args.repeats // 2)):
            t = time.process_time()
            runner.forward(batch)
            cpus.append(time.process_time() - t)
        cpu = statistics.median(cpus)
        tokens = len(batch.tokens)
        print(
            f"  {label:14s} {tokens:5d} computed tokens  {cpu * 1e3:8.1f} CPU-ms  "
            f"{tokens / cpu:7.0f} tok/CPU-s",
            flush=True,
        )


def attention(args: argparse.Namespace) -> None:
    """Which of attention's steps change a row's bits with the block's shape (SmolLM2's heads,
    1,050 keys, unit-normal data): the scores' product with its key count and query rows, the
    softmax and the probabilities x values product with masked keys after the row's own."""
    import paddle
    import paddle.nn.functional as F

    paddle.set_device("cpu")
    paddle.base.core.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    kv_heads, rows, dim, n = 3, 150, 64, 1050

    def t(*shape: int) -> paddle.Tensor:
        return paddle.to_tensor(rng.standard_normal(shape).astype(np.float32))

    q, k, v = t(kv_heads, rows, dim), t(kv_heads, n + 100, dim), t(kv_heads, n + 100, dim)
    scores = paddle.matmul(q, k[:, :n], transpose_y=True)
    more_keys = paddle.matmul(q, k[:, : n + 38], transpose_y=True).numpy()[..., :n]
    fewer_rows = paddle.matmul(q[:, :60], k[:, :n], transpose_y=True).numpy()
    print(f"  scores, 38 more keys: same bits {np.array_equal(scores.numpy(), more_keys)}")
    print(
        f"  scores, 60 of 150 rows: same bits {np.array_equal(scores.numpy()[:, :60], fewer_rows)}"
    )
    probs = F.softmax(scores, axis=-1)
    out = paddle.matmul(probs, v[:, :n]).numpy()
    for m in (1, 7, 38, 64):
        masked = paddle.full([kv_heads, rows, m], float("-inf"))
        p2 = F.softmax(paddle.concat([scores, masked], axis=-1), axis=-1)
        zeros = paddle.zeros([kv_heads, m, dim])
        o2 = paddle.matmul(p2, paddle.concat([v[:, :n], zeros], axis=1)).numpy()
        same = np.array_equal(probs.numpy(), p2.numpy()[..., :n])
        print(
            f"  {m:3d} masked keys after: softmax same bits {same}, "
            f"probs x values max |d| {np.abs(out - o2).max():.1e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("diffs", "cost", "attention"))
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sys.path.append(str(ROOT))  # after PYTHONPATH: the code measured may be another checkout
    from aioprefill.workers.paddle.env import library_versions

    print(f"$ python benchmarks/studies/prefix/bench_hit_exact.py {' '.join(sys.argv[1:])}")
    print(f"{library_versions()}, {args.threads} thread(s)", flush=True)
    {"diffs": diffs, "cost": cost, "attention": attention}[args.part](args)


if __name__ == "__main__":
    main()
