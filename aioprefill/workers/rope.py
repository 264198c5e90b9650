"""RoPE inverse frequencies for a `PaddleModel`: plain, linearly scaled, or Llama 3's scaling.

NumPy only, in float64 (`paddle.weights.rope_tables` builds the cos/sin tables from these and
casts them to the model's dtype). The formulas follow `transformers`' `modeling_rope_utils` for
the same settings.
"""

from __future__ import annotations

import numpy as np

from aioprefill.models import PaddleModel

__all__ = ["rope_inv_freq"]


def rope_inv_freq(spec: PaddleModel) -> np.ndarray:
    """`[head_dim // 2]` inverse frequencies: theta^(-2i/d), then the spec's scaling."""
    dim = spec.head_dim
    inv_freq = 1.0 / spec.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if spec.rope_type == "linear":
        # Position interpolation: positions divided by the factor, i.e. every frequency.
        return inv_freq / spec.rope_factor
    if spec.rope_type == "llama3":
        return _llama3(inv_freq, spec)
    return inv_freq


def _llama3(inv_freq: np.ndarray, spec: PaddleModel) -> np.ndarray:
    """Llama 3.1's scaling: wavelengths shorter than original/high_freq_factor keep their
    frequency, those longer than original/low_freq_factor are divided by the factor, and the
    band between is interpolated smoothly."""
    factor, low, high = spec.rope_factor, spec.rope_low_freq_factor, spec.rope_high_freq_factor
    old_context = spec.rope_original_max_position_embeddings
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled)
