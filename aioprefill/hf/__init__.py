"""The Hugging Face boundary: the only package that knows `config.json` keys (`hf.config`) and
checkpoint tensor names (`hf.tensors`). `PaddleModel.from_pretrained` lands here."""

from __future__ import annotations

import json
import os
from pathlib import Path

from aioprefill.config import PaddleModel
from aioprefill.errors import InvalidConfig
from aioprefill.hf.config import spec_fields
from aioprefill.hf.tensors import WeightsError

__all__ = ["WeightsError", "spec_from_pretrained"]

CONFIG_FILE = "config.json"


def spec_from_pretrained(path: str | os.PathLike[str], overrides: dict[str, object]) -> PaddleModel:
    """The `PaddleModel` of a checkpoint directory, `overrides` applied, its tensors checked
    against it (headers only: nothing is loaded here)."""
    from aioprefill.workers.weights import check_checkpoint

    directory = Path(os.fspath(path)).resolve()
    if not directory.is_dir():
        raise InvalidConfig(f"{os.fspath(path)}: not a checkpoint directory")
    config_path = directory / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise InvalidConfig(f"{directory}: no {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise InvalidConfig(f"{config_path}: not readable JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise InvalidConfig(f"{config_path}: not a JSON object")
    fields = {**spec_fields(config), "weights": str(directory)}
    known = set(PaddleModel.__struct_fields__)
    for name in overrides:
        if name not in known:
            raise InvalidConfig(f"PaddleModel.from_pretrained: unknown field {name!r}")
    fields.update(overrides)
    spec = PaddleModel(**fields)
    if spec.weights is not None:
        check_checkpoint(spec.weights, spec)
    return spec
