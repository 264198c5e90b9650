"""Block hashes: chained, salted on the first block, the same in another process."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import numpy as np
import pytest

from aioprefill.errors import InvalidRequest
from aioprefill.sched.prefix import block_hashes, check_salt
from aioprefill.sched.prefix.hashing import seed_of


def ids(values) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def test_one_hash_per_full_block_chained_from_the_seed():
    tokens = ids(range(50))
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 3  # 50 tokens: three full blocks, the last 2 ids in none
    prev = seed_of(None)
    for i, h in enumerate(hashes):  # the documented recipe, spelled out
        prev = hashlib.blake2b(prev + tokens[64 * i : 64 * (i + 1)], digest_size=8).digest()
        assert h == struct.unpack("<Q", prev)[0]
    assert all(0 <= h < 1 << 64 for h in hashes)
    assert block_hashes(ids(range(15)), 16) == []


def test_a_block_hash_depends_on_everything_before_it():
    a = block_hashes(ids([1] * 48), 16)
    b = block_hashes(ids([2] + [1] * 47), 16)
    assert len(set(a)) == 3  # same ids, different parents: different hashes
    assert all(x != y for x, y in zip(a, b, strict=True))
    c = block_hashes(ids([1] * 32 + [3] * 16), 16)
    assert c[:2] == a[:2] and c[2] != a[2]


def test_salts_never_share_a_block():
    tokens = ids(range(64))
    plain, a, b = (block_hashes(tokens, 16, s) for s in (None, "tenant-a", "tenant-b"))
    assert a == block_hashes(tokens, 16, "tenant-a")
    assert not set(plain) & set(a) and not set(a) & set(b) and not set(plain) & set(b)


def test_the_same_in_another_process():
    """No per-process seed (Python's hash() is salted per process): another interpreter with
    another PYTHONHASHSEED gets the same values."""
    code = (
        "import numpy as np; from aioprefill.sched.prefix import block_hashes; "
        "print(block_hashes(np.arange(100, dtype='<i4').tobytes(), 16, 'x'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PYTHONPATH": ":".join(sys.path)},
    )
    assert out.stdout.strip() == str(block_hashes(ids(range(100)), 16, "x"))


@pytest.mark.parametrize("salt", ["", "x" * 257, 5, b"bytes"])
def test_bad_salts_are_refused(salt):
    with pytest.raises(InvalidRequest):
        check_salt(salt)
    check_salt(None)
    check_salt("x" * 256)
