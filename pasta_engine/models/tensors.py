"""Small tensor checks shared by the loader (before a merge) and the weight adapter (after it),
kept apart from both so that neither imports the other (the model-seam import contract)."""
from __future__ import annotations

import torch

__all__ = ["same_tensor"]


def same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether ``a`` and ``b`` (any shape and float dtype, e.g. a state dict's ``lm_head.weight``
    and ``model.embed_tokens.weight``, ``[vocab, hidden]``) are one tensor: the very same storage
    and layout (a head ``transformers`` tied to its embedding) or equal shapes holding equal
    values once ``b`` is cast to ``a``'s dtype (a file that stores both). False when either is
    None. Raises nothing."""
    if a is None or b is None or a.shape != b.shape:
        return False
    return (a.data_ptr() == b.data_ptr() and a.stride() == b.stride()) or torch.equal(a, b.to(a.dtype))
