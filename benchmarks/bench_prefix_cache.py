"""What the prefix cache saves on the real SmolLM2-135M, runner level (issue 22, worker side).

In this process, one `PaddleRunner` (CPU, `--threads`), the cache plans written by hand as the
engine would send them (16-token blocks), random token ids (the cost does not depend on them):

a. A chat turn: 1,000 tokens of history already cached (written by the previous turn) + 50
   new tokens. Cache off: the 1,050-token prompt computed whole. Hit: 62 blocks (992 tokens)
   read, 58 tokens computed. Also what writing costs: the 1,050-token prompt writing its 65
   blocks vs the same forward with the cache off.
b. Scoring (lm-eval's multiple choice): a 5-shot context of 600 tokens, 4 choices of 8 tokens,
   each choice a full prompt with prompt log-probabilities at every position, the 4 in one
   batch. Cache off: 4 x 608 tokens. Cached context: every choice reads the context's 37
   blocks and computes 16 tokens; its prompt logprobs over the cached positions are the ones
   kept with the blocks (written by a request that scored the context), or, for blocks whose
   writer did not ask, the LM head on their stored hidden rows. Piggyback (a cold cache): the
   first choice writes the context, the other three read it in the same forward.
c. Deterministic mode (bitwise results): the chat turn, hit vs off.
d. The chat turn through the engine (`--engine`): two engines side by side, one SmolLM2 worker
   each (`prefix_cache_bytes` default vs 0), turns alternating between them (A B B A ...): each
   turn is the same 1,000-token history plus 50 new tokens, timed from `prefill()` to its
   result (the cache-on engine saw the history once before, as the previous turn).
e. A burst through the cache-on engine (`--engine`): 32 prompts sharing a 1,000-token prefix
   nobody cached, each + 50 tokens of its own, sent at once: the tokens computed (prompt tokens
   minus `cached_tokens`) against the prefix + the 32 suffixes.

Each pair is measured side by side, interleaved (A B B A ...); medians of `--repeats`; quote
the ratios (the machine is shared). Outputs are checked equal (1e-5 relative) on the way.

    python benchmarks/bench_prefix_cache.py [--repeats 5] [--threads 1] [--engine]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time

import numpy as np

from aioprefill import PaddleModel
from aioprefill.wire import protocol
from aioprefill.workers.runner import ForwardBatch, ForwardOutput

B = 16
PLP = protocol.OPT_PROMPT_LOGPROBS


def batch(
    prompts: list[np.ndarray],
    starts: list[int],
    reads: list[list[int]] | None = None,
    writes: list[list[int]] | None = None,
    options: int = 0,
) -> ForwardBatch:
    n = len(prompts)
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in prompts])]).astype(np.int32)
    b = ForwardBatch(
        request_ids=np.arange(n, dtype=np.int64),
        offsets=offsets,
        tokens=np.concatenate(prompts).astype(np.int32),
        start_pos=np.asarray(starts, dtype=np.int32),
        is_last=np.ones(n, dtype=bool),
        options=np.full(n, options, dtype=np.uint8) if options else None,
    )
    if reads is None and writes is None:
        return b

    def col(xs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        offs = np.concatenate([[0], np.cumsum([len(x) for x in xs])]).astype(np.int32)
        return offs, np.asarray([s for x in xs for s in x], dtype=np.int32)

    ro, rs = col(reads or [[]] * n)
    wo, ws = col(writes or [[]] * n)
    return dataclasses.replace(
        b,
        read_offsets=ro,
        read_slots=rs,
        write_offsets=wo,
        write_slots=ws,
        write_first=np.zeros(n, dtype=np.int32),
    )


def side_by_side(runner, runs: dict[str, ForwardBatch], repeats: int) -> dict[str, float]:
    """Median wall seconds of each batch's forward, interleaved A B B A ..."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            runner.forward(runs[name])
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def close(a: ForwardOutput, b: ForwardOutput) -> None:
    for name in ("tokens", "logprobs", "prompt_logprobs"):
        x, y = getattr(a, name).astype(np.float64), getattr(b, name).astype(np.float64)
        assert x.shape == y.shape, name
        assert (np.abs(x - y) / np.maximum(1, np.abs(y))).max(initial=0) <= 1e-5, name


def report(title: str, t: dict[str, float], base: str) -> None:
    print(f"\n{title}")
    for name, s in t.items():
        print(f"  {name:<44} {s * 1e3:9.1f} ms   {t[base] / s:6.2f}x vs {base}")


def chat(runner, rng: np.random.Generator, repeats: int) -> None:
    vocab = runner.spec.vocab_size
    prompt = rng.integers(0, vocab, 1050).astype(np.int32)
    history = 1000 // B  # 62 blocks
    runner.forward(batch([prompt[:1000]], [0], writes=[list(range(history))]))  # turn before
    cached = history * B
    runs = {
        "cache off (1,050 computed)": batch([prompt], [0]),
        "hit (992 read, 58 computed)": batch(
            [prompt[cached:]], [cached], reads=[list(range(history))]
        ),
    }
    tag = " (deterministic)" if runner.spec.deterministic else ""
    if not tag:
        writes = [list(range(100, 100 + 1050 // B))]
        runs["cache off, writing 65 blocks"] = batch([prompt], [0], writes=writes)
    close(
        runner.forward(runs["hit (992 read, 58 computed)"]), runner.forward(runs[next(iter(runs))])
    )
    report(
        f"a. chat turn{tag}: 1,000 cached + 50 new tokens",
        side_by_side(runner, runs, repeats),
        "cache off (1,050 computed)",
    )


def scoring(runner, rng: np.random.Generator, repeats: int) -> None:
    vocab = runner.spec.vocab_size
    context = rng.integers(0, vocab, 600).astype(np.int32)
    choices = [np.concatenate([context, rng.integers(0, vocab, 8)]) for _ in range(4)]
    blocks = 600 // B  # 37
    c = blocks * B
    rest = [p[c:] for p in choices]
    kept, bare, pig = (list(range(at, at + blocks)) for at in (200, 250, 300))
    # The context's blocks written by a request that scored it (its prompt logprobs kept with
    # them), and by one that did not (a reader runs the head on the hidden rows).
    runner.forward(batch([context], [0], writes=[kept], options=PLP))
    runner.forward(batch([context], [0], writes=[bare]))
    runs = {
        "cache off (4 x 608 computed)": batch(choices, [0] * 4, options=PLP),
        "context cached, its logprobs kept": batch(rest, [c] * 4, reads=[kept] * 4, options=PLP),
        "context cached, head on hidden rows": batch(rest, [c] * 4, reads=[bare] * 4, options=PLP),
        "cold, piggyback (608 + 3 x 16 computed)": batch(
            [choices[0], *rest[1:]],
            [0] + [c] * 3,
            reads=[[], pig, pig, pig],
            writes=[pig, [], [], []],
            options=PLP,
        ),
    }
    want = runner.forward(runs["cache off (4 x 608 computed)"])
    for name in list(runs)[1:]:
        close(runner.forward(runs[name]), want)
    report(
        "b. scoring: 4 choices x (600-token 5-shot context + 8), prompt logprobs everywhere",
        side_by_side(runner, runs, repeats),
        "cache off (4 x 608 computed)",
    )


async def engine_chat(model: PaddleModel, repeats: int) -> None:
    from aioprefill import Engine, EngineConfig

    rng = np.random.default_rng(1)
    history = rng.integers(0, model.vocab_size, 1000).tolist()
    async with (
        Engine(EngineConfig(model=model)) as on,
        Engine(EngineConfig(model=model, prefix_cache_bytes=0)) as off,
    ):
        await on.prefill(history)  # the previous turn
        times: dict[str, list[float]] = {"cache off": [], "cache on": []}
        for r in range(repeats):
            turn = history + rng.integers(0, model.vocab_size, 50).tolist()
            pair = [("cache off", off), ("cache on", on)]
            answers = {}
            for name, engine in pair if r % 2 == 0 else pair[::-1]:
                t = time.perf_counter()
                answers[name] = await engine.prefill(turn)
                times[name].append(time.perf_counter() - t)
            a, b = answers["cache on"], answers["cache off"]
            assert a.cached_tokens == 992 and a.token == b.token
            assert abs(a.logprob - b.logprob) <= 1e-5
        t = {k: statistics.median(v) for k, v in times.items()}
        report("d. chat turn through the engine: 1,000 cached + 50 new", t, "cache off")
        prefix = rng.integers(0, model.vocab_size, 1000).tolist()
        burst = [prefix + rng.integers(0, model.vocab_size, 50).tolist() for _ in range(32)]
        start = time.perf_counter()
        results = await asyncio.gather(*(on.prefill(p) for p in burst))
        wall = time.perf_counter() - start
        computed = sum(len(p) - r.cached_tokens for p, r in zip(burst, results, strict=True))
        ideal = 1000 + 32 * 50
        print(
            f"\ne. burst of 32 sharing a new 1,000-token prefix: {computed:,} tokens computed, "
            f"{computed / ideal:.2f}x the prefix + 32 suffixes ({ideal:,}); "
            f"{max(r.batch_size for r in results)} in the largest batch; {wall:.1f} s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--engine", action="store_true", help="only d., through the engine")
    args = parser.parse_args()
    from aioprefill.workers.paddle.runner import PaddleRunner
    from tests.hf.smollm2 import gguf_path

    if args.engine:
        import uvloop

        model = PaddleModel.from_pretrained(gguf_path(), device="cpu", num_threads=args.threads)
        uvloop.run(engine_chat(model, args.repeats))
        return
    rng = np.random.default_rng(0)
    for det in (False, True):
        spec = PaddleModel.from_pretrained(
            gguf_path(), device="cpu", num_threads=args.threads, deterministic=det
        )
        runner = PaddleRunner(spec, prefix_cache_bytes=400 * 776_834)
        assert runner.cache_blocks == 400
        print(f"SmolLM2-135M, {args.threads} thread(s), deterministic={det}: "
              f"{runner.cache_blocks} slots of {runner.block_bytes:,} bytes")  # fmt: skip
        chat(runner, rng, args.repeats)
        if not det:
            scoring(runner, rng, args.repeats)


if __name__ == "__main__":
    main()
