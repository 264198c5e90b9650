"""aioprefill.hf is the only code that knows Hugging Face config keys and tensor names."""

from __future__ import annotations

import re
from pathlib import Path

import aioprefill

# Tensor names and config.json keys (as quoted strings: prose in docstrings may name them).
HF_NAMES = re.compile(
    r"""["'](model\.layers|model\.embed_tokens|lm_head\.weight|[a-z_.]*_proj\.(weight|bias)"""
    r"""|rope_scaling|rope_parameters|num_hidden_layers|num_attention_heads"""
    r"""|num_key_value_heads|quantization_config|use_sliding_window|layer_types"""
    r"""|num_local_experts|block_sparse_moe)"""
)


def test_hf_names_live_only_in_the_hf_package() -> None:
    root = Path(aioprefill.__file__).parent
    offenders = [
        f"{path.relative_to(root)}:{n}"
        for path in sorted(root.rglob("*.py"))
        if "hf" not in path.relative_to(root).parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if HF_NAMES.search(line)
    ]
    assert offenders == []
    # ... and the pattern does find them where they are.
    assert HF_NAMES.search((root / "hf" / "tensors.py").read_text())
    assert HF_NAMES.search((root / "hf" / "config.py").read_text())
