"""The sampler: penalties, greedy, temperature, top-k, top-p, min-p (parameters in
:mod:`pasta_engine.config`).

:func:`sample` picks the tokens of one request's rows; :func:`sample_batch` does the same for
every row of a step in one call (per-row parameters as tensors, each request's random numbers
drawn from its own generator by :func:`draw_noise`) and picks the same tokens."""

from __future__ import annotations

import torch

from ..config import SamplingParams

__all__ = ["sample", "sample_batch", "draw_noise", "logprobs_of", "apply_repetition_penalty", "apply_output_penalties",
           "mask_tokens", "apply_fork_threshold", "MIN_TOP_P"]

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


def apply_output_penalties(logits: torch.Tensor, rows: list[int], output: list[list[int]],
                           presence: list[float], frequency: list[float]) -> torch.Tensor:
    """The logits with OpenAI's presence and frequency penalties applied (a new tensor): for
    each ``rows[i]``, ``frequency[i] * count[t] + presence[i] * (count[t] > 0)`` is subtracted
    from the logit of every token ``t``, ``count[t]`` its occurrences in ``output[i]`` (OpenAI's
    "Parameter details" formula; vLLM's ``apply_penalties``). The counts are built on the
    logits' device (one ``index_put_`` with accumulation), only the ids travel.

    Args:
        logits: ``[N, vocab]`` float32.
        rows: row indices into ``logits`` that get the penalties.
        output: per such row, the response token ids the thread sees (repeats counted).
        presence, frequency: per such row, the penalties (any finite number; 0 = none)."""
    dev, n = logits.device, logits.shape[0]
    r = torch.tensor([row for row, ids in zip(rows, output) for _ in ids], dtype=torch.long)
    c = torch.tensor([i for ids in output for i in ids], dtype=torch.long)
    pf = torch.zeros(2, n, 1, dtype=logits.dtype)
    pf[0, rows, 0] = torch.tensor(presence, dtype=logits.dtype)
    pf[1, rows, 0] = torch.tensor(frequency, dtype=logits.dtype)
    r, c, pf = r.to(dev, non_blocking=True), c.to(dev, non_blocking=True), pf.to(dev, non_blocking=True)
    counts = torch.zeros(logits.shape, dtype=logits.dtype, device=dev)
    counts.index_put_((r, c), torch.ones(len(c), dtype=logits.dtype, device=dev), accumulate=True)
    return logits - pf[1] * counts - pf[0] * (counts > 0).to(logits.dtype)


def mask_tokens(logits: torch.Tensor, rows: list[int], ids: list[list[int]]) -> torch.Tensor:
    """The logits with ``ids[i]`` set to ``-inf`` in row ``rows[i]`` (a new tensor; one
    ``masked_fill``): the end-of-sequence and stop tokens a thread may not sample yet
    (``min_tokens``) or at all (``ignore_eos``). Ids must be below ``logits.shape[-1]``."""
    dev = logits.device
    r = torch.tensor([row for row, row_ids in zip(rows, ids) for _ in row_ids], dtype=torch.long)
    c = torch.tensor([i for row_ids in ids for i in row_ids], dtype=torch.long)
    mask = torch.zeros(logits.shape, dtype=torch.bool, device=dev)
    mask[r.to(dev, non_blocking=True), c.to(dev, non_blocking=True)] = True
    return logits.masked_fill(mask, float("-inf"))


def apply_fork_threshold(logits: torch.Tensor, rows: list[int], thresholds: list[float], token: int) -> torch.Tensor:
    """The logits with a fork decision made for each of ``rows`` (a new tensor; one softmax over
    those rows and one ``masked_fill``, no host-device sync): where the probability of ``token``
    (the promise piece) under the row's softmax is at least ``thresholds[i]``, every other token
    gets ``-inf`` (the row forks whatever the sampler does next); elsewhere ``token`` gets
    ``-inf`` (the row does not fork). (:attr:`pasta_engine.config.Limits.fork_threshold`; the
    paper's speed-quality knob, Jin et al., ICML 2025, arXiv 2502.11517, section 5, moved from
    training to decoding.)

    Args:
        logits: ``[N, vocab]`` float32, after penalties and masks.
        rows: row indices into ``logits`` that may open a promise now (at least one).
        thresholds: per such row, a probability in ``(0, 1]``.
        token: the promise piece's token id (below ``logits.shape[-1]``)."""
    dev = logits.device
    r = torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)
    thr = torch.tensor(thresholds, dtype=torch.float32).to(dev, non_blocking=True)
    fork = torch.softmax(logits.index_select(0, r).float(), dim=-1)[:, token] >= thr
    forks = torch.zeros(logits.shape[0], dtype=torch.bool, device=dev).index_put_((r,), fork)
    decided = torch.zeros(logits.shape[0], dtype=torch.bool, device=dev).index_put_((r,), ~fork)
    is_token = torch.zeros(logits.shape[-1], dtype=torch.bool, device=dev)
    is_token[token] = True
    mask = (forks[:, None] & ~is_token) | (decided[:, None] & is_token)
    return logits.masked_fill(mask, float("-inf"))


def _min_p_filter(x: torch.Tensor, min_p: torch.Tensor | float) -> torch.Tensor:
    """``x`` with every token whose probability is below ``min_p`` times the row's largest set
    to ``-inf`` (vLLM's ``_apply_min_p``, ``transformers``' ``MinPLogitsWarper``; the most
    likely token always stays)."""
    probs = x.softmax(dim=-1)
    return x.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p, float("-inf"))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``[N, vocab]`` float32 (rows of one request's threads).
        params: the request's :class:`SamplingParams`.
        generator: the request's generator (on the logits' device); unused when greedy.

    Returns ``[N]`` int64 token ids. Filtering follows HF ``generate``'s order: temperature,
    then top-k, then top-p (Holtzman et al. 2020, "The Curious Case of Neural Text
    Degeneration", section 3.1), then min-p (penalties and masks are applied before, by the
    caller)."""
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
    if params.min_p > 0.0:
        x = _min_p_filter(x, params.min_p)
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
    min_p: torch.Tensor | None = None,
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
        min_p: ``[N, 1]`` float32 in [0, 1] (0: no filter), or None when no row filters.

    Returns ``(tokens [N] int64, bad [N] bool)``: ``bad`` marks rows whose logits hold NaN or
    +inf (greedy rows too: their argmax means nothing) and sampled rows whose distribution holds
    inf or nan (where :func:`torch.multinomial` raises); the runner fails those requests alone. Per row the same
    operations as :func:`sample` in the same order (temperature, top-k, top-p, min-p, softmax, then the
    exponential race ``argmax(probs / noise)`` that ``torch.multinomial(probs, 1)`` runs), so
    tokens are bitwise those of per-request :func:`sample` calls with the same generators."""
    argmax = logits.argmax(dim=-1)
    # argmax takes NaN as the largest value, so a row holding NaN or +inf has it at its argmax:
    # an [N] check, not another pass over [N, vocab] (-inf is a mask, not a fault)
    top = logits.gather(1, argmax[:, None]).squeeze(1)
    nonfinite = torch.isnan(top) | torch.isposinf(top)
    if noise is None:
        return argmax, nonfinite
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
    if min_p is not None:
        x = _min_p_filter(x, min_p)
    probs = x.softmax(dim=-1)
    bad = nonfinite | (~torch.isfinite(probs).all(dim=-1) & ~greedy)
    return torch.where(greedy, argmax, (probs / noise).argmax(dim=-1)), bad
