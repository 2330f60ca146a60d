"""Training losses on the log-probabilities of the training forward.

* :func:`sft_loss`: negative log-likelihood of the sampled tokens, averaged per token
  (PASTA's first stage, Jin et al. 2025, section 4.1), optionally weighted to stress the tokens
  that open a tag (:func:`tag_decision_weights`).
* :func:`bonbon_loss`: BoNBoN alignment (Gui, Garbacea and Veitch, "BoNBoN Alignment for Large
  Language Models and the Sweetness of Best-of-n Sampling", NeurIPS 2024, arXiv 2406.00832,
  section 4): ``alpha * SFT(best) + (1 - alpha) * (h - target)^2`` where ``h`` is the
  log-ratio margin of the best over the worst of n samples against the reference model,
  ``h = [log pi(y_w) - log pi_ref(y_w)] - [log pi(y_l) - log pi_ref(y_l)]`` (sequence log
  probabilities), and ``target`` is the margin the best-of-n distribution itself has,
  ``(n - 1) * H_{n-1}`` (:func:`bonbon_target_margin`; the IPO loss of Azar et al. 2023,
  eq. 17, with ``1/(2 beta)`` set to it).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["sft_loss", "tag_decision_ids", "tag_decision_weights", "without_end_target", "bonbon_loss",
           "bonbon_target_margin"]


def sft_loss(logprobs: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean negative log-likelihood per token, ``-logprobs.mean()``, or with ``weights`` the
    weighted mean ``-(weights * logprobs).sum() / weights.sum()`` (a scalar).

    Args:
        logprobs: ``[S]`` float32 log-probabilities of the sampled tokens of one or more
            responses, concatenated.
        weights: ``[S]`` float32 per-token weights (None: all 1), e.g. a larger weight on the
            tokens where the model decides to open a tag (:func:`tag_decision_weights`).

    Raises ValueError when ``logprobs`` is empty or ``weights`` has another shape or sums to 0."""
    if logprobs.numel() == 0:
        raise ValueError("sft_loss of no tokens")
    if weights is None:
        return -logprobs.mean()
    if weights.shape != logprobs.shape:
        raise ValueError(f"weights of shape {tuple(weights.shape)} for logprobs of shape {tuple(logprobs.shape)}")
    total = weights.sum()
    if float(total) <= 0:
        raise ValueError("sft_loss weights sum to 0")
    return -(weights.to(logprobs.dtype) * logprobs).sum() / total


def tag_decision_ids(tokenizer: Any) -> set[int]:
    """The first token of each opening PASTA-LANG tag source (``<promise .../>`` and
    ``<sync/>``) as the canonical tokenization encodes tags (apart from their neighbours): the
    tokens at which a model decides to fork or to wait. With tags as plain text this is usually
    ``<``; with tags as added special tokens, the tag tokens themselves.

    ``</async>`` (a chunk's end) is left out on purpose: weighting it too taught the embedded
    SmolLM2 to close chunks right after their first line (``<async>**Heading**:</async>``)."""
    from ..lang.tokenization import encode_tag

    sources = ('<promise topic="a" tokens="10"/>', "<sync/>")
    return {encode_tag(tokenizer, s)[0] for s in sources}


def tag_decision_weights(tokens: Sequence[int], decision_ids: set[int], weight: float) -> torch.Tensor:
    """``[S]`` float32 loss weights: ``weight`` for a token in ``decision_ids``, 1 elsewhere.

    One token decides whether a thread forks; in a response of a few hundred tokens it carries
    well under 1% of the mean loss, so SFT learns the tags' form long before it learns to open
    them as often as its data does. Weighting those tokens (``weight`` > 1) moves that decision
    faster without changing any other token's target. Raises ValueError for ``weight`` <= 0."""
    if not weight > 0:
        raise ValueError(f"tag weight must be > 0, got {weight!r}")
    return torch.tensor([weight if t in decision_ids else 1.0 for t in tokens], dtype=torch.float32)


def without_end_target(tokens: Sequence[int], eos_ids: Sequence[int], weights: torch.Tensor | None) -> torch.Tensor:
    """``[S]`` float32 loss weights with 0 at every end-of-sequence token of ``tokens`` (the
    sampled tokens of one response) and ``weights`` (None: 1) elsewhere.

    For an answer that did not end where it was cut (generated up to a token budget, or cut to
    fit ``max_response_tokens``): its last token is not a place to stop, so training an end there
    teaches the model to stop mid-answer (one-hot target) and distillation's teacher, which gives
    the end little mass there, teaches it never to stop (``bench/results/distill-smollm2-cpu``).
    Without the end's term the answer still trains every other token. Raises ValueError when
    ``weights`` has another length than ``tokens``."""
    w = torch.ones(len(tokens), dtype=torch.float32) if weights is None else weights.to(torch.float32).clone()
    if w.shape != (len(tokens),):
        raise ValueError(f"weights of shape {tuple(w.shape)} for {len(tokens)} tokens")
    eos = set(int(e) for e in eos_ids)
    for i, t in enumerate(tokens):
        if int(t) in eos:
            w[i] = 0.0
    return w


def bonbon_target_margin(n: int) -> float:
    """The log-ratio margin of best over worst under the best-of-``n`` distribution:
    ``(n - 1) * sum_{k=1}^{n-1} 1/k`` (arXiv 2406.00832, section 4: best-of-n as an IPO target,
    ``1/(2 beta*)`` with ``beta* = 1 / (2 (n-1) H_{n-1})``). Raises ValueError for n < 2."""
    if n < 2:
        raise ValueError(f"best-of-n needs n >= 2, got {n}")
    return (n - 1) * sum(1.0 / k for k in range(1, n))


def bonbon_loss(
    best_logprobs: torch.Tensor,
    worst_logprobs: torch.Tensor,
    ref_best_logprobs: torch.Tensor,
    ref_worst_logprobs: torch.Tensor,
    n: int,
    alpha: float = 0.5,
) -> tuple[torch.Tensor, dict[str, float]]:
    """BoNBoN loss of one best/worst pair (see the module docstring).

    Args:
        best_logprobs, worst_logprobs: ``[S_w]``, ``[S_l]`` float32 token log-probabilities of the
            best and worst sample under the policy (with gradient).
        ref_best_logprobs, ref_worst_logprobs: the same under the reference model (no gradient).
        n: samples the pair was drawn from (sets the target margin).
        alpha: weight of the SFT term on the best sample (per-token mean NLL) in [0, 1].

    Returns ``(loss, parts)``: the scalar loss and its ``sft``, ``ipo`` and ``margin`` values
    (floats, for logging). Raises ValueError for alpha outside [0, 1]."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    margin = (best_logprobs.sum() - ref_best_logprobs.sum()) - (worst_logprobs.sum() - ref_worst_logprobs.sum())
    ipo = (margin - bonbon_target_margin(n)) ** 2
    sft = sft_loss(best_logprobs)
    loss = alpha * sft + (1.0 - alpha) * ipo
    return loss, {"sft": sft.item(), "ipo": ipo.item(), "margin": margin.item()}
