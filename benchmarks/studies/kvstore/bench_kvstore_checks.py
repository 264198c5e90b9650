"""What checking a stored block costs: the checksum functions alone (CRC32 through zlib, XXH3
64 and 128 through `xxhash`, keyed BLAKE2b-128 through hashlib) over one value's bytes, and
`ValueCodec.check` (every check a load makes: header, token ids, checksum) and `seal` (what the
put thread adds per block), for a gpu-class SimModel block (16 tokens x 2 KiB: 32 KiB) and a
SmolLM2-135M block (16 tokens, 737 KiB). Median of `--repeats` timings of `--loops` calls each,
in microseconds per value; run on this host as it is (say its load with the figures).

    python benchmarks/studies/kvstore/bench_kvstore_checks.py [--loops 200] [--repeats 15]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
import zlib
from collections.abc import Callable

import numpy as np

from aioprefill.kvstore.identity import StoreIdentity
from aioprefill.kvstore.value import HEADER_BYTES, ValueCodec

try:
    import xxhash
except ImportError:  # the kvstore extra installs it
    xxhash = None

BLOCK = 16
SIZES = {"gpu-class 32 KiB": 32 << 10, "SmolLM2-135M 720 KiB": 737_280}


def per_call_us(fn: Callable[[], object], loops: int, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        for _ in range(loops):
            fn()
        times.append((time.perf_counter_ns() - t) / loops / 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loops", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    ident = StoreIdentity("bench", "float32", "bench", BLOCK)
    tokens = np.arange(BLOCK, dtype=np.int32)
    key = b"k" * 32
    print(f"# bench_kvstore_checks: median of {args.repeats} x {args.loops} calls, us per value")
    for name, payload in SIZES.items():
        data = memoryview(np.random.default_rng(0).integers(0, 256, payload, dtype=np.uint8))
        rows: dict[str, Callable[[], object]] = {
            "zlib.crc32": lambda d=data: zlib.crc32(d),
            "blake2b-128 keyed": lambda d=data: hashlib.blake2b(
                d, digest_size=16, key=key
            ).digest(),
        }
        if xxhash is not None:
            rows["xxh3_64"] = lambda d=data: xxhash.xxh3_64_intdigest(d)
            rows["xxh3_128"] = lambda d=data: xxhash.xxh3_128_digest(d)
        for secret in (None, key):
            codec = ValueCodec(ident.digest, BLOCK, payload, secret)
            value = memoryview(bytearray(codec.value_bytes))
            codec.write_header(value, 0xABC, tokens)[:] = data
            codec.seal(value)
            kind = "keyed" if secret else "plain"
            rows[f"ValueCodec.check ({kind})"] = lambda c=codec, v=value: c.check(v, 0xABC, tokens)
            rows[f"ValueCodec.seal ({kind})"] = lambda c=codec, v=value: c.seal(v)
        print(f"{name} ({payload + HEADER_BYTES + 4 * BLOCK} B a value):")
        for label, fn in rows.items():
            us = per_call_us(fn, args.loops, args.repeats)
            print(f"  {label:26} {us:9.2f} us  {payload / us / 1e3:7.2f} GB/s")


if __name__ == "__main__":
    main()
