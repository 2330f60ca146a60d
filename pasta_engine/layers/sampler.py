"""The sampler: greedy, temperature, top-k, top-p (parameters in :mod:`pasta_engine.config`).

:func:`sample` picks the tokens of one request's rows; :func:`sample_batch` does the same for
every row of a step in one call (per-row parameters as tensors, each request's random numbers
drawn from its own generator by :func:`draw_noise`) and picks the same tokens."""

from __future__ import annotations

import torch

from ..config import SamplingParams

__all__ = ["sample", "sample_batch", "draw_noise", "logprobs_of", "apply_repetition_penalty", "MIN_TOP_P"]

#: A smaller top_p is taken as this one (keeps the most likely token, as any tiny top_p does): a
#: top_p such as 1e-300 rounds to 0 in float32, and a zero top_p dropped every token (nan).
MIN_TOP_P = 1e-6


def apply_repetition_penalty(logits: torch.Tensor, rows: list[int], seen: list[list[int]],
                             penalties: list[float]) -> torch.Tensor:
    """The logits with the repetition penalty applied (a new tensor): for each ``rows[i]``, the
    logit of every id in ``seen[i]`` is divided by ``penalties[i]`` when positive and multiplied
    by it when negative (Keskar et al. 2019, "CTRL", section 4.1; ``transformers``'
    ``RepetitionPenaltyLogitsProcessor`` rule).

    Args:
        logits: ``[N, vocab]`` float32.
        rows: row indices into ``logits`` that get a penalty.
        seen: per such row, the token ids the thread has seen (repeats allowed).
        penalties: per such row, the penalty (> 0)."""
    r = torch.tensor([row for row, ids in zip(rows, seen) for _ in ids], dtype=torch.long)
    c = torch.tensor([i for ids in seen for i in ids], dtype=torch.long)
    p = torch.ones(logits.shape[0], 1, dtype=logits.dtype)
    p[rows, 0] = torch.tensor(penalties, dtype=logits.dtype)
    mask = torch.zeros(logits.shape, dtype=torch.bool)
    mask[r, c] = True
    dev = logits.device
    mask, p = mask.to(dev, non_blocking=True), p.to(dev, non_blocking=True)
    return torch.where(mask, torch.where(logits > 0, logits / p, logits * p), logits)


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
        drop = probs.cumsum(dim=-1) - probs >= max(params.top_p, MIN_TOP_P)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, sorted_x)
    probs = x.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Natural-log probability ``[N]`` float32 of ``tokens`` ``[N]`` under the untempered
    distributions ``logits`` ``[N, vocab]``."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, tokens[:, None]).squeeze(1)


def draw_noise(out: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill ``out`` (``[n, vocab]`` float32, contiguous rows of one request) with Exp(1) noise
    from the request's generator, in place: the numbers ``torch.multinomial(probs, 1,
    generator)`` draws for its exponential-race fast path, so :func:`sample_batch` picks the
    tokens :func:`sample` picks for the same seed."""
    return out.exponential_(1.0, generator=generator)


def sample_batch(
    logits: torch.Tensor,
    greedy: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    noise: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick one token per row for rows of many requests at once (one call per step).

    Args:
        logits: ``[N, vocab]`` float32.
        greedy: ``[N]`` bool, rows picked by argmax of their logits.
        temperature: ``[N, 1]`` float32 (any positive value on greedy rows).
        top_k: ``[N, 1]`` int64 in ``[1, vocab]`` (``vocab``: no filter), or None when no row filters.
        top_p: ``[N, 1]`` float32 (``inf``: no filter), or None when no row filters.
        noise: ``[N, vocab]`` float32 Exp(1) noise from each row's request generator
            (:func:`draw_noise`; ones on greedy rows), or None when every row is greedy.

    Returns ``(tokens [N] int64, bad [N] bool or None)``: ``bad`` marks sampled rows whose
    distribution holds inf or nan (where :func:`torch.multinomial` raises). Per row the same
    operations as :func:`sample` in the same order (temperature, top-k, top-p, softmax, then the
    exponential race ``argmax(probs / noise)`` that ``torch.multinomial(probs, 1)`` runs), so
    tokens are bitwise those of per-request :func:`sample` calls with the same generators."""
    argmax = logits.argmax(dim=-1)
    if noise is None:
        return argmax, None
    x = logits / temperature
    if top_k is not None:
        kth = torch.sort(x, dim=-1, descending=True).values.gather(1, top_k - 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, sorted_x)
    probs = x.softmax(dim=-1)
    bad = ~torch.isfinite(probs).all(dim=-1) & ~greedy
    return torch.where(greedy, argmax, (probs / noise).argmax(dim=-1)), bad
