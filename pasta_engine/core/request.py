"""A request's life in the engine (no torch).

:class:`Request` is the engine's state of one request (its interpreter, its threads' KV views,
its counters); :meth:`Request.result` builds what the engine hands back
(:mod:`pasta_engine.core.outputs`), and :func:`interpreter_factory` how its interpreter is built.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .. import metrics
from ..config import Limits, PositionPolicy, SamplingParams
from ..lang.detokenizer import token_bytes_for
from ..lang.dialect import Dialect
from ..lang.pasta import PASTA
from ..lang.tokenization import decode, encode_tag, replay_eos_id
from . import render
from .block_manager import KVView
from .interpreter import Interpreter
from .outputs import RequestResult, RequestStats
from .render import OutputRenderer
from .replay import replay_script

__all__ = ["Request", "RequestStatus", "interpreter_factory"]


class RequestStatus(enum.Enum):
    """Where a request is: waiting for admission, running, or finished."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def interpreter_factory(
    tokenizer: Any,
    prompt_ids: list[int],
    *,
    mode: str,
    max_new_tokens: int,
    limits: Limits,
    policy: PositionPolicy,
    max_positions: int | None,
    eos_ids: list[int],
    annotated_response: str | None = None,
    grammar: bool = False,
    dialect: Dialect = PASTA,
    stop_strings: Sequence[str] = (),
) -> tuple[Callable[[], Interpreter], int]:
    """How a request's interpreter is built (again after a preemption), the one recipe the
    engine and the training forward share.

    Args:
        tokenizer: the model's ``transformers`` tokenizer.
        prompt_ids: the formatted prompt.
        mode: ``pasta``, ``sequential`` or ``inline`` (acts on tags like pasta, but decodes each
            promise's chunk in place in the same thread, no fork: the same weights
            sequentially; the baseline for realized speedup of a PASTA-LANG model). A replay
            in inline mode forces pasta's streams, each chunk in place after its inserted
            ``<async>``; in sequential mode the reading-order stream.
        max_new_tokens: the request's token budget (a replay raises it to the tokens it
            samples when smaller: :meth:`~pasta_engine.core.replay.ReplayScript.sampled_tokens`).
        limits, policy, max_positions, eos_ids: as :class:`~pasta_engine.core.interpreter.Interpreter`.
        annotated_response: make it a replay of this response (forced tokens of
            :func:`~pasta_engine.core.replay.replay_script`).
        grammar: the sampler enforces the PASTA-LANG grammar (the tokenizer has the piece
            tokens of :mod:`pasta_engine.lang.grammar`); see ``Interpreter(grammar=)``. The
            dialect's ``grammar_state`` says each thread's state: a dialect without masks
            (APAR, Multiverse) answers ``FREE``, no mask.
        dialect: the language the model writes (:class:`~pasta_engine.lang.dialect.Dialect`,
            default PASTA-LANG): the replay's tokenization, the inserted tokens and the parser.
        stop_strings: ``SamplingParams.stop``: the request's stop rule (see
            ``Interpreter(stop_strings=)``), a replay's included.

    Returns ``(make, max_new_tokens)``; ``make()`` raises ValueError for settings the
    interpreter refuses (the oracle policy outside replay)."""
    forced_main = forced_chunks = None
    if annotated_response is not None:
        script = replay_script(tokenizer, annotated_response, replay_eos_id(tokenizer, eos_ids), dialect)
        max_new_tokens = max(max_new_tokens, script.sampled_tokens(mode, limits))  # exactly what it samples
        if mode != "sequential":  # pasta and inline: the main thread's stream and each chunk's
            forced_main, forced_chunks = script.forced_main, script.forced_chunks
        else:
            forced_main = script.sequential_ids
    open_ids = encode_tag(tokenizer, dialect.open_tag)
    close_len = len(encode_tag(tokenizer, dialect.close_tag))
    table = token_bytes_for(tokenizer)

    def make() -> Interpreter:
        return Interpreter(
            prompt_ids, decode=lambda ids: decode(tokenizer, ids), eos_ids=eos_ids, open_ids=open_ids,
            close_len=close_len, mode=mode, max_new_tokens=max_new_tokens, limits=limits, policy=policy,
            max_positions=max_positions, forced_main=forced_main, forced_chunks=forced_chunks, token_bytes=table,
            grammar=grammar, dialect=dialect, encode=lambda text: encode_tag(tokenizer, text),
            stop_strings=stop_strings,
        )

    return make, max_new_tokens


@dataclass(eq=False)
class Request:
    """The engine's state of one request.

    ``make_interpreter`` builds a fresh interpreter (again after a preemption). The scheduler
    owns ``views`` (thread id -> KV view; the slots of a step's tokens are allocated when it
    is scheduled); the scheduler keeps its seeded random stream and its threads' seen-token
    counts, for the :class:`~pasta_engine.core.batch.SamplingRow` it fills. Counters: ``steps`` (forward passes that sampled for it), ``prefill_tokens``,
    ``cached_tokens`` (prompt tokens the prefix cache held at admission), ``max_width``,
    ``preemptions``; times in seconds from ``time.perf_counter``.
    ``count_content_tokens``: the length of a text under the model's canonical tokenization,
    for the content figures of :class:`RequestStats`; None (a request built without a
    tokenizer) gives 0 content and tag tokens. ``renderer``: what of it the step API has
    output (kept across a preemption's restart; None: only its final result is output).
    ``stop_ids``: the ``stop_token_ids`` that are not the model's end of sequence (a main thread
    that ends on one gives it as ``stop_reason``, vLLM's rule: an end of sequence gives None)."""

    request_id: str
    index: int
    mode: str
    params: SamplingParams
    make_interpreter: Callable[[], Interpreter]
    interp: Interpreter | None = None
    status: RequestStatus = RequestStatus.WAITING
    views: dict[int, KVView] = field(default_factory=dict)
    steps: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    max_width: int = 0
    preemptions: int = 0
    arrival_s: float = field(default_factory=time.perf_counter)
    start_s: float = 0.0
    wall_s: float = 0.0
    finish_reason: str | None = None
    error: str | None = None
    count_content_tokens: Callable[[str], int] | None = None
    renderer: OutputRenderer | None = None
    stop_ids: frozenset[int] = frozenset()  # the params' stop_token_ids that are no end of sequence
    _written: RequestResult | None = field(default=None, repr=False)  # before the last restart (reset)
    _written_sampled: dict[tuple[int, ...], int] | None = field(default=None, repr=False)  # its threads' counts

    def __post_init__(self) -> None:
        if self.interp is None:
            self.interp = self.make_interpreter()

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def reset(self) -> None:
        """Back to its start, for a restart after preemption: a fresh interpreter and counters.
        What it had written is kept (:meth:`result`) until the restart has caught up with it.
        Its KV views are the scheduler's to release (it frees them right after this).

        Raises whatever building its result or its fresh interpreter raises (e.g. the
        detokenizer, a request's own dialect, a KeyboardInterrupt landing there); the request
        is unchanged then, so the caller can still end it with its pages."""
        written, counts = self._written, self._written_sampled
        if self.interp is not None and (self.interp.total_sampled or written is not None):
            written, counts = self._current()  # the snapshot, or what this run has written
        interp = self.make_interpreter()
        self._written, self._written_sampled = written, counts
        self.interp = interp
        self.steps = self.prefill_tokens = self.cached_tokens = self.max_width = 0

    def result(self) -> RequestResult:
        """The response as it stands (the whole response once finished). A request restarted
        after a preemption gives what it had written before the restart (with this end's finish
        reason and error) while the restart is at or behind that in every thread, and the
        restart's own response once it has caught up in every thread. When neither is ahead in
        every thread (forks under a token budget run at another pace after a restart), it gives
        the one whose text extends what the step API has streamed (``renderer``), so the final
        text never takes back streamed text; failing that, the one with more sampled tokens.

        Raises whatever rendering the response raises (e.g. the tokenizer's decode)."""
        return self._current()[0]

    def _current(self) -> tuple[RequestResult, dict[tuple[int, ...], int]]:
        """:meth:`result` and the sampled tokens per thread of the run it comes from (keyed by
        :func:`_sampled_by_thread`)."""
        w, was = self._written, self._written_sampled
        if w is None or was is None:
            return self._render(), _sampled_by_thread(self.interp)
        now = _sampled_by_thread(self.interp)
        if all(n <= was.get(k, 0) for k, n in now.items()):  # at or behind the snapshot in every thread
            return self._as_written(), was
        fresh = self._render()
        if all(now.get(k, 0) >= n for k, n in was.items()):  # caught up in every thread
            return fresh, now
        # ahead in one thread, behind in another: keep the run the streamed text came from
        streamed = self.renderer.text if self.renderer is not None else None
        if streamed:
            fresh_ok, written_ok = fresh.text.startswith(streamed), w.text.startswith(streamed)
            if fresh_ok != written_ok:
                return (fresh, now) if fresh_ok else (self._as_written(), was)
        if w.stats.tokens_decoded > self.interp.total_sampled:
            return self._as_written(), was
        return fresh, now

    def _as_written(self) -> RequestResult:
        """What it had written before its last restart, with this end's finish reason and error."""
        w = self._written
        return dataclasses.replace(w, error=self.error, stats=dataclasses.replace(
            w.stats, finish_reason=self.finish_reason or "", preemptions=self.preemptions, wall_s=self.wall_s))

    def _render(self) -> RequestResult:
        """The response of the run now (its interpreter's threads)."""
        it = self.interp
        sp = render.spliced(it)
        st = it.structure()
        cp = metrics.critical_path(st)
        parallelism = metrics.token_parallelism(st, cp) if cp else 1.0  # cp 0: nothing was sampled
        annotated = render.annotated_text(it)
        text = render.final_text(it, annotated)  # what a reader sees: no tag text, no list item a tag emptied
        eos = sum(1 for t in it.threads if t.finish == "eos")
        content = (metrics.content_token_count(self.count_content_tokens(text), it.total_sampled, eos)
                   if self.count_content_tokens is not None else 0)
        tags = metrics.tag_tokens(it.total_sampled, content, eos) if self.count_content_tokens is not None else 0
        forks = sum(1 for t in it.threads[1:] if t.finish != "not_run")
        stats = RequestStats(
            content_tokens=content,
            content_speedup=metrics.content_speedup(content, cp) if cp else 0.0,
            decode_steps=self.steps,
            prefill_tokens=self.prefill_tokens,
            tokens_decoded=it.total_sampled,
            tag_tokens=tags,
            threads=1 + forks,
            forks=forks,
            max_width=self.max_width,
            critical_path=cp,
            token_parallelism=parallelism,
            wall_s=self.wall_s,
            preemptions=self.preemptions,
            finish_reason=self.finish_reason or "",
            cached_tokens=self.cached_tokens,
        )
        return RequestResult(
            index=self.index,
            request_id=self.request_id,
            mode=it.mode,
            prompt_ids=list(it.prompt_ids),
            text=text,
            annotated_text=annotated,
            token_ids=sp.ids,
            logprobs=sp.logprobs if self.params.return_logprobs else None,
            positions=sp.positions,
            threads=sp.threads,
            stats=stats,
            diagnostics=list(it.diagnostics),
            error=self.error,
            stop_reason=self._stop_reason(),
        )

    def _stop_reason(self) -> str | int | None:
        """The stop string that ended the request, else the stop token id its main thread ended
        on (a chunk's stop token ends only that chunk), else None."""
        it = self.interp
        if it.stop_reason is not None or self.finish_reason != "stop" or not self.stop_ids:
            return it.stop_reason
        tokens = it.main.tokens
        return tokens[-1] if tokens and tokens[-1] in self.stop_ids else None


def _sampled_by_thread(it: Interpreter) -> dict[tuple[int, ...], int]:
    """Each thread's sampled tokens, keyed by its place in the thread tree (the child indices
    from the main thread down, ``()`` for the main thread): a restart gives a thread the same key
    whatever order its threads were forked in (thread ids follow fork order across threads)."""
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[tuple[int, ...], Any]] = [((), it.main)]
    while stack:
        key, t = stack.pop()
        out[key] = t.n_sampled
        stack.extend((key + (i,), c) for i, c in enumerate(t.children))
    return out
