"""Paddle is an extra: SimModel runs without it; PaddleModel without it fails at EngineConfig
construction naming the extra; the dev/CI install (`[test,bench]`) still pulls it in."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from aioprefill import EngineConfig, InvalidConfig, PaddleModel

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", ["paddle", "safetensors"])
def test_paddle_model_without_paddle_names_the_extra(monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)  # how Python marks a module as unimportable
    with pytest.raises(
        InvalidConfig,
        match=rf"EngineConfig.model: PaddleModel needs {module}, "
        r"not installed here: pip install 'aioprefill\[paddle\]'",
    ):
        EngineConfig(model=PaddleModel(seed=0))


def test_sim_model_runs_end_to_end_with_paddle_unimportable(tmp_path):
    script = tmp_path / "sim_only.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        sys.modules["paddle"] = None          # any `import paddle` now raises ImportError
        sys.modules["safetensors"] = None
        import asyncio
        from aioprefill import Engine, EngineConfig, InvalidConfig, PaddleModel, SimModel
        from aioprefill.workers.sim import expected_token

        async def main():
            async with Engine(EngineConfig(model=SimModel(fixed_ms=1.0), num_workers=2)) as e:
                r = await e.prefill([5, 6, 7])
            assert r.token == expected_token([5, 6, 7]), r
            try:
                EngineConfig(model=PaddleModel())
            except InvalidConfig as exc:
                print("refused:", exc)

        if __name__ == "__main__":
            asyncio.run(main())
            print("ok")
    """)
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "refused: EngineConfig.model: PaddleModel needs paddle and safetensors" in proc.stdout
    assert proc.stdout.strip().endswith("ok")


def test_extras_layout():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    hard = " ".join(meta["dependencies"])
    assert "paddle" not in hard and "safetensors" not in hard
    extras = meta["optional-dependencies"]
    assert any(d.startswith("paddlepaddle") for d in extras["paddle"])
    assert any(d.startswith("prometheus-client") for d in extras["prometheus"])
    assert any(d.startswith("mooncake-transfer-engine-non-cuda") for d in extras["transfer"])
    assert "mooncake" not in hard
    # dev.py installs [test,bench]: both must bring the real model (the bench's default, and
    # the model tests); the tests also the exporter and the transfer engine.
    assert "aioprefill[paddle]" in extras["bench"]
    assert "aioprefill[paddle,prometheus]" in extras["test"]
    assert "aioprefill[serve]" in extras["test"]  # tests/serve/
    assert {d.split(">")[0] for d in extras["serve"]} >= {"uvicorn", "httptools", "granian"}
    # text prompts: the tokenizer extra, in the test install too
    assert any(d.startswith("tokenizers") for d in extras["tokenizer"])
    assert "aioprefill[tokenizer]" in extras["test"]
    assert "aioprefill[transfer]" in extras["test"]
