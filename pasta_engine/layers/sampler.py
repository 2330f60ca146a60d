"""The sampler: greedy, temperature, top-k, top-p (parameters in :mod:`pasta_engine.config`)."""

from __future__ import annotations

import torch

from ..config import SamplingParams

__all__ = ["sample", "logprobs_of"]


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``[N, vocab]`` float32 (rows of one request's threads).
        params: the request's :class:`SamplingParams`.
        generator: the request's generator (on the logits' device); unused when greedy.

    Returns ``[N]`` int64 token ids. Filtering follows HF ``generate``'s order: temperature,
    then top-k, then top-p (Holtzman et al. 2020, "The Curious Case of Neural Text
    Degeneration", section 3.1)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    x = logits / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(dim=-1)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, sorted_x)
    probs = x.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Natural-log probability ``[N]`` float32 of ``tokens`` ``[N]`` under the untempered
    distributions ``logits`` ``[N, vocab]``."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, tokens[:, None]).squeeze(1)
