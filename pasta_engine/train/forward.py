"""The training forward: a ``transformers`` causal LM (peft-wrapped or not) over a
:class:`~pasta_engine.train.layout.PastaLayout`, in one dense pass with a 4D attention mask and
the engine's position ids, so every sampled token gets the log-probability the engine's
pasta-mode replay gives it (docs/DESIGN.md section 8)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..config import Limits, PositionPolicy
from ..lang.dialect import Dialect, dialect_prompt
from ..lang.pasta import PASTA
from ..lang.prompts import DEFAULT_PASTA_PROMPT, PastaPrompt
from ..lang.tokenization import encode_prompt, eos_token_ids
from ..models.config import ModelConfig
from .layout import PastaLayout, pasta_layout

__all__ = ["layout_for", "forward_logits", "forward_log_softmax", "forward_logprobs", "pasta_logprobs"]


def _model_config(model: Any) -> Any:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.config


def layout_for(
    model: Any,
    tokenizer: Any,
    prompt: str | Sequence[int],
    annotated_response: str,
    position_policy: str | PositionPolicy = "predicted",
    *,
    pasta_prompt: PastaPrompt = DEFAULT_PASTA_PROMPT,
    limits: Limits | None = None,
    prompt_special_tokens: str = "text",
    dialect: Dialect = PASTA,
) -> PastaLayout:
    """The layout of one training example: ``prompt`` formatted as the engine formats a replay's
    prompt (a string through the chat template with ``pasta_prompt`` for PASTA-LANG, with the
    dialect's own prompt for any other: :func:`~pasta_engine.lang.dialect.dialect_prompt`; a list
    of ids as it is), the response laid out by :func:`~pasta_engine.train.layout.pasta_layout`
    with the model's end-of-sequence ids and context length."""
    cfg = _model_config(model)
    if isinstance(prompt, str):
        messages = dialect_prompt(dialect, pasta_prompt).messages(prompt)
        prompt_ids = encode_prompt(tokenizer, messages, prompt_special_tokens)
    else:
        prompt_ids = [int(t) for t in prompt]
    return pasta_layout(tokenizer, prompt_ids, annotated_response, eos_ids=eos_token_ids(tokenizer, cfg),
                        position_policy=position_policy, limits=limits,
                        max_positions=getattr(cfg, "max_position_embeddings", None), dialect=dialect)


def forward_logits(model: Any, layout: PastaLayout) -> torch.Tensor:
    """Logits ``[S, V]`` float32 (with gradient when the model has trainable parameters) of the
    query rows that predict the sampled tokens of ``layout``, in spliced order
    (``layout.sampled()``), before any softmax: what a sampler's penalties act on.

    One forward of ``model`` over ``layout.input_ids`` ``[1, T]`` int64 with a ``[1, 1, T, T]``
    additive mask (model dtype) and ``[1, T]`` int64 position ids on the model's device (no
    sliding window: transformers does not apply one to a given 4D mask, so windowed models are
    trained on responses shorter than their window); cast to float32 only at the query rows that
    predict a sampled token.

    Raises ValueError when the layout reaches a position at or past the model's sliding window:
    the dense mask would train other log-probabilities than the engine's windowed attention
    computes."""
    cfg = _model_config(model)  # the config parsed again only for a model that may have a window
    windows = ([w for w in ModelConfig.from_hf(cfg).sliding_windows if w is not None]
               if getattr(cfg, "sliding_window", None) is not None else [])
    if windows and layout.position_ids and max(layout.position_ids) >= min(windows):
        raise ValueError(f"this example reaches position {max(layout.position_ids)}, past the model's sliding "
                         f"window of {min(windows)} tokens, which the training forward does not apply: train on "
                         f"shorter prompts and responses (e.g. --max-response-tokens)")
    param = next(model.parameters())
    dev = param.device
    ids = torch.tensor([layout.input_ids], dtype=torch.long, device=dev)
    pos = torch.tensor([layout.position_ids], dtype=torch.long, device=dev)
    # an additive float mask (0 where a query attends, -inf elsewhere): every attention
    # implementation reads it the same way (Gemma 2's eager attention would add a bool mask)
    keep = layout.mask().to(dev)[None, None]
    dtype = param.dtype if param.dtype.is_floating_point else torch.float32
    mask = torch.zeros(keep.shape, dtype=dtype, device=dev).masked_fill(~keep, torch.finfo(dtype).min)
    qs, _ = layout.sampled()
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
    return out.logits[0, torch.tensor(qs, device=dev)].float()


def forward_log_softmax(model: Any, layout: PastaLayout) -> torch.Tensor:
    """Log-softmax ``[S, V]`` float32 (with gradient when the model has trainable parameters)
    of the query rows that predict the sampled tokens of ``layout``, in spliced order
    (``layout.sampled()``): the model's whole next-token distribution there
    (:func:`forward_logits`, whose ValueError it raises)."""
    return torch.log_softmax(forward_logits(model, layout), dim=-1)


def forward_logprobs(model: Any, layout: PastaLayout) -> torch.Tensor:
    """Log-probabilities ``[S]`` float32 (with gradient when the model has trainable
    parameters) of the sampled tokens of ``layout``, in spliced order (``layout.sampled()``):
    :func:`forward_log_softmax` at the sampled tokens."""
    rows = forward_log_softmax(model, layout)
    toks = torch.tensor(layout.sampled()[1], device=rows.device)
    return rows.gather(1, toks[:, None]).squeeze(1)


@torch.no_grad()
def pasta_logprobs(
    model: Any,
    tokenizer: Any,
    prompt: str | Sequence[int],
    annotated_response: str,
    position_policy: str | PositionPolicy = "predicted",
    *,
    pasta_prompt: PastaPrompt = DEFAULT_PASTA_PROMPT,
    limits: Limits | None = None,
    dialect: Dialect = PASTA,
) -> tuple[list[int], list[float | None]]:
    """Per-token log-probabilities of an annotated response as the engine's pasta-mode replay
    computes them, from one dense forward of a ``transformers`` model.

    Args:
        model: a ``transformers`` causal LM, peft-wrapped or not.
        tokenizer: its tokenizer.
        prompt: a string (chat template with ``pasta_prompt``, as ``Engine.replay`` formats
            it) or a list of token ids.
        annotated_response: the response with PASTA-LANG tags.
        position_policy: ``predicted`` | ``constant:K`` | ``none`` | ``oracle``.
        pasta_prompt, limits: as the engine's config (``pasta_prompt`` applies to PASTA-LANG;
            another dialect brings its own prompt, as in the engine).
        dialect: the language of ``annotated_response`` (default PASTA-LANG), as the replay's.

    Returns ``(token_ids, logprobs)`` aligned with ``RequestResult.token_ids`` and
    ``RequestResult.logprobs`` of ``Engine.replay(..., params=SamplingParams(return_logprobs=True))``:
    natural-log probabilities, None where the interpreter inserted the token."""
    layout = layout_for(model, tokenizer, prompt, annotated_response, position_policy, pasta_prompt=pasta_prompt,
                        limits=limits, dialect=dialect)
    lps = forward_logprobs(model, layout).tolist()
    it = iter(lps)
    return list(layout.token_ids), [None if q is None else next(it) for q in layout.target_index]
