"""What the engine hands back (no torch): :class:`RequestOutput` is what
:meth:`~pasta_engine.engine.llm_engine.Engine.step` returns for a request that progressed;
:class:`RequestResult` and :class:`RequestStats` are the finished response (what
``generate``/``replay`` return), :class:`CompletionOutput` one completion in vLLM's names.
:class:`~pasta_engine.core.request.Request` builds them (``Request.result``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .render import ThreadDelta, ThreadEvent

__all__ = ["RequestOutput", "RequestResult", "RequestStats", "CompletionOutput", "FINISH_REASONS"]

#: Why a request ended: ``stop`` (end of sequence, a stop token or stop string, or a replayed trace's end), ``length``
#: (``max_new_tokens`` or the model's context length), ``abort`` (:meth:`Engine.abort`),
#: ``error`` (an error that belongs to this request; the output says which).
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class RequestStats:
    """Per-request numbers (units in the names; definitions in :mod:`pasta_engine.metrics`,
    docs/DESIGN.md section 3). The content figures come first: tag tokens are overhead, not content.

    content_tokens: tokens of the clean ``text`` (tags stripped) under the canonical
    tokenization (:func:`pasta_engine.lang.tokenization.encode_text`), no tag tokens and no
    EOS, at most the non-EOS tokens sampled (:func:`pasta_engine.metrics.content_token_count`);
    content_speedup: the theoretical content speedup, content_tokens / critical_path (0 for
    an answer without content); decode_steps: forward passes that sampled for the request (the
    prompt's prefill pass included: it samples the first token); prefill_tokens: tokens
    forwarded without being sampled (prompt, inserted ``<async>`` tags; a prompt's tokens read
    from the prefix cache are not forwarded, see cached_tokens); tokens_decoded: tokens
    sampled by all threads (tags and EOS included); tag_tokens: tokens_decoded - EOS tokens
    sampled - content_tokens, at least 0 (:func:`pasta_engine.metrics.tag_tokens`: the tag
    tokens, plus any text the clean output drops); threads: threads that ran (main + children);
    forks: children forked; max_width: most threads sampling in one step (tokens kept: a step's samples cut by the
    token budget are not counted); critical_path: steps
    at unlimited width (tag tokens are on it); token_parallelism: tokens_decoded /
    critical_path, how parallel the run was (1.0 when nothing was sampled); wall_s: seconds
    from admission to finish; preemptions: times the request was restarted for lack of KV
    pages; finish_reason: one of :data:`FINISH_REASONS`; cached_tokens: prompt tokens whose KV
    came from the prefix cache instead of a prefill (vLLM's ``num_cached_tokens``; at the
    request's last admission)."""

    content_tokens: int
    content_speedup: float
    decode_steps: int
    prefill_tokens: int
    tokens_decoded: int
    tag_tokens: int
    threads: int
    forks: int
    max_width: int
    critical_path: int
    token_parallelism: float
    wall_s: float
    preemptions: int
    finish_reason: str
    cached_tokens: int = 0


@dataclass
class RequestResult:
    """One finished response.

    ``text``: the clean response a reader sees (:func:`pasta_engine.lang.tags.clean_text` of
    ``annotated_text``: no tag, no malformed or partial tag, no list item a left-out tag
    emptied); ``annotated_text``: every character the model wrote, with PASTA-LANG tags,
    each chunk spliced after its promise (a sampled special token that is no tag, such as
    ``<|im_start|>``, writes none: vLLM's default ``skip_special_tokens=True``,
    :func:`~pasta_engine.lang.tokenization.hidden_special_ids`; its id stays in
    ``token_ids``); ``token_ids``: the response in spliced order (main thread's EOS included,
    as ``transformers`` returns it); ``logprobs``: per token of
    ``token_ids`` (None for inserted tokens) when asked; ``positions``/``threads``: each
    token's logical position and thread id; ``diagnostics``: what the interpreter noted
    (malformed tags, caps, ...); ``error``: why the request failed (finish reason ``error``);
    ``stop_reason``: the stop string (``SamplingParams.stop``) that ended it, its text cut right
    before it (finish reason ``stop``), or the ``stop_token_ids`` id its main thread ended on
    (not an end-of-sequence id: vLLM's rule), else None; ``choices``: with ``SamplingParams.n > 1``
    (:meth:`~pasta_engine.engine.llm_engine.Engine.generate`), the results of the prompt's ``n``
    completions, this result's own fields being the first one's (empty for one completion).
    :attr:`outputs` reads them in vLLM's shape."""

    index: int
    request_id: str
    mode: str
    prompt_ids: list[int]
    text: str
    annotated_text: str
    token_ids: list[int]
    logprobs: list[float | None] | None
    positions: list[int]
    threads: list[int]
    stats: RequestStats
    diagnostics: list[str] = field(default_factory=list)
    error: str | None = None
    stop_reason: str | int | None = None
    choices: list["RequestResult"] = field(default_factory=list)

    @property
    def outputs(self) -> list["CompletionOutput"]:
        """The prompt's completions as vLLM's ``RequestOutput.outputs`` (``outputs[i].text``, ...):
        one per completion (``n`` of them, or this result alone), each with its index and its
        whole result (annotated text, stats) in ``result``."""
        return [CompletionOutput(i, r.text, list(r.token_ids), r.stats.finish_reason or None, r.stop_reason,
                                 logprobs=r.logprobs, result=r)
                for i, r in enumerate(self.choices or [self])]

    def to_dict(self, include_trace: bool = False) -> dict[str, Any]:
        """JSON-ready dict; per-token positions/threads and prompt ids only with ``include_trace``."""
        d = asdict(self)
        if self.choices:  # each completion as its own dict, with the same rule
            d["choices"] = [c.to_dict(include_trace) for c in self.choices]
        else:
            d.pop("choices")
        if not include_trace:
            d.pop("positions")
            d.pop("threads")
            d.pop("prompt_ids")
        return d


@dataclass
class CompletionOutput:
    """One completion in vLLM's names (``vllm.outputs.CompletionOutput``): its index among the
    prompt's ``n``, text and token ids (new or cumulative as the request's ``output_kind`` for a
    stream), its logprobs when asked, and why it finished (None while it runs). ``result``: the
    finished completion's whole :class:`RequestResult` (annotated text, stats), None before."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[float | None] | None = None
    result: "RequestResult | None" = None


class RequestOutput:
    """What :meth:`~pasta_engine.engine.llm_engine.Engine.step` has new for a request.

    Text and tokens follow vLLM's DELTA/CUMULATIVE semantics, in the response's reading order
    (main text up to a promise, its chunk, the main text after it, ...; docs/DESIGN.md section 7),
    rendered once by :class:`~pasta_engine.core.render.OutputRenderer`:

    Attributes:
        request_id: the id ``add_request`` returned.
        text: the clean response so far in reading order (CUMULATIVE): the longest prefix that
            can no longer change (the main text after a chunk still decoding is held until it
            ends; a partial tag, or a last line that may still become a list item a tag
            empties, is held back). Each output's ``text`` extends the previous one's (nothing
            is taken back, a restart after a preemption included), no tag text is ever in it,
            and at the end it is ``result.text``.
        delta_text: what ``text`` gained since the request's previous output (DELTA): the
            deltas concatenate to the final text.
        new_token_ids: the tokens sampled for it since its previous output, all threads (EOS
            included), in the step's thread order; each sampled token once, also when a
            preempted request re-samples its tokens after its restart.
        thread_deltas: the same per thread, with its id, its new tokens and its new clean text
            (:class:`~pasta_engine.core.render.ThreadDelta`), by thread id.
        new_logprobs: with ``SamplingParams.return_logprobs``, ``(token id, logprob)`` of each
            sampled token that joined the settled part of the response's spliced order since its
            previous output (:func:`~pasta_engine.core.render.settled_spliced`: in tokens, the
            prefix ``text`` is in text, tag tokens included, inserted ones left out), in that
            order; the rest in the final output. The deltas concatenate to the sampled tokens
            and logprobs of ``result.token_ids`` / ``result.logprobs``. Empty otherwise.
        events: what happened to its threads (:class:`~pasta_engine.core.render.ThreadEvent`:
            fork, text, end, join, finish), in order.
        finished: whether the request is over; then ``finish_reason`` is one of
            :data:`FINISH_REASONS` and ``result`` holds the whole response and its stats.
            A stop string (``SamplingParams.stop``) ends it in the step whose text first holds
            one: ``finish_reason`` ``stop``, ``stop_reason`` the string, the text cut right
            before it (a tail that may still become one is held back until then).
        error: the message of the error that ended it (``finish_reason == "error"``).
        decode_steps: forward passes that sampled for it so far (of its current run after a
            preemption); tokens_decoded: tokens its current run sampled, all threads.

    A request added with ``output_kind="final"`` (and those ``generate``/``replay`` run
    themselves) is not rendered step by step: its one output is the final one, with ``text`` =
    ``delta_text`` = ``result.text``, no token, thread or event deltas (``result`` has them all)."""

    __slots__ = ("request_id", "text", "delta_text", "new_token_ids", "thread_deltas", "events", "finished",
                 "finish_reason", "error", "result", "decode_steps", "tokens_decoded", "stop_reason", "new_logprobs")

    def __init__(self, request_id: str, new_token_ids: list[int], text: str = "", delta_text: str = "",
                 thread_deltas: list[ThreadDelta] | None = None, events: list[ThreadEvent] | None = None,
                 finished: bool = False, finish_reason: str | None = None, error: str | None = None,
                 result: RequestResult | None = None, decode_steps: int = 0, tokens_decoded: int = 0,
                 stop_reason: str | int | None = None, new_logprobs: list[tuple[int, float]] | None = None):
        self.request_id = request_id
        self.new_token_ids = new_token_ids
        self.text = text
        self.delta_text = delta_text
        self.thread_deltas = thread_deltas if thread_deltas is not None else []
        self.events = events if events is not None else []
        self.finished = finished
        self.finish_reason = finish_reason
        self.error = error
        self.result = result
        self.decode_steps = decode_steps
        self.tokens_decoded = tokens_decoded
        self.stop_reason = stop_reason
        self.new_logprobs = new_logprobs if new_logprobs is not None else []

    def add(self, later: "RequestOutput") -> None:
        """Fold ``later``, the next output of the same request, into this one (vLLM's
        ``RequestOutput.add``): deltas, tokens and events concatenated, per thread too; the
        cumulative text, the state and the counters are ``later``'s.

        Raises ValueError when ``later`` belongs to another request."""
        if later.request_id != self.request_id:
            raise ValueError(f"cannot add an output of request {later.request_id!r} to one of {self.request_id!r}")
        self.new_token_ids = self.new_token_ids + later.new_token_ids
        self.new_logprobs = self.new_logprobs + later.new_logprobs
        self.delta_text += later.delta_text
        merged = {d.thread: ThreadDelta(d.thread, list(d.token_ids), d.text) for d in self.thread_deltas}
        for d in later.thread_deltas:
            m = merged.get(d.thread)
            if m is None:
                merged[d.thread] = ThreadDelta(d.thread, list(d.token_ids), d.text)
            else:
                m.token_ids += d.token_ids
                m.text += d.text
        self.thread_deltas = [merged[k] for k in sorted(merged)]
        self.events = self.events + later.events
        for name in ("text", "finished", "finish_reason", "error", "result", "decode_steps", "tokens_decoded",
                     "stop_reason"):
            setattr(self, name, getattr(later, name))

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, delta_text={self.delta_text!r}, "
                f"new_token_ids={self.new_token_ids!r}, text={self.text!r}, finished={self.finished!r}, "
                f"finish_reason={self.finish_reason!r}, error={self.error!r})")

    @property
    def stats(self) -> RequestStats | None:
        """The finished request's stats (None while it runs)."""
        return self.result.stats if self.result is not None else None
