"""Training losses on the log-probabilities of the training forward.

* :func:`sft_loss`: negative log-likelihood of the sampled tokens, averaged per token
  (PASTA's first stage, Jin et al. 2025, section 4.1).
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

import torch

__all__ = ["sft_loss", "bonbon_loss", "bonbon_target_margin"]


def sft_loss(logprobs: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood per token: ``-logprobs.mean()`` (a scalar).

    Args:
        logprobs: ``[S]`` float32 log-probabilities of the sampled tokens of one or more
            responses, concatenated. Raises ValueError when empty."""
    if logprobs.numel() == 0:
        raise ValueError("sft_loss of no tokens")
    return -logprobs.mean()


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
