"""The contract between the interpreter, the scheduler and the model runner (no torch).

After nano-vllm's split: the interpreter (:mod:`~pasta_engine.core.interpreter`) states its
demand, one :class:`ThreadStep` per thread that has tokens to forward (all its pending tokens),
and the KV operations (:class:`KVFork`, :class:`KVJoin`, :class:`KVRelease`) its threads
need; the scheduler (:mod:`~pasta_engine.core.scheduler`) picks the threads and how many of
their pending tokens run this step under the token budget (``max_num_batched_tokens``; a prompt
longer than the budget is prefilled in pieces: chunked prefill), allocates their KV slots and
returns a :class:`ScheduledBatch`, with a :class:`SamplingRow` for every thread that samples
(everything sampling needs, so the model runner reads no request); the model runner forwards
it and returns :class:`SampledTokens`; the scheduler hands the tokens back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple, Protocol, Sequence

if TYPE_CHECKING:
    from .block_manager import Run

__all__ = [
    "ThreadStep",
    "KVFork",
    "KVJoin",
    "KVRelease",
    "KVOp",
    "KVBound",
    "SamplingOptions",
    "SeenTokens",
    "RandomStream",
    "thread_seed",
    "SamplingRow",
    "ScheduledThread",
    "ScheduledBatch",
    "SampledTokens",
]


@dataclass(slots=True)
class ThreadStep:
    """One thread's tokens to forward at logical ``positions``; ``sample``: sample after the
    last one (False for a flush, and for a piece of a longer pending list that is not its end).
    ``forced`` is the token replay takes instead of sampling (None: sample). ``grammar`` is the
    thread's :class:`~pasta_engine.lang.grammar.GrammarState` (``FREE``: no mask).

    As the interpreter's demand it holds all the thread's pending tokens; in a scheduled batch,
    the piece that runs this step (:meth:`first`)."""

    tid: int
    tokens: list[int]
    positions: list[int]
    sample: bool
    forced: int | None = None
    grammar: int = 0  # GrammarState: which tokens the sampler masks for this thread (0: none)

    def first(self, n: int) -> "ThreadStep":
        """The step of the first ``n`` tokens (1 <= n <= len(tokens)): itself when ``n`` is all of
        them, else a piece that does not sample. Raises ValueError for another ``n``."""
        if n == len(self.tokens):
            return self
        if not 1 <= n < len(self.tokens):
            raise ValueError(f"thread {self.tid}: cannot take {n} of its {len(self.tokens)} pending tokens")
        return ThreadStep(self.tid, self.tokens[:n], self.positions[:n], False, None, 0)


# --------------------------------------------------------------------------- KV operations


@dataclass(slots=True)
class KVFork:
    """Thread ``child`` starts with the KV view thread ``parent`` has once the parent's pending
    tokens have their slots (shared, not copied): those tokens run in the same step."""

    parent: int
    child: int


@dataclass(slots=True)
class KVJoin:
    """The children's own KV pages (their pending tokens' slots included: those run in the same
    step) join ``parent``'s view, before the parent's pending tokens."""

    parent: int
    children: list[int]


@dataclass(slots=True)
class KVRelease:
    """Thread ``tid`` is gone: drop its references to KV pages."""

    tid: int


KVOp = KVFork | KVJoin | KVRelease


class KVBound(NamedTuple):
    """The most KV a request can write over its whole life: ``tokens`` (prompt, sampled tokens
    and the inserted tags of its forks) and ``forks`` (each can leave two partly filled pages)."""

    tokens: int
    forks: int


# --------------------------------------------------------------------------- the batch


class SamplingOptions(Protocol):
    """What sampling reads of a request's :class:`~pasta_engine.config.SamplingParams` (which is
    one; named here as a protocol because this module may not import ``config``, which imports
    ``lang``)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    return_logprobs: bool
    seed: int | None

    @property
    def greedy(self) -> bool: ...

    @property
    def penalised(self) -> bool: ...


@dataclass(slots=True)
class SeenTokens:
    """The tokens one thread sees, counted (for the penalties): ``counts`` every token id (its
    prompt, its ancestors' tokens up to its fork, its own tokens; the repetition penalty's set)
    and ``response`` the same without the prompt (the presence and frequency penalties' counts,
    vLLM's output tokens). Kept incrementally by the scheduler: counted once from the thread's
    tokens at its first penalised sample (:meth:`recount`), then each step's forwarded tokens
    are added (:meth:`add`), so a step costs its new tokens, not the thread's length."""

    counts: dict[int, int]
    response: dict[int, int]

    @classmethod
    def recount(cls, seen: Sequence[int], prompt_len: int) -> "SeenTokens":
        """Counts of ``seen`` (a thread's tokens, the prompt's ``prompt_len`` first)."""
        counts: dict[int, int] = {}
        response: dict[int, int] = {}
        for i, t in enumerate(seen):
            counts[t] = counts.get(t, 0) + 1
            if i >= prompt_len:
                response[t] = response.get(t, 0) + 1
        return cls(counts, response)

    def add(self, tokens: Iterable[int]) -> None:
        """Count ``tokens`` (response tokens the thread now sees)."""
        counts, response = self.counts, self.response
        for t in tokens:
            counts[t] = counts.get(t, 0) + 1
            response[t] = response.get(t, 0) + 1


@dataclass(slots=True, eq=False)
class RandomStream:
    """One thread's random numbers: ``seed`` (:func:`thread_seed` of its request's
    ``SamplingParams.seed``) and the generator the model runner makes from it at the thread's
    first random draw (a ``torch.Generator``; opaque here, this module imports no torch). Each
    thread of a request has its own stream, so what a thread samples does not depend on how
    many of its siblings sample in the same steps (a thread that ends early, at a stop string,
    or a width limit changes no other thread's draws); a preempted request restarts with new
    ones, so its tokens repeat."""

    seed: int | None
    generator: object | None = None


_MASK64 = 2**64 - 1


def thread_seed(seed: int | None, tid: int) -> int | None:
    """The seed of thread ``tid`` of a request seeded ``seed`` (an int in ``[0, 2**64 - 1]``):
    the main thread's is ``seed`` itself (a request that never forks draws what it always
    did), a child's is SplitMix64's finalizer of ``seed + tid * golden gamma`` (Steele et al.
    2014, the mixer of Java's SplittableRandom), so the streams of a request's threads, and of
    the ``seed + i`` choices of ``n``, do not overlap. None stays None."""
    if seed is None or tid == 0:
        return seed
    z = (seed + tid * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(slots=True)
class SamplingRow:
    """Everything sampling needs for one sampling thread in one step, filled by the scheduler
    (SGLang's per-request sampling info, per thread): the request's ``request_id`` (errors
    name it) and ``params``, the thread ``tid``, the token replay forces (None: sample), the
    thread's grammar state (0: no mask), the tokens it sees (None when no penalty applies), the
    end-token ids it may not sample now (``min_tokens``, ``ignore_eos``; may hold ids past the
    vocabulary, which the sampler leaves out), the request's ``Limits.fork_threshold`` (None:
    off) and the thread's :class:`RandomStream`. Rows of one request are consecutive in a batch."""

    request_id: str
    tid: int
    params: SamplingOptions
    forced: int | None
    grammar: int
    seen: SeenTokens | None
    masked_ends: tuple[int, ...]
    fork_threshold: float | None
    rng: RandomStream


@dataclass(slots=True)
class ScheduledThread:
    """One thread's work this step: the request it belongs to (``request_id``), its step (all
    or part of its pending tokens), the KV slots those tokens are written to (one per token),
    its KV view as attention metadata runs (the view ends with those slots), and, when it
    samples, its :class:`SamplingRow`."""

    request_id: str
    step: ThreadStep
    slots: list[int]
    runs: list["Run"]
    row: SamplingRow | None = None


@dataclass
class ScheduledBatch:
    """Every thread that runs this step, grouped by request in running order."""

    threads: list[ScheduledThread] = field(default_factory=list)

    @property
    def sampling(self) -> list[ScheduledThread]:
        """The threads that sample a token after their forward, in batch order."""
        return [t for t in self.threads if t.step.sample]

    @property
    def rows(self) -> list[SamplingRow]:
        """The sampling threads' rows, in batch order (the sampler's input)."""
        return [t.row for t in self.threads if t.row is not None]

    @property
    def num_tokens(self) -> int:
        """Tokens forwarded this step (what the token budget counts)."""
        return sum(len(t.step.tokens) for t in self.threads)

    def __bool__(self) -> bool:
        return bool(self.threads)


class SampledTokens:
    """What the model runner picked: ``token_ids[i]`` and ``logprobs[i]`` for the i-th sampling
    thread of the batch (logprobs are 0.0 when the request did not ask for them), and
    ``errors``: request id -> message for requests whose sampling failed (their entries are
    placeholders).

    The values may still be on their way from the device: ``wait`` (when given) is called once,
    on the first read of any field, and returns ``(token_ids, logprobs, errors)``; that read is
    the step's one host-device sync, so readers do the work that needs no token first."""

    def __init__(self, token_ids: list[int] | None = None, logprobs: list[float] | None = None,
                 errors: dict[str, str] | None = None, wait: Callable[[], tuple] | None = None):
        self._values = None if wait is not None else (token_ids or [], logprobs or [], errors or {})
        self._wait = wait

    def _get(self) -> tuple[list[int], list[float], dict[str, str]]:
        if self._values is None:
            self._values = self._wait()
            self._wait = None
        return self._values

    @property
    def token_ids(self) -> list[int]:
        return self._get()[0]

    @property
    def logprobs(self) -> list[float]:
        return self._get()[1]

    @property
    def errors(self) -> dict[str, str]:
        return self._get()[2]
