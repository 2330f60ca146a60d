"""Self-distillation of the content: learn *where* to fork without changing *what* is said.

Plain SFT (:func:`~pasta_engine.train.losses.sft_loss`) trains every token of an annotated answer
as a one-hot target. On the model's own answers that is meant to leave the content alone, but it
does not: the answers were cut at a line to fit the token budget and still end in the
end-of-sequence token (so the model learns to stop early), they were decoded greedily with a
repetition penalty (so the penalized choice is trained in, and penalized again at decoding), the
prompt carries the PASTA system line instead of the chat template's default, and LoRA updates
that sharpen the model's own argmax move the rest of its distribution. On the embedded SmolLM2
the adapters trained that way lost about 2:1 to the base model in a blind pairwise reading
whether they forked or not (``bench/results/independence-adapter-attempts``).

Distillation replaces the one-hot content targets by the **base model's** next-token
distribution (Hinton, Vinyals and Dean 2015, "Distilling the Knowledge in a Neural Network";
on-policy sequence-level variants: Kim and Rush 2016, Agarwal et al. 2024 GKD): the teacher
is the frozen base model reading the clean answer sequentially after the plain prompt (what the
base model answering sequentially sees); the student is the adapter in the pasta layout. The
content term is the cross-entropy ``-sum_v p_teacher(v) log p_student(v)`` per content token
(its gradient is the KL divergence's), so at a content token the adapter is pulled towards what
the base model would say there, not towards the one token the base model happened to say. Tag
tokens (a promise with its topic and length, ``<async>``/``</async>``, ``<sync/>``) have no teacher
and keep their one-hot targets, weighted as in plain SFT. The teacher gives tag tokens no mass, so
at a content token the adapter also learns not to open a tag there: the annotation's decision.

The end-of-sequence token is a decision like a tag's and keeps its one-hot target. The first
version gave it the teacher's row after the answer; where an answer had been cut by the token
budget, that row gives the end little mass, and with more than half of the training answers cut
at 256 tokens the distilled adapters learned not to stop at all (30% and 58% of their answers ran
out of a 512-token budget and looped; 19% and 12% win rate against the base model, the shipped
adapter 32.5%: ``bench/results/distill-smollm2-cpu``). Now a cut answer trains no end at all
(``train sft --end-target ended``) and an answer that ended trains its end one-hot.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..lang.grammar import TagTokens
from ..lang.tokenization import encode_prompt
from .layout import PastaLayout

__all__ = ["content_mask", "reading_order", "teacher_rows", "distill_loss"]


def content_mask(token_ids: Sequence[int], tags: TagTokens) -> list[bool]:
    """Per token of a spliced response (``PastaLayout.token_ids``): True for a content token
    (the clean text's tokens and the final end-of-sequence token), False for a tag token: a
    promise from its opening piece through its closing piece (topic and length included), and
    the ``<async>``, ``</async>`` and ``<sync/>`` pieces. Needs the tag pieces as tokens
    (``train sft --tag-tokens`` or an adapter that added them)."""
    out: list[bool] = []
    inside = False
    single = {tags.async_open, tags.async_close, tags.sync}
    for t in token_ids:
        if inside:
            out.append(False)
            inside = t != tags.promise_close
        elif t == tags.promise_open:
            out.append(False)
            inside = True
        else:
            out.append(t not in single)
    return out


def reading_order(layout: PastaLayout, is_content: Sequence[bool], decode: Any,
                  eos_ids: Sequence[int] = ()) -> tuple[str, list[int]]:
    """The clean text in reading order, rebuilt from the layout's threads, and where each token
    of ``layout.token_ids`` starts in it.

    Each thread's text is the decoding of its content tokens; a chunk's text goes into its
    parent's at the parent's clean offset when it forked (``layout.forks``; before the parent's
    character there), recursively. Returns ``(text, starts)``: ``starts[i]`` is the character
    offset in ``text`` where token ``i`` starts, -1 for tag tokens and the end-of-sequence token
    (left out of the text) and for a token that starts inside a character (a byte-level piece
    after the first of one character: it has no character offset, so no teacher row).

    For PASTA-LANG the text equals the annotated response less its tags (chunks stay where they
    are written); the rebuild from threads also holds for a dialect whose chunks go elsewhere.

    Args:
        layout: the response's layout (``token_ids``, ``thread_ids``, ``forks``, ``main_tid``).
        is_content: per entry of ``layout.token_ids``, whether it is content (:func:`content_mask`).
        decode: ``token ids -> text`` (the tokenizer's, special tokens kept). A token's start is
            the length of its thread's decoded prefix: ``O(n^2)`` characters decoded per thread
            of ``n`` tokens, training-time work only.
        eos_ids: end-of-sequence ids, left out of the text.

    Never raises on content."""
    eos = set(int(e) for e in eos_ids)
    by_thread: dict[int, list[int]] = {}
    for i, (tid, c) in enumerate(zip(layout.thread_ids, is_content)):
        if c and layout.token_ids[i] not in eos:
            by_thread.setdefault(tid, []).append(i)
    local: dict[int, tuple[str, list[int]]] = {}  # tid -> (text, start of each of its content tokens)
    for tid, idx in by_thread.items():
        ids = [layout.token_ids[i] for i in idx]
        prefixes = [decode(ids[:k]) for k in range(len(ids))]
        # a token that starts inside a character (byte-level pieces of one emoji) has no
        # character offset: the cut character decodes as one U+FFFD, which would give it the
        # next character's start (and another place's teacher row)
        local[tid] = (decode(ids), [-1 if p.endswith("\ufffd") else len(p) for p in prefixes])
    kids: dict[int, list[tuple[int, int]]] = {}
    for child, (parent, at) in layout.forks.items():
        kids.setdefault(parent, []).append((at, child))
    starts = [-1] * len(layout.token_ids)
    parts: list[str] = []
    length = 0

    def emit(tid: int) -> None:
        nonlocal length
        text, st = local.get(tid, ("", []))
        idx = by_thread.get(tid, [])
        k = 0
        at = 0
        for fc, child in sorted(kids.get(tid, [])) + [(len(text), None)]:
            fc = min(max(fc, at), len(text))
            while k < len(idx) and st[k] < fc:
                starts[idx[k]] = length + st[k] - at if st[k] >= 0 else -1
                k += 1
            parts.append(text[at:fc])
            length += fc - at
            at = fc
            if child is not None:
                emit(child)
        while k < len(idx):
            starts[idx[k]] = length + st[k] - at if st[k] >= 0 else -1
            k += 1

    emit(layout.main_tid)
    return "".join(parts), starts


@torch.no_grad()
def teacher_rows(
    teacher: Any,
    tokenizer: Any,
    prompt: str,
    layout: PastaLayout,
    tags: TagTokens,
    eos_ids: Sequence[int],
    hard_open: int = 0,
) -> tuple[list[int], list[bool], torch.Tensor]:
    """The teacher's distribution for each sampled content token of ``layout``.

    The teacher (the frozen base model) reads the clean answer in reading order
    (:func:`reading_order`), tokenized canonically, after the plain prompt (the chat template with
    the user turn only, as the engine formats a sequential request). A sampled content token gets
    the teacher's row at the canonical token that starts where it starts and is the same token.
    The end-of-sequence token has no teacher row: it keeps its one-hot target (the base model
    stopped there; ``train_sft``'s ``end_target="ended"`` gives it weight 0 where the answer was
    cut instead). A token with no counterpart (a thread's text split differently at a boundary)
    has no teacher row either and keeps its one-hot target.

    Args:
        teacher: the frozen base ``transformers`` causal LM (vocabulary ``V``).
        tokenizer: its tokenizer (tag tokens, if added, never occur in the teacher's input).
        prompt: the instruction.
        layout: the student's layout (:func:`~pasta_engine.train.forward.layout_for`).
        tags: the tag pieces as tokens.
        eos_ids: the end-of-sequence ids.
        hard_open: the first this many content tokens of every chunk keep their one-hot target.
            The teacher reads the chunk after its siblings and without its topic; the student
            writes it after its topic and without its siblings. Distilled there, a chunk learns to
            open as the teacher would after the siblings, whatever its topic, and siblings repeat
            each other (``bench/results/distill-end-smollm2-cpu``: 0% of chunks opened with their
            topic, six chunks of one answer wrote the same "Practice mindfulness" point).

    Returns ``(targets, soft, rows)``: per sampled token (spliced order, inserted tokens left out,
    as :meth:`PastaLayout.sampled`) its id and whether it has a teacher row; ``rows`` ``[C, V]``
    float32 teacher log-probabilities, one per ``soft`` token in order."""
    mask = content_mask(layout.token_ids, tags)
    text, starts = reading_order(layout, mask, lambda ids: tokenizer.decode(ids), eos_ids)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    canon = list(enc["input_ids"])
    at_start = {int(a): j for j, (a, b) in enumerate(enc["offset_mapping"]) if b > a}
    prompt_ids = encode_prompt(tokenizer, [{"role": "user", "content": prompt}], "text")
    dev = next(teacher.parameters()).device
    ids = torch.tensor([prompt_ids + canon], dtype=torch.long, device=dev)
    logits = teacher(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1:].float()  # [len(canon) + 1, V]
    eos = set(int(e) for e in eos_ids)
    targets: list[int] = []
    soft: list[bool] = []
    pick: list[int] = []
    opened: dict[int, int] = {}  # chunk thread -> content tokens seen so far
    for tok, q, c, s0, tid in zip(layout.token_ids, layout.target_index, mask, starts, layout.thread_ids):
        opening = False
        if c and tid != layout.main_tid:
            opening = opened.get(tid, 0) < hard_open
            opened[tid] = opened.get(tid, 0) + 1
        if q is None:
            continue
        targets.append(tok)
        row = None
        if c and not opening and tok not in eos and s0 >= 0 and s0 in at_start and canon[at_start[s0]] == tok:
            row = at_start[s0]
        soft.append(row is not None)
        if row is not None:
            pick.append(row)
    rows = torch.log_softmax(logits[torch.tensor(pick, dtype=torch.long, device=dev)], dim=-1) if pick else \
        logits.new_zeros((0, logits.shape[1]))
    return targets, soft, rows


def distill_loss(
    student_logprobs: torch.Tensor,
    targets: torch.Tensor,
    soft: torch.Tensor,
    teacher: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The distillation loss of one response (see the module docstring).

    Args:
        student_logprobs: ``[S, V_s]`` float32 log-softmax of the adapter at each sampled token's
            query row (``V_s >= V``: the student may have the tag tokens as extra rows).
        targets: ``[S]`` int64 the sampled tokens.
        soft: ``[S]`` bool, True where the token has a teacher row (:func:`teacher_rows`).
        teacher: ``[C, V]`` float32 teacher log-probabilities, one row per ``soft`` token in order.
        weights: ``[S]`` float32 weights of the one-hot terms (None: 1; e.g.
            :func:`~pasta_engine.train.losses.tag_decision_weights`); soft tokens weigh 1.

    Returns ``(loss, parts)``: the weighted mean over tokens of the soft tokens' cross-entropy
    against the teacher and the other tokens' negative log-likelihood (a scalar with the
    student's gradient), and for logging ``kl`` (the mean KL divergence teacher || student in
    nats per soft token), ``hard_nll`` and ``soft_fraction``. Raises ValueError when the shapes
    disagree or the teacher's vocabulary is larger."""
    s, v_s = student_logprobs.shape
    c, v = teacher.shape
    if targets.shape != (s,) or soft.shape != (s,):
        raise ValueError(f"targets {tuple(targets.shape)} and soft {tuple(soft.shape)} must be ({s},)")
    if c != int(soft.sum()):
        raise ValueError(f"{c} teacher rows for {int(soft.sum())} soft tokens")
    if v > v_s:
        raise ValueError(f"teacher vocabulary {v} is larger than the student's {v_s}")
    dev = student_logprobs.device
    soft = soft.to(dev)
    w = torch.ones(s, dtype=torch.float32, device=dev) if weights is None else weights.to(dev, torch.float32).clone()
    w[soft] = 1.0
    p = teacher.exp()
    ce = -(p * student_logprobs[soft][:, :v]).sum(dim=1)  # [C]
    hard = ~soft
    nll = -student_logprobs[hard].gather(1, targets.to(dev)[hard][:, None]).squeeze(1)  # [S - C]
    loss = ((w[soft] * ce).sum() + (w[hard] * nll).sum()) / w.sum()
    with torch.no_grad():
        kl = float((ce + (p * teacher).sum(dim=1)).mean()) if c else 0.0
        hard_nll = float(nll.mean()) if nll.numel() else 0.0
    return loss, {"kl": kl, "hard_nll": hard_nll, "soft_fraction": c / s}
