"""The Hugging Face boundary: the only package that knows `config.json` keys (`hf.config`),
checkpoint tensor names (`hf.tensors`) and GGUF files (`hf.gguf`, `hf.gguf_file`).
`PaddleModel.from_pretrained` lands here."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeVar

from aioprefill.errors import InvalidConfig
from aioprefill.hf.config import spec_fields
from aioprefill.hf.dtype import checkpoint_dtype, gguf_dtype, resolve_dtype
from aioprefill.hf.encoder import ENCODERS, sentence_transformers_fields
from aioprefill.hf.spec import ModelShape
from aioprefill.hf.tensors import WeightsError

Spec = TypeVar("Spec", bound=ModelShape)  # the spec class passed in (PaddleModel)

__all__ = ["WeightsError", "check_spec_against_config", "spec_from_pretrained"]

CONFIG_FILE = "config.json"
# Fields that decide which function the model computes: from_pretrained takes them from
# config.json and the checkpoint, never from an override. (Others, such as device, dtype,
# num_threads, deterministic or max_position_embeddings, may be overridden.)
_FUNCTION_FIELDS = frozenset(
    {
        "architecture",
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "rope_theta",
        "rope_type",
        "rope_factor",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
        "rope_original_max_position_embeddings",
        "rms_norm_eps",
        "attention_bias",
        "qk_norm",
        "sliding_window",
        "tie_word_embeddings",
        "num_experts",
        "num_experts_per_tok",
        "layer_norm_eps",
        "type_vocab_size",
        "position_offset",
        "num_labels",
        "local_attention",
        "local_rope_theta",
        "global_attn_every_n_layers",
        "classifier_pooling",
        "weights",
        "seed",
    }
)


def spec_from_pretrained(
    cls: type[Spec], path: str | os.PathLike[str], overrides: dict[str, object]
) -> Spec:
    """The `PaddleModel` (`cls`, passed in: this package sits below the specs and never imports
    them) of a checkpoint directory (or a `.gguf` file), `overrides` applied, its tensors checked
    against it (headers only: nothing is loaded here)."""
    from aioprefill.hf.weights import check_checkpoint

    directory = Path(os.fspath(path)).resolve()
    if directory.suffix == ".gguf" and directory.is_file():
        return _spec_from_gguf(cls, directory, overrides)
    if not directory.is_dir():
        raise InvalidConfig(f"{os.fspath(path)}: not a checkpoint directory")
    if not (directory / CONFIG_FILE).is_file():
        raise InvalidConfig(f"{directory}: no {CONFIG_FILE}")
    config = _read_config(directory)
    fields = {**spec_fields(config), "weights": str(directory)}
    if fields["architecture"] in ENCODERS:  # its pooling, Normalize, max_seq_length
        fields.update(sentence_transformers_fields(directory))
        # encoders compute in float32 only: `auto` means float32 whatever the checkpoint holds
        if overrides.get("dtype", "auto") == "auto":
            overrides = {**overrides, "dtype": "float32"}
    else:
        overrides = _with_dtype(overrides, checkpoint_dtype(config), str(directory))
    _check_overrides(cls, overrides)
    spec = cls(**{**fields, **overrides})
    check_checkpoint(str(directory), spec)
    return spec


def _spec_from_gguf(cls: type[Spec], path: Path, overrides: dict[str, object]) -> Spec:
    """A GGUF file's spec (`hf.gguf`), its tensors checked from the header; logs the size the
    weights take once dequantized."""
    from aioprefill.hf import gguf

    header = gguf.read_header(path)
    overrides = _with_dtype(overrides, gguf_dtype(header), str(path))
    _check_overrides(cls, overrides)
    spec = cls(**{**gguf.gguf_spec_fields(header), **overrides})
    gguf.check_tensors(header, spec)
    gguf.log_size(header, spec.dtype)
    return spec


def _with_dtype(overrides: dict[str, object], stored: str, source: str) -> dict[str, object]:
    """`overrides` with `dtype` resolved (`hf.dtype`): `auto`, the default, becomes the
    checkpoint's dtype where the device computes it well, float32 otherwise."""
    requested = str(overrides.get("dtype", "auto"))
    device = str(overrides.get("device", "auto"))
    return {**overrides, "dtype": resolve_dtype(requested, stored, device, source)}


def _check_overrides(cls: type[Spec], overrides: dict[str, object]) -> None:
    known = set(cls.__struct_fields__)
    for name in overrides:
        if name not in known:
            raise InvalidConfig(f"PaddleModel.from_pretrained: unknown field {name!r}")
        if name in _FUNCTION_FIELDS:
            raise InvalidConfig(
                f"PaddleModel.from_pretrained: {name} comes from the checkpoint and cannot be "
                "overridden (it would compute a different function)"
            )


def check_spec_against_config(spec: ModelShape) -> None:
    """For a spec whose `weights` is a directory with a config.json (or a GGUF file): raise
    `InvalidConfig` unless every field config.json (the GGUF metadata) decides has the value it
    gives (a hand-written spec that left out, say, rope_theta would otherwise run the checkpoint
    as a different function)."""
    if spec.weights is None:
        return
    source = Path(spec.weights)
    if source.suffix == ".gguf" and source.is_file():
        from aioprefill.hf import gguf

        header = gguf.read_header(source)
        gguf.check_tensors(header, spec)
        decided = gguf.gguf_spec_fields(header)
        decided.pop("weights")
    elif (source / CONFIG_FILE).is_file():
        decided = spec_fields(_read_config(source))
        source = source / CONFIG_FILE
    else:
        return
    for name, value in decided.items():
        have = getattr(spec, name)
        if name == "max_position_embeddings":
            continue  # a limit, not part of the function
        # A narrower window only refuses more prompts.
        window = name == "sliding_window" and have is not None and have <= value
        if have != value and not window:
            raise InvalidConfig(
                f"PaddleModel.{name} is {have!r} but {source} gives {value!r}; "
                "use PaddleModel.from_pretrained to read every setting"
            )


def _read_config(directory: Path) -> dict[str, Any]:
    config_path = directory / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidConfig(f"{config_path}: not readable JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise InvalidConfig(f"{config_path}: not a JSON object")
    return config
