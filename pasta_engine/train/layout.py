"""The training view of a PASTA response: one dense sequence whose attention mask and position
ids give every token exactly what the engine's pasta-mode replay gives it.

docs/DESIGN.md section 8: training must see each token as inference will. A main-thread token after a
promise sees nothing of that chunk until the next sync; a chunk's tokens see the context up to
their promise and their own chunk; positions follow the engine's position policy. Rather than
re-deriving those rules, :func:`pasta_layout` runs the engine's own torch-free parts (the
interpreter, the scheduler and the block manager) over the forced token streams of the replay,
with no model, and records for every token the engine forwards: its id, its logical position,
its KV slot, and the slots its query sees (the thread's KV view at that step, causal inside a
multi-token chunk). Slots then become indices of the dense sequence. The layout is the engine's
by construction; ``tests/train`` checks it against the engine's logits.

The sequence holds every token the engine forwards (the prompt, each thread's tokens with the
inserted ``<async>`` tags), in the order they are forwarded; tokens never forwarded (the main
thread's end-of-sequence) appear only as targets. Each sampled token is predicted by the last
token its thread forwarded in that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..config import Limits, PositionPolicy, SamplingParams
from ..core.block_manager import BlockManager
from ..core.request import Request, interpreter_factory
from ..lang.dialect import Dialect
from ..lang.pasta import PASTA
from ..core.scheduler import SampledTokens, Scheduler

__all__ = ["PastaLayout", "pasta_layout"]


@dataclass
class PastaLayout:
    """One response laid out for a dense training forward.

    Attributes:
        input_ids: ``[T]`` the forwarded tokens, in forwarding order.
        position_ids: ``[T]`` each token's logical position (the engine's).
        visible: ``visible[q]``: the indices of the tokens query ``q`` attends to (itself included).
        targets: per sampled token in the engine's sampling order, ``(thread id, query index, token)``.
        token_ids: the response in spliced order, as ``RequestResult.token_ids``.
        target_index: per entry of ``token_ids``, the query index that predicts it, or None for a
            token the interpreter inserted (``<async>``, a dialect's branch header or join text).
        prompt_len: tokens of the prompt (the first ``prompt_len`` of ``input_ids``).
        thread_ids: per entry of :attr:`token_ids`, the id of the thread that owns it (the main
            thread's is :attr:`main_tid`).
        forks: per chunk thread id, ``(parent thread id, the parent's clean characters before
            the chunk)``: where its clean text goes in the reading order."""

    input_ids: list[int]
    position_ids: list[int]
    visible: list[list[int]]
    targets: list[tuple[int, int, int]]
    token_ids: list[int]
    target_index: list[int | None]
    prompt_len: int
    diagnostics: list[str] = field(default_factory=list)
    thread_ids: list[int] = field(default_factory=list)
    main_tid: int = 0
    forks: dict[int, tuple[int, int]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.input_ids)

    def mask(self):
        """The ``[T, T]`` bool attention mask (True: query row attends to key column)."""
        import torch

        t = len(self.input_ids)
        m = torch.zeros(t, t, dtype=torch.bool)
        for q, keys in enumerate(self.visible):
            m[q, keys] = True
        return m

    def sampled(self) -> tuple[list[int], list[int]]:
        """``(query indices, target tokens)`` of every entry of :attr:`token_ids` that was
        sampled (inserted tokens left out), in spliced order."""
        qs = [q for q in self.target_index if q is not None]
        toks = [t for t, q in zip(self.token_ids, self.target_index) if q is not None]
        return qs, toks


def pasta_layout(
    tokenizer: Any,
    prompt_ids: Sequence[int],
    annotated_response: str,
    *,
    eos_ids: Sequence[int],
    position_policy: str | PositionPolicy = "predicted",
    limits: Limits | None = None,
    max_positions: int | None = None,
    page_size: int = 16,
    dialect: Dialect = PASTA,
) -> PastaLayout:
    """Lay ``annotated_response`` out as the engine's pasta-mode replay decodes it.

    Args:
        tokenizer: the model's ``transformers`` tokenizer.
        prompt_ids: the formatted prompt (as :meth:`pasta_engine.Engine.format_prompt` gives it).
        annotated_response: the response with the dialect's tags (PASTA-LANG by default).
        eos_ids: the model's end-of-sequence ids (:func:`pasta_engine.lang.tokenization.eos_token_ids`).
        position_policy, limits, max_positions: as the engine's (the fork cap changes the
            layout: a chunk past it is decoded inline).
        page_size: KV page size of the dry run (the layout does not depend on it).
        dialect: the language of ``annotated_response`` (default PASTA-LANG).

    Raises ValueError for the ``oracle`` policy's absence of a trace (never: replay has one)."""
    policy = PositionPolicy.parse(position_policy)
    limits = limits or Limits()
    make, max_new = interpreter_factory(
        tokenizer, list(prompt_ids), mode="pasta", max_new_tokens=1, limits=limits, policy=policy,
        max_positions=max_positions, eos_ids=list(eos_ids), annotated_response=annotated_response,
        dialect=dialect,
    )
    req = Request(request_id="layout", index=0, mode="pasta", params=SamplingParams(max_new_tokens=max_new),
                  make_interpreter=make)
    # bookkeeping only (no KV is stored): room for every token plus the two part-filled pages a
    # fork may leave (the parent's sealed page and the child's own)
    pages = (len(prompt_ids) + 4 * max_new) // page_size + 2 * (min(limits.max_forks, max_new) + 1) + 64
    sched = Scheduler(BlockManager(pages, page_size), max_running_requests=1)
    sched.add(req)
    input_ids: list[int] = []
    position_ids: list[int] = []
    visible: list[list[int]] = []
    targets: list[tuple[int, int, int]] = []
    index_of_slot: dict[int, int] = {}
    while sched.has_unfinished():
        batch = sched.schedule()
        if not batch:
            continue
        for st in batch.threads:
            flat = [p * page_size + o for _, pages_, lens in st.runs for p, n in zip(pages_, lens) for o in range(n)]
            q_len = len(st.step.tokens)
            for i, (tok, pos, slot) in enumerate(zip(st.step.tokens, st.step.positions, st.slots)):
                idx = len(input_ids)
                index_of_slot[slot] = idx
                input_ids.append(tok)
                position_ids.append(pos)
                visible.append([index_of_slot[s] for s in flat[: len(flat) - q_len + i + 1]])
            if st.step.sample:
                targets.append((st.step.tid, len(input_ids) - 1, st.step.forced))
        forced = [st.step.forced for st in batch.sampling]
        sched.postprocess(batch, SampledTokens(forced, [0.0] * len(forced)))
    if req.error is not None:  # a cut layout would train the wrong tokens: say so instead
        raise RuntimeError(f"the layout's dry run ended with an error: {req.error}")
    it = req.interp
    # spliced order: each thread's sampled tokens follow its inserted ones
    per_thread: dict[int, list[int]] = {}
    for tid, q, _ in targets:
        per_thread.setdefault(tid, []).append(q)
    sp = it.spliced()
    inserted = {t.tid: set(t.inserted_idx) for t in it.threads}  # a child's opening tag, a join's text
    seen: dict[int, int] = {}
    n_sampled: dict[int, int] = {}
    target_index: list[int | None] = []
    for tid in sp.threads:
        k = seen.get(tid, 0)
        seen[tid] = k + 1
        if k in inserted[tid]:
            target_index.append(None)
        else:
            j = n_sampled.get(tid, 0)
            n_sampled[tid] = j + 1
            target_index.append(per_thread[tid][j])
    return PastaLayout(input_ids, position_ids, visible, targets, sp.ids, target_index, len(prompt_ids),
                       list(it.diagnostics), list(sp.threads), it.main.tid,
                       {t.tid: (t.parent.tid, t.fork_clean) for t in it.threads if t.parent is not None})
