"""Every option of the engine, validated in one place (no torch).

* :class:`SamplingParams`: per request, how to pick tokens and when to stop;
* :class:`Limits`: per request, how far PASTA's threads may go (width, forks, chunk caps);
* :class:`PositionPolicy`: how many logical positions the main thread skips after a promise;
* :class:`EngineConfig`: the engine's settings (KV cache, batching, backend, defaults of the
  two above).

Each class checks its fields when it is built and raises
:class:`~pasta_engine.errors.ParameterError` naming the first bad field and its value, so a bad
request fails before it takes any resource. Booleans are not integers here (``top_k=True`` is
an error), and strings are not numbers.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import InitVar, dataclass, field, fields
from types import MappingProxyType
from typing import Any

from .errors import ParameterError
from .lang.prompts import DEFAULT_PASTA_PROMPT, PastaPrompt

__all__ = [
    "SamplingParams",
    "Limits",
    "PositionPolicy",
    "EngineConfig",
    "THREAD_POLICIES",
    "GREEDY_TEMPERATURE",
    "MAX_SEED",
    "DEFAULT_MAX_NEW_TOKENS",
    "MAX_N",
    "check_int",
    "check_float",
    "check_bool",
    "limits_without_effect",
]

#: Temperatures below this mean greedy decoding (as vLLM's ``_SAMPLING_EPS``): dividing
#: logits by a smaller number overflows to inf and the softmax to NaN.
GREEDY_TEMPERATURE = 1e-5
#: Largest seed a ``torch.Generator`` takes.
MAX_SEED = 2**64 - 1
#: ``max_new_tokens`` of a :class:`SamplingParams` that gives neither it nor ``max_tokens``.
DEFAULT_MAX_NEW_TOKENS = 256
#: Most ``stop_token_ids`` of one request, and the largest id (the server's bounds).
MAX_STOP_TOKEN_IDS = 1024
#: Stop strings per request, and characters per stop string (the server's limits too).
MAX_STOPS = 16
MAX_STOP_CHARS = 1024
MAX_TOKEN_ID = 2**31 - 1
#: Most completions per prompt (``SamplingParams.n``).
MAX_N = 1024


def check_int(param: str, value: Any, lo: int | None = None, hi: int | None = None, *, none_ok: bool = False) -> None:
    """Raise ParameterError unless ``value`` is an ``int`` (not a bool) in ``[lo, hi]``."""
    if value is None and none_ok:
        return
    rng = (f" >= {lo}" if hi is None else f" in [{lo}, {hi}]") if lo is not None else ""
    expected = f"an integer{rng}" + (" or None" if none_ok else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ParameterError(param, value, expected)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ParameterError(param, value, expected)


def check_float(param: str, value: Any, lo: float | None = None, hi: float | None = None, *,
                lo_open: bool = False) -> None:
    """Raise ParameterError unless ``value`` is a finite real number (not a bool) with
    ``lo <= value`` (``lo < value`` when ``lo_open``) and ``value <= hi``."""
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo}")
    if hi is not None:
        parts.append(f"<= {hi}")
    expected = "a finite number" + (" " + " and ".join(parts) if parts else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ParameterError(param, value, expected)
    try:
        v = float(value)
    except OverflowError:  # an int beyond float range (10**400): not a finite number
        raise ParameterError(param, value, expected) from None
    if not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        raise ParameterError(param, value, expected)


def check_bool(param: str, value: Any) -> None:
    """Raise ParameterError unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise ParameterError(param, value, "True or False")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick a request's tokens, and when to stop (vLLM's names and meanings).

    Attributes:
        max_new_tokens: tokens the response may hold, all threads together (>= 1; None, the
            default: ``max_tokens`` when given, else 256).
        max_tokens: vLLM's and OpenAI's name for ``max_new_tokens`` (init only: not stored, the
            attribute reads None; read ``max_new_tokens``). Giving both with different values is
            a ParameterError.
        temperature: logits are divided by it; below ``1e-5`` (0 included) decoding is greedy
            (argmax), as in vLLM.
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens (0 = all).
        min_p: in [0, 1]; a sampled (not greedy) thread keeps only tokens whose probability,
            after temperature, top-k and top-p, is at least ``min_p`` times the most likely
            token's (vLLM's ``min_p``; Nguyen et al. 2024, "Min P Sampling"; applied after top-k
            and top-p as ``transformers``' ``MinPLogitsWarper`` and vLLM's V0 sampler do).
            0 = off.
        seed: seed of the request's own ``torch.Generator`` (same seed, same tokens), an
            integer in ``[0, 2**64 - 1]``; None (the default, as vLLM's): the engine draws a fresh
            seed for each request it adds, so two calls, and two copies of a prompt in one
            batch, sample independently (greedy decoding needs no seed and stays deterministic).
        return_logprobs: fill ``result.logprobs`` with the natural-log probability of each
            sampled token under the distribution the sampler picks from before temperature,
            top-k, top-p and min-p (after penalties and masks).
        logprobs: vLLM's count of alternatives per token (init only): None = no logprobs,
            0 = the sampled token's logprob only (sets ``return_logprobs``); more than 0 is a
            ParameterError (no alternatives are returned). Init only, like ``max_tokens``.
        repetition_penalty: in [0.01, 100]; 1 = none (a smaller one multiplies logits past
            float32's range). Before sampling, the logit of every token the
            thread counts (the prompt, and of the response: the main thread its own tokens, not a
            chunk's even after the ``<sync/>`` that makes it visible; a chunk the main thread up
            to its own promise, which it does not count, and its own tokens; see
            ``Interpreter.seen_tokens``) is divided by it when positive and
            multiplied by it when negative (Keskar et al. 2019, "CTRL", section 4.1; the rule of
            ``transformers``' and vLLM's ``repetition_penalty``).
        presence_penalty: in [-2, 2]; 0 = none. Subtracted from the logit of every token that
            occurs in the response tokens the thread counts (those of ``repetition_penalty``'s
            set without the prompt: vLLM and OpenAI count output tokens only).
        frequency_penalty: in [-2, 2]; 0 = none. ``frequency_penalty * count`` is subtracted from
            each token's logit, ``count`` its occurrences in the same response tokens (OpenAI's
            "Parameter details" formula, vLLM's ``frequency_penalty``). Penalties apply in vLLM's
            order: repetition, then frequency and presence, all before the masks below and the
            temperature; they apply to greedy threads too, not to forced (replayed) tokens.
        stop_token_ids: token ids (at most 1024, each in ``[0, 2**31 - 1]``; None is none; an id outside the
            model's vocabulary is refused when the request is added) that end a thread as the
            model's end-of-sequence token does: in the main thread they end the response
            (``finish_reason`` ``stop`` once its chunks have ended), in a chunk (pasta mode)
            they end that chunk only, which the interpreter closes as at EOS while the main
            thread goes on. The stop token is kept in ``token_ids`` and left out of the text
            (vLLM's rule). Stored as a tuple. The PASTA-LANG grammar does not forbid them inside
            a tag (it forbids only the model's EOS there). A replay (``annotated_response``)
            ignores them: its forced tokens are the response.
        stop: strings (a string, or at most 16, each 1 to 1024 characters; None, vLLM's default, is none) that end the
            response right before the first of them in its reading-order clean text (vLLM's
            ``stop``; the text left out of the result, ``finish_reason`` ``stop`` and
            ``stop_reason`` the string; the annotated text keeps everything decoded). Applied by
            the engine itself (:mod:`pasta_engine.core.interpreter`, :func:`pasta_engine.core.render.final_text`),
            so every API (the step API, ``generate``, :class:`AsyncEngine`, the server) ends
            such a request as ``stop`` in the step that made its reading-order text hold the
            string, with the same text; a stream holds back a tail that may still become one.
            Each thread's own text is checked as it grows (a chunk that writes one ends there).
            Stored as a tuple.
        ignore_eos: mask the model's end-of-sequence tokens (logit ``-inf``) in every thread, so
            the response runs until ``max_new_tokens``, a stop token or a stop string (the
            intent of vLLM's ``ignore_eos``, which keeps decoding past a sampled EOS; here EOS is
            never sampled, so no EOS sits in the response either). In pasta mode a chunk then
            ends only at its ``</async>`` or its length cap. ``stop_token_ids`` still end.
        min_tokens: in ``[0, max_new_tokens]``; EOS and ``stop_token_ids`` are masked in every
            thread until the request has sampled this many tokens, counted as
            ``max_new_tokens`` counts them (all threads of the request together; vLLM counts a
            sequence's output tokens, which is the same count in sequential mode).

        n: completions per prompt (vLLM's ``n``; 1 to :data:`MAX_N`). :meth:`Engine.generate`
            decodes ``n`` requests for each prompt and returns them in the prompt's
            ``RequestResult.outputs`` (vLLM's ``RequestOutput.outputs[i]``); each gets its own
            fresh seed when ``seed`` is None, or ``seed + i`` (mod ``2**64``) when it is set, so
            sampled completions differ (greedy ones are equal, as in vLLM). A request of the step
            API or :class:`AsyncEngine` is one completion: they refuse ``n > 1`` (add ``n``
            requests, :func:`pasta_engine.engine.input_processor.choice_params` gives their
            params); the server honours its ``n`` field.

    Raises ParameterError naming the first bad field and its value."""

    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    return_logprobs: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    max_tokens: InitVar[int | None] = None
    logprobs: InitVar[int | None] = None

    def __post_init__(self, max_tokens: int | None, logprobs: int | None) -> None:
        if max_tokens is not None:
            check_int("max_tokens", max_tokens, 1)
            if self.max_new_tokens is not None:
                check_int("max_new_tokens", self.max_new_tokens, 1)  # a bad one is named itself, first
            if self.max_new_tokens is not None and self.max_new_tokens != max_tokens:
                raise ParameterError("max_tokens", max_tokens, message=(
                    f"max_tokens={max_tokens} disagrees with max_new_tokens={self.max_new_tokens!r}: give one of them"))
            if self.max_new_tokens is None:
                object.__setattr__(self, "max_new_tokens", max_tokens)
        if self.max_new_tokens is None:
            object.__setattr__(self, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        check_int("max_new_tokens", self.max_new_tokens, 1)
        check_float("temperature", self.temperature, 0.0)
        check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_int("top_k", self.top_k, 0)
        check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            check_int("seed", self.seed, 0, MAX_SEED)
            object.__setattr__(self, "seed", int(self.seed))  # a numpy integer too: torch's generator needs an int
        check_bool("return_logprobs", self.return_logprobs)
        if logprobs is not None:
            check_int("logprobs", logprobs, 0)
            if logprobs > 0:
                raise ParameterError("logprobs", logprobs, message=(
                    f"logprobs={logprobs} is not supported: only 0 (the sampled token's logprob, no alternatives) "
                    "or None"))
            object.__setattr__(self, "return_logprobs", True)
        check_float("repetition_penalty", self.repetition_penalty, 0.01, 100.0)  # 1e-45 overflowed the logits
        check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        ids = () if self.stop_token_ids is None else self.stop_token_ids  # None: vLLM's default, none
        expected = f"a list of at most {MAX_STOP_TOKEN_IDS} token ids (integers in [0, {MAX_TOKEN_ID}])"
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)) or len(ids) > MAX_STOP_TOKEN_IDS:
            raise ParameterError("stop_token_ids", ids, expected)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i <= MAX_TOKEN_ID:
                raise ParameterError("stop_token_ids", ids, expected)
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        stops = (self.stop,) if isinstance(self.stop, str) else () if self.stop is None else self.stop
        if not isinstance(stops, (list, tuple)) or len(stops) > MAX_STOPS or not all(
                isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in stops):
            raise ParameterError("stop", self.stop, f"a non-empty string or a list of at most {MAX_STOPS} of them "
                                 f"(each at most {MAX_STOP_CHARS} characters)")
        object.__setattr__(self, "stop", tuple(stops))
        check_bool("ignore_eos", self.ignore_eos)
        check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_new_tokens:
            raise ParameterError("min_tokens", self.min_tokens, message=(
                f"min_tokens={self.min_tokens} is more than max_new_tokens={self.max_new_tokens}"))
        check_int("n", self.n, 1, MAX_N)

    @property
    def greedy(self) -> bool:
        """Whether tokens are picked by argmax (temperature below ``GREEDY_TEMPERATURE``)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalised(self) -> bool:
        """Whether a presence or frequency penalty applies."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


#: What :meth:`PositionPolicy.parse` takes (its error message).
_POLICY_SPECS = "'predicted', 'none', 'oracle' or 'constant:K' with K an integer in [0, 999999999]"


@dataclass(frozen=True)
class PositionPolicy:
    """How many logical positions the main thread skips after a promise.

    The child's tokens take positions right after the promise's last token; the main thread
    continues after a reserved range of ``open + size + close`` positions, where ``open`` and
    ``close`` are the token counts of ``<async>`` and ``</async>`` and ``size`` is:

    * ``predicted`` (default): the promise's ``tokens="N"`` (PASTA's Pred-10x scheme, Jin et al.
      2025, section 4);
    * ``constant:K``: K for every promise;
    * ``none``: nothing is reserved (not even the tags): positions collide;
    * ``oracle``: the chunk's true length (replay only; positions then equal those of
      sequential decoding of the spliced response).
    """

    kind: str = "predicted"
    constant: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("predicted", "none", "oracle", "constant"):
            raise ParameterError("position_policy", self.kind, "'predicted', 'none', 'oracle' or 'constant:K'")
        check_int("position_policy constant", self.constant, 0, 10**9 - 1)  # as parse bounds K (str() parses back)
        if self.constant and self.kind != "constant":  # it would be ignored
            raise ParameterError("position_policy", self, message=f"position_policy {self.kind!r} takes no constant "
                                 f"(got constant={self.constant}): use PositionPolicy('constant', K) for K positions")

    @classmethod
    def parse(cls, spec: "str | PositionPolicy") -> "PositionPolicy":
        """Parse ``predicted``, ``none``, ``oracle`` or ``constant:K`` (K an integer in
        ``[0, 999999999]``, at most 9 digits).

        Raises ParameterError naming the bad spec."""
        if isinstance(spec, PositionPolicy):
            return spec
        if not isinstance(spec, str):
            raise ParameterError("position_policy", spec, _POLICY_SPECS)
        s = spec.strip().lower()
        if s in ("predicted", "none", "oracle"):
            return cls(kind=s)
        if s.startswith("constant:"):
            k = s.split(":", 1)[1].strip()
            if k.isascii() and k.isdigit() and len(k) <= 9:  # not "²" (a digit int() refuses), no 5,000 digits
                return cls(kind="constant", constant=int(k))
        raise ParameterError("position_policy", spec, _POLICY_SPECS)

    def __str__(self) -> str:
        return f"constant:{self.constant}" if self.kind == "constant" else self.kind


#: Values of :attr:`Limits.length_cut`.
LENGTH_CUTS = ("prefix", "keep")


@dataclass(frozen=True)
class Limits:
    """How far one request's threads may go (counts in tokens or threads).

    Attributes:
        max_threads: threads of one request that decode in the same step, main included;
            further children wait in fork order. ``None`` = unlimited width.
        max_forks: forks per request; later promises are text (generate) or decoded inline
            by the main thread (replay). Caps runaway forking.
        async_min_cap, cap_factor: a child samples at most
            ``max(async_min_cap, ceil(cap_factor * N))`` tokens (docs/DESIGN.md section 2, rule 4).
        max_promise_tokens: ``N`` above this is clamped (positions and caps).
        max_fork_depth: how deep forks nest, in a dialect that nests them (Multiverse): a
            thread at depth ``d`` (the main thread at 0, its children at 1) forks only while
            ``d < max_fork_depth``; past it a fork marker's block is decoded inline by the
            thread itself (text the model writes). 1: only the main thread forks.
        fork_threshold: the fork knob of a learned model (None: off, the model decides as it
            samples). Where the main thread may open a promise, the promise piece token
            (``<promise topic="``) is taken when its probability, after penalties and masks
            and before temperature, is at least this, and masked otherwise: a lower threshold
            forks more (faster, each fork a bet on independence), a higher one less. In
            ``(0, 1]``. Needs pasta mode, the PASTA-LANG dialect and a model whose tokenizer has
            the tag pieces as tokens (an adapter trained with ``--tag-tokens``); the engine
            refuses it otherwise. Not applied to forced (replayed) tokens.
        length_cut: what the reader gets when ``max_new_tokens`` (all threads together) or the
            context length runs out while chunks are unfinished: ``"prefix"`` (default, what a
            vLLM user expects of ``length``: the clean text ends where the first unfinished
            chunk in reading order stopped, so no later text follows a hole) or ``"keep"``
            (every thread's text, holes and all). The annotated text keeps everything either way.
        distinct_topics: where the sampler enforces the PASTA-LANG grammar (a model with the tag
            pieces as tokens), a promise's topic may not end while it equals a topic already
            promised in the response (case, spacing and punctuation ignored): siblings are never
            promised the same topic (docs/DESIGN.md section 2). False: the model's topics as
            it samples them.
        chunk_clean_end: where the sampler enforces the grammar, a chunk (an async thread)
            may not end (``</async>`` or end-of-sequence) empty, at a colon, comma or
            semicolon, or on a bare list marker (:func:`~pasta_engine.lang.grammar.chunk_may_end`), and a chunk at its
            cap mid-sentence gets up to ``SENTENCE_GRACE_TOKENS`` (32,
            :mod:`pasta_engine.core.interpreter`) more tokens to end its sentence
            (:func:`~pasta_engine.lang.grammar.ends_sentence`) (issue 30). False: chunks end
            where the model or the cap ends them.
        independent_topics: where the sampler enforces the grammar, a promise's topic may not
            open with a word that leans on what came before ("Another", "Furthermore", "This",
            "Finally", ...: :data:`~pasta_engine.lang.grammar.LEANING_WORDS`). A chunk opens with
            its topic's words, so such a topic makes it lean on a sibling it cannot see. Off by
            default: on the adapter shipped before 2026-11-29 it raised the forks passing the lexical
            independence test from 70% to 93% and the theoretical content speedup from 1.52x to 1.57x, but read
            blind the answers won 39.1% against 42.8% without it (issue 30,
            bench/results/leaning-topics-smollm2-cpu/). False: the model's topics as it samples
            them.
        fork_headroom_tokens: where the sampler enforces the grammar while a model samples in
            pasta or inline mode, the main thread may open a promise only while the tokens left
            under ``max_new_tokens`` (every thread's together, docs/DESIGN.md section 8) are at
            least the tokens the running chunks were promised and have not written yet, plus
            this headroom (for the new promise's tags and chunk). A chunk the budget cannot
            finish is cut, and under ``length_cut="prefix"`` every sibling after it is lost to
            the reader: past this point the main thread writes on, or ends, instead of forking.
            ``None`` (default): off, the model forks while ``max_forks`` allows.

    The response's total length is :attr:`SamplingParams.max_new_tokens`."""

    max_threads: int | None = 16
    max_forks: int = 64
    async_min_cap: int = 64
    cap_factor: float = 2.0
    max_promise_tokens: int = 4096
    max_fork_depth: int = 2
    fork_threshold: float | None = None
    length_cut: str = "prefix"
    distinct_topics: bool = True
    chunk_clean_end: bool = True
    independent_topics: bool = False
    fork_headroom_tokens: int | None = None

    def __post_init__(self) -> None:
        check_int("max_threads", self.max_threads, 1, none_ok=True)
        check_int("max_forks", self.max_forks, 0)
        check_int("async_min_cap", self.async_min_cap, 1)
        # bounded so that a chunk's cap stays a finite integer (1e308 overflowed in chunk_cap
        # inside a step, failing every request in it)
        check_float("cap_factor", self.cap_factor, 0.0, MAX_CAP_FACTOR, lo_open=True)
        check_int("max_promise_tokens", self.max_promise_tokens, 0, 2**31 - 1)
        check_int("max_fork_depth", self.max_fork_depth, 1)
        if self.fork_threshold is not None:
            check_float("fork_threshold", self.fork_threshold, 0.0, 1.0, lo_open=True)
        if not isinstance(self.distinct_topics, bool):
            raise ParameterError("distinct_topics", self.distinct_topics, "True or False")
        if not isinstance(self.chunk_clean_end, bool):
            raise ParameterError("chunk_clean_end", self.chunk_clean_end, "True or False")
        if not isinstance(self.independent_topics, bool):
            raise ParameterError("independent_topics", self.independent_topics, "True or False")
        check_int("fork_headroom_tokens", self.fork_headroom_tokens, 0, 2**31 - 1, none_ok=True)
        if self.length_cut not in LENGTH_CUTS:
            raise ParameterError("length_cut", self.length_cut, " or ".join(repr(x) for x in LENGTH_CUTS))

    #: The fields that act only where the sampler enforces the PASTA-LANG grammar while a model
    #: samples in pasta or inline mode (a promise's decision, a topic's first token), each with
    #: the value that leaves it off. Where they cannot act they are refused if asked for, or
    #: dropped if they are the engine's default (``InputProcessor``, ``Engine``, the CLI).
    #: Read-only: ``name -> off``.
    GRAMMAR_KNOBS = MappingProxyType({"fork_threshold": None, "independent_topics": False,
                                      "fork_headroom_tokens": None})

    def grammar_knobs(self) -> dict[str, Any]:
        """The :attr:`GRAMMAR_KNOBS` set away from off, ``name -> value`` (empty: none)."""
        return {name: getattr(self, name) for name, off in self.GRAMMAR_KNOBS.items() if getattr(self, name) != off}

    def chunk_cap(self, predicted: int) -> int:
        """Most tokens a child forked for ``tokens="predicted"`` may sample."""
        return max(self.async_min_cap, math.ceil(self.cap_factor * min(predicted, self.max_promise_tokens)))


#: The largest :attr:`Limits.cap_factor` (a chunk may sample this many times its predicted length).
MAX_CAP_FACTOR = 1e6

PROMPT_SPECIAL_TOKENS = ("text", "control")
def limits_without_effect(mode: str, *, nesting: bool = False, replay: bool = False,
                          dialect: str = "pasta") -> dict[str, str]:
    """The :class:`Limits` fields that have no effect on a request, each with why (the one rule the
    server's ``pasta`` fields and the CLI's flags are refused by: docs/DESIGN.md section 7, a field
    not honoured is refused, never ignored). ``mode``: ``"pasta"``, ``"inline"`` or
    ``"sequential"``; ``nesting``: the dialect (named ``dialect`` in the reasons) nests forks
    (Multiverse); ``replay``: the tokens are forced (an annotated trace).

    * ``position_policy``, ``max_threads``, ``length_cut``: pasta mode only (the positions a fork
      reserves, the width of forked threads, the cut of unfinished chunks; sequential and inline
      modes decode one thread, and an inline chunk takes the positions after its promise);
    * ``max_forks``: pasta and inline modes (sequential mode acts on no promise);
    * ``max_fork_depth``: pasta mode with a nesting dialect;
    * ``distinct_topics``, ``chunk_clean_end``: where the sampler enforces the grammar (not in
      sequential mode, not in a replay).

    ``fork_threshold``, ``independent_topics`` and ``fork_headroom_tokens`` are not here: the
    input processor checks them (it also knows whether the model has the tag tokens)."""
    one_thread = f"mode {mode!r} (one thread decodes the whole response: only pasta mode forks)"
    out: dict[str, str] = {}
    if mode != "pasta":
        out["position_policy"] = (f"mode {mode!r} (only a fork in pasta mode reserves positions; an inline chunk "
                                  "takes the positions right after its promise)" if mode == "inline" else one_thread)
        out["max_threads"] = out["length_cut"] = out["max_fork_depth"] = one_thread
    elif not nesting:
        out["max_fork_depth"] = (f"the {dialect!r} dialect (it does not nest forks; only a nesting dialect, multiverse, "
                                 "has a depth)")
    if mode == "sequential":
        out["max_forks"] = "mode 'sequential' (it acts on no promise: tags are text)"
    grammar = ("mode 'sequential' (tags are text: the PASTA-LANG grammar is not enforced)" if mode == "sequential"
               else "a replay (its tokens are forced)" if replay else None)
    if grammar is not None:
        out["distinct_topics"] = out["chunk_clean_end"] = grammar
    return out


#: Values of :attr:`EngineConfig.thread_policy` (the first is the default).
THREAD_POLICIES = ("critical_first", "fcfs")

@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings (every option, one object).

    Attributes:
        attention_backend: a name registered in :mod:`pasta_engine.layers.backends`
            (``"torch"``: the reference, ``"triton"``, ``"flex"``), or a backend instance
            (checked against the registry by ``Engine.from_pretrained`` before any model loads:
            :func:`~pasta_engine.worker.model_runner.check_attention_backend`).
        kv_cache_bytes: KV cache budget in bytes (None: 512 MiB on CPU, 40% of free GPU memory
            on CUDA).
        page_size: KV page size in tokens (1 to 1024).
        max_running_requests: requests decoded together (continuous batching).
        max_num_batched_tokens: the token budget (vLLM's name): tokens forwarded in one step,
            all requests and threads together; a prompt longer than what is left of it is
            prefilled in pieces over several steps while the requests admitted before it keep
            decoding (chunked prefill). None (default): no limit, every pending token runs in
            the next step; outputs do not depend on it (greedy tokens equal). A fork or join
            writes its few tokens together even past the budget.
        thread_policy: which threads run when the token budget binds (the step's demand, all
            requests' threads together, exceeds ``max_num_batched_tokens``):
            ``"critical_first"`` (default): every running request's critical thread (its main
            thread; while the main thread waits at a sync, the child with the longest remaining
            promised length) gets a token before any extra child thread, least recently served
            request first, and the extra threads share what is left round-robin across
            requests, so a request's width shrinks as the batch fills and grows back as it
            drains, and no running request waits more than ``max_running_requests - 1`` steps
            in a row; ``"fcfs"``: requests in admission order, each taking the budget for all
            its threads before the next one is served (the policy before issue 33, kept for
            comparison). Without a budget, or when it does not bind, both run every thread.
            Outputs do not depend on it (greedy tokens equal): it changes when threads run,
            never what they sample. See :mod:`pasta_engine.core.scheduler`.
        limits: default :class:`Limits` of a request.
        position_policy: default :class:`PositionPolicy` (or its string).
        pasta_prompt: system prompt and examples put before a string prompt in pasta mode
            (:class:`~pasta_engine.lang.prompts.PastaPrompt`).
        cuda_graphs: replay captured decode steps (None: on when the model is on CUDA and the
            backend is ``triton``).
        prompt_special_tokens: how special-token text inside a user's prompt string (for
            example ``<|im_end|>``) is tokenized: ``"text"`` (default; docs/DESIGN.md section 7: user
            text is always text) or ``"control"`` (it becomes the control token, as
            ``transformers``' ``apply_chat_template(..., tokenize=True)`` does). The chat
            template's own markers are control tokens either way; annotated responses are
            always tokenized as text.
        enable_prefix_caching: automatic prefix caching (vLLM's APC): a prompt's full KV
            pages stay cached, keyed by their tokens and the prefix before them, and a later
            prompt that starts the same way (the chat template, the PASTA-LANG system prompt, a
            repeated prompt) reuses them instead of prefilling them; unused cached pages are
            evicted least recently used first when the pool needs them. Outputs do not change.
        tensor_parallel_size: ranks the model is sharded over (Megatron-style, one process per
            rank over ``torch.distributed``: gloo on CPUs, NCCL on GPUs; see
            :mod:`pasta_engine.distributed`). 1 (default): one process. Set for
            :meth:`~pasta_engine.Engine.from_pretrained`, which starts the workers; it must divide
            the model's KV heads and intermediate size. With CUDA graphs every rank captures and
            replays its own (their all-reduces inside).
        tensor_parallel_step_timeout_s: seconds a rank waits in a step's collectives for the
            others (default 120) before the engine is declared dead (``EngineDeadError``): a hung
            or stopped worker ends the engine's calls instead of blocking them.

    Raises ParameterError naming the first bad field."""

    attention_backend: Any = "torch"
    kv_cache_bytes: int | None = None
    page_size: int = 16
    max_running_requests: int = 8
    max_num_batched_tokens: int | None = None
    thread_policy: str = "critical_first"
    limits: Limits = field(default_factory=Limits)
    position_policy: PositionPolicy | str = "predicted"
    pasta_prompt: PastaPrompt = DEFAULT_PASTA_PROMPT
    cuda_graphs: bool | None = None
    prompt_special_tokens: str = "text"
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    tensor_parallel_step_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if isinstance(self.attention_backend, str) and not self.attention_backend:
            raise ParameterError("attention_backend", self.attention_backend,
                                 "a registered backend name ('torch', 'triton', 'flex', ...) or a backend")
        check_int("kv_cache_bytes", self.kv_cache_bytes, 1, none_ok=True)
        check_int("page_size", self.page_size, 1, 1024)
        check_int("max_running_requests", self.max_running_requests, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, none_ok=True)
        if not isinstance(self.thread_policy, str) or self.thread_policy not in THREAD_POLICIES:
            raise ParameterError("thread_policy", self.thread_policy, " or ".join(repr(p) for p in THREAD_POLICIES))
        if not isinstance(self.limits, Limits):
            raise ParameterError("limits", self.limits, "a pasta_engine.Limits")
        object.__setattr__(self, "position_policy", PositionPolicy.parse(self.position_policy))
        if not isinstance(self.pasta_prompt, PastaPrompt):
            raise ParameterError("pasta_prompt", self.pasta_prompt, "a pasta_engine.lang.prompts.PastaPrompt")
        if self.cuda_graphs is not None:
            check_bool("cuda_graphs", self.cuda_graphs)
        if self.prompt_special_tokens not in PROMPT_SPECIAL_TOKENS:
            raise ParameterError("prompt_special_tokens", self.prompt_special_tokens, "'text' or 'control'")
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_float("tensor_parallel_step_timeout_s", self.tensor_parallel_step_timeout_s, 0.0, 7 * 24 * 3600.0,
                    lo_open=True)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from keyword arguments; an unknown one is a ParameterError listing the known."""
        known = {f.name for f in fields(cls)}
        for k in kwargs:
            if k not in known:
                raise ParameterError(k, kwargs[k], message=f"unknown engine option {k!r}: known {sorted(known)}")
        return cls(**kwargs)
