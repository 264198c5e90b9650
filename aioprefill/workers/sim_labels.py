"""A `SimRunner`'s label token logprobs (`label_token_ids`): deterministic, from the prompt's
token and logprob alone, consistent with its top-k (`sim.sim_top_k`: the token first, each id
after it 0.25 less), so the greedy token's label logprob equals its logprob."""

from __future__ import annotations

import numpy as np

__all__ = ["sim_label_logprobs"]


def sim_label_logprobs(
    token: int, logprob: float, label_ids: np.ndarray | list[int], vocab_size: int
) -> np.ndarray:
    """float32[len(label_ids)]: `logprob - 0.25 * ((id - token) mod vocab_size)` per id. For a
    prompt, `token` and `logprob` are `sim.expected_token(prompt, vocab_size)` and
    `sim.expected_logprob(prompt)`."""
    j = (np.asarray(label_ids, dtype=np.int64) - token) % vocab_size
    return (logprob - 0.25 * j).astype(np.float32)
