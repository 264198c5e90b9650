"""Security properties: private, unguessable segments; typed decoding only; no pickle and no
dynamic code execution anywhere in the package."""

from __future__ import annotations

import ast
import os
import re
import stat
from pathlib import Path

import msgspec
import pytest

import aioprefill
from aioprefill import Engine, EngineConfig
from aioprefill.wire import protocol
from tests.conftest import own_segments
from tests.reliability.util import SHM, sim

PACKAGE = Path(aioprefill.__file__).parent
NAME = re.compile(rf"aioprefill-{os.getpid()}-([0-9a-f]{{16}})-w\d+-(in|out)")


@pytest.mark.asyncio
async def test_segments_are_private_and_unguessable():
    randoms: set[str] = set()
    for _ in range(2):
        async with Engine(EngineConfig(model=sim(), num_workers=2)) as engine:
            await engine.prefill([1])
            names = own_segments()
            assert len(names) == 4
            for name in names:
                m = NAME.fullmatch(name)
                assert m, name
                randoms.add(m.group(1))  # 64 random bits from `secrets`
                st = (SHM / name).stat()
                assert stat.S_IMODE(st.st_mode) == 0o600
                assert st.st_uid == os.getuid()
    assert len(randoms) == 8  # every segment of both engines has its own random part


def test_decoders_are_typed():
    """Each direction decodes into its own closed union of Structs, nothing else."""
    assert protocol._to_worker.type == protocol.ToWorker
    assert protocol._from_worker.type == protocol.FromWorker
    assert protocol._spec_decoder.type is protocol.WorkerSpec
    for union in (protocol.ToWorker, protocol.FromWorker):
        for cls in union.__args__:
            assert issubclass(cls, msgspec.Struct)


FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}


def test_no_pickle_and_no_dynamic_code_in_the_package():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                mods = {(node.module or "").split(".")[0]}
                if node.module == "multiprocessing" and any(
                    a.name in ("reduction",) for a in node.names
                ):
                    # Only for passing fds at spawn (DupFd), never for the data path.
                    assert path.name == "process.py", path
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in FORBIDDEN_CALLS:
                    offenders.append(f"{path.name}:{node.lineno} {node.func.id}()")
                continue
            elif isinstance(node, ast.Attribute) and node.attr in ("loads", "load"):
                base = node.value
                if isinstance(base, ast.Name) and base.id in FORBIDDEN_MODULES:
                    offenders.append(f"{path.name}:{node.lineno} {base.id}.{node.attr}")
                continue
            else:
                continue
            bad = mods & FORBIDDEN_MODULES
            if bad:
                offenders.append(f"{path.name}:{node.lineno} import {sorted(bad)}")
    assert not offenders
