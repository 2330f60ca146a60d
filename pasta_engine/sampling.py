"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "sample"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens, and when to stop.

    Attributes:
        max_new_tokens: tokens the response may hold, all threads together (>= 1).
        temperature: 0 = greedy (argmax); otherwise logits are divided by it (> 0).
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens (0 = all).
        seed: seed of the request's own ``torch.Generator`` (same seed, same tokens).
        return_logprobs: fill ``result.logprobs`` with the natural-log probability of each
            sampled token under the model's (untempered) distribution.

    Raises ValueError naming the first bad field."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    return_logprobs: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
