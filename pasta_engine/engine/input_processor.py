"""One input processor (vLLM's ``InputProcessor``): how a request becomes what the engine runs (no torch).

Every API reaches the engine through here, so a prompt becomes token ids, and a request's
parameters are checked, in one place (docs/DESIGN.md section 7):

* :class:`RequestInputs`: a request as a caller gives it (prompt, params, mode, dialect, ...),
  typed; what :class:`~pasta_engine.engine.async_engine.AsyncEngine` hands to its engine thread;
* :class:`InputProcessor`: chat formatting (the model's chat template, in pasta mode with the
  dialect's system prompt and examples), tokenization (user text is always text: a string such as
  ``<|im_end|>`` is no control token), validation (mode, dialect, params, limits, position
  policy, token ids, the context length, ``n``), stop strings (``SamplingParams.stop``, or the
  async engine's ``stop`` argument: merged once) and stop token ids (the ids that end a thread:
  the model's end-of-sequence ids and ``stop_token_ids``); :meth:`InputProcessor.process` gives
  a :class:`ProcessedRequest`, the engine's whole view of a request before it holds any resource;
* :func:`choice_params`: the ``n`` completions of one prompt as ``n`` requests' params (each its
  own seed).

:class:`~pasta_engine.engine.llm_engine.Engine` owns one processor (``engine.input_processor``);
the server builds one per tokenizer copy, so prompts are tokenized on its worker threads with
the same rules. The stop rule itself runs in the engine core (the interpreter ends the request,
:mod:`~pasta_engine.core.render` cuts the text): this module only checks and passes the strings.
"""

from __future__ import annotations

import dataclasses
import numbers
import random
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ..config import MAX_SEED, EngineConfig, Limits, PositionPolicy, SamplingParams
from ..core.replay import check_replay_sampling
from ..errors import ContextLengthError, ParameterError
from ..lang.dialect import DIALECT_NAMES, BaseDialect, Dialect, as_dialect, dialect_prompt, get_dialect
from ..lang.grammar import GrammarState
from ..lang.pasta import PASTA
from ..lang.tokenization import encode_prompt, encode_text
from .streaming import OutputKind

__all__ = [
    "CHAT_ROLES",
    "MODES",
    "MESSAGE_KEYS",
    "TEXT_PART_KEYS",
    "check_mode",
    "Prompt",
    "RequestInputs",
    "ProcessedRequest",
    "InputProcessor",
    "choice_params",
    "resolve_dialect",
    "is_chat",
]

#: A prompt: a string (the chat template applied, unless ``chat_template=False``), token ids
#: (used as they are) or chat messages (``[{"role": ..., "content": ...}, ...]``).
Prompt = str | Sequence[int] | Sequence[dict]

#: Roles a chat message may have.
CHAT_ROLES = ("system", "developer", "user", "assistant")
#: Decoding modes: ``pasta`` acts on the dialect's tags (forks, joins); ``sequential`` treats them
#: as text in one thread (no dialect system prompt); ``inline`` acts on tags like pasta, but
#: decodes each promise's chunk in place in the same thread (no fork): the same weights
#: sequentially; the baseline for realized speedup of a PASTA-LANG model (it gets pasta's prompt).
MODES = ("pasta", "sequential", "inline")
#: The keys a chat message may have, and those a text part of its content may have: any other
#: (``name``, ``tool_calls``, ``tool_call_id``, ``cache_control``, ...) is refused, not dropped.
MESSAGE_KEYS = ("role", "content")
TEXT_PART_KEYS = ("type", "text")


def check_mode(mode: Any) -> str:
    """Return ``mode`` when it is one of :data:`MODES`; raise ParameterError naming ``mode``
    otherwise."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ParameterError("mode", mode, ", ".join(repr(m) for m in MODES[:-1]) + f" or {MODES[-1]!r}")
    return mode


def is_chat(prompt: Any) -> bool:
    """Whether ``prompt`` is chat messages (a non-empty list of dicts)."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def resolve_dialect(dialect: str | Dialect | None) -> BaseDialect:
    """The request's dialect: PASTA-LANG for None, a registered name
    (:func:`~pasta_engine.lang.dialect.get_dialect`), or a Dialect object (as the engine reads
    it: :func:`~pasta_engine.lang.dialect.as_dialect`). Raises ParameterError naming
    ``dialect``, its value and the choices."""
    if dialect is None:
        return PASTA
    if isinstance(dialect, str):
        try:
            return get_dialect(dialect)
        except ValueError:
            raise ParameterError("dialect", dialect, " | ".join(DIALECT_NAMES)) from None
    if isinstance(dialect, Dialect):
        return as_dialect(dialect)
    raise ParameterError("dialect", dialect, "a dialect name (" + " | ".join(DIALECT_NAMES) + ") or a Dialect")


@dataclass(frozen=True)
class RequestInputs:
    """One request as a caller gives it (the arguments of ``Engine.add_request``), checked for
    its types when built (``output_kind``, ``chat_template``, ``request_id``), so a caller on
    another thread hears of a bad one at once; everything else is checked by
    :meth:`InputProcessor.process`.

    Attributes:
        prompt: see :data:`Prompt`.
        params: the sampling parameters (None: the defaults; a replay's ``max_new_tokens`` is
            raised to its response's length).
        mode: one of :data:`MODES`: ``pasta``, ``sequential`` or ``inline``.
        request_id: a unique non-empty string, or None for a fresh number.
        annotated_response: make it a replay forcing this response (string and chat prompts
            then get the dialect's system prompt in every mode).
        limits, position_policy: override the engine's defaults.
        dialect: a name of :data:`~pasta_engine.lang.dialect.DIALECT_NAMES`, a Dialect, or None
            (PASTA-LANG).
        chat_template: False: a string prompt is tokenized as plain text (a text completion).
        output_kind: what the step API outputs for it (:class:`OutputKind`).
        index: its place in a list of prompts (named in errors), None for a lone request.

    Raises ParameterError naming ``output_kind``, ``chat_template`` or ``request_id``."""

    prompt: Any
    params: SamplingParams | None = None
    mode: str = "pasta"
    request_id: str | None = None
    annotated_response: str | None = None
    limits: Limits | None = None
    position_policy: str | PositionPolicy | None = None
    dialect: str | Dialect | None = None
    chat_template: bool = True
    output_kind: OutputKind = OutputKind.CUMULATIVE
    index: int | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "output_kind", OutputKind.parse(self.output_kind))
        except ValueError as e:
            raise ParameterError("output_kind", self.output_kind, message=str(e)) from None
        if not isinstance(self.chat_template, bool):
            raise ParameterError("chat_template", self.chat_template, "True or False")
        if self.request_id is not None and (not isinstance(self.request_id, str) or not self.request_id):
            raise ParameterError("request_id", self.request_id, "a non-empty string")


@dataclass(frozen=True)
class ProcessedRequest:
    """A request the engine can build (vLLM's ``EngineCoreRequest``): everything checked, no
    resource held yet.

    Attributes:
        prompt_ids: the formatted prompt's token ids (shorter than the context).
        params: its sampling parameters, ``seed`` set (a fresh one when the caller gave None),
            ``n`` 1, ``stop`` holding every stop string.
        mode, dialect, annotated_response, request_id, output_kind, index: as given (the dialect
            resolved to its object).
        limits, policy: the engine's defaults where the caller gave none (a default
            ``fork_threshold`` dropped where it cannot apply).
        end_ids: the ids that end a thread: the model's end-of-sequence ids, then
            ``stop_token_ids`` (none of them in a replay, whose forced tokens are the response)."""

    prompt_ids: list[int]
    params: SamplingParams
    mode: str
    dialect: Dialect
    annotated_response: str | None
    limits: Limits
    policy: PositionPolicy
    end_ids: tuple[int, ...]
    request_id: str | None
    output_kind: OutputKind
    index: int | None


def choice_params(params: SamplingParams, draw: random.Random | None = None) -> list[SamplingParams]:
    """The params of the ``params.n`` completions of one prompt, each with ``n=1`` (vLLM's ``n``).

    Args:
        params: the prompt's parameters.
        draw: where a seed comes from when ``params.seed`` is None (the server's seeded
            generator); None leaves each completion's seed None, so the engine draws a fresh one
            for each.

    Returns ``n`` params: with a seed ``s``, completion ``i`` has seed ``(s + i) mod 2**64``
    (so the samples differ and the whole set is reproducible); without one, each its own."""
    if params.n == 1:
        return [params]
    seed = params.seed
    if seed is None and draw is not None:
        seed = draw.randrange(MAX_SEED + 1)
    return [dataclasses.replace(params, n=1, seed=None if seed is None else (seed + i) % (MAX_SEED + 1))
            for i in range(params.n)]


class InputProcessor:
    """Prompts to token ids and requests to :class:`ProcessedRequest`, with every check.

    Args:
        tokenizer: the model's ``transformers`` tokenizer (the server gives each worker thread
            its own copy).
        config: the engine's :class:`~pasta_engine.config.EngineConfig` (``pasta_prompt``,
            ``prompt_special_tokens``, ``limits``, ``position_policy``).
        vocab_size: rows of the model's vocabulary (token ids must be below it).
        max_positions: the model's context length (None: no limit).
        eos_ids: the model's end-of-sequence ids.
        grammar: whether the tokenizer has the PASTA-LANG pieces as tokens (``fork_threshold``
            needs them).
        bytes_per_token: :attr:`bytes_per_token` when the caller knows it already (another
            processor's over the same vocabulary); None: read from the vocabulary on first use.

    Methods raise ParameterError naming the parameter and value (ContextLengthError, a
    ParameterError, for a prompt that leaves no room under the context)."""

    def __init__(self, tokenizer: Any, config: EngineConfig, *, vocab_size: int, max_positions: int | None,
                 eos_ids: Sequence[int] = (), grammar: bool = False, bytes_per_token: int | None = None):
        self.tokenizer = tokenizer
        self.config = config
        self.vocab_size = int(vocab_size)
        self.max_positions = max_positions
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.grammar = grammar
        self._seeds = random.SystemRandom()  # seeds of requests whose params give none
        self._bytes_per_token = bytes_per_token

    @property
    def bytes_per_token(self) -> int:
        """An upper bound on the UTF-8 bytes one token of the vocabulary stands for (twice the
        longest token's spelling: byte-level BPE and SentencePiece never spell a byte with less
        than a character), read from the vocabulary once. A text of ``bytes_per_token *
        context`` bytes or more cannot fit the context however it tokenizes."""
        if self._bytes_per_token is None:
            vocab = self.tokenizer.get_vocab() if callable(getattr(self.tokenizer, "get_vocab", None)) else {}
            self._bytes_per_token = 2 * max((len(t.encode("utf-8", "replace")) for t in vocab), default=64)
        return self._bytes_per_token

    # ------------------------------------------------------------------ prompts

    def tokenize(self, prompt: Prompt, mode: str = "pasta", dialect: str | Dialect | None = None, *,
                 chat_template: bool = True, index: int | None = None) -> list[int]:
        """Token ids for ``prompt``, checked against the vocabulary and the context length.

        Args:
            prompt: a string (through the chat template, in pasta and inline modes with the dialect's system
                prompt and examples: ``config.pasta_prompt`` for PASTA-LANG, the dialect's own
                otherwise, :func:`~pasta_engine.lang.dialect.dialect_prompt`; its text tokenized as
                ``config.prompt_special_tokens`` says; with ``chat_template=False`` tokenized as
                plain text), chat messages (:meth:`format_chat`) or token ids (used as they are).
            mode: ``pasta``, ``sequential`` or ``inline`` (sequential: no system prompt of a
                dialect; inline gets pasta's).
            dialect: the request's dialect (None: PASTA-LANG).
            chat_template: False for a text completion (a string prompt as plain text).
            index: the prompt's place in a list of prompts, named in errors.

        Raises ParameterError naming ``mode`` (not one of :data:`MODES`), ``prompt`` (None,
        bytes, an empty prompt, non-integer or out-of-vocabulary ids, a lone surrogate),
        ``messages`` or ``dialect``; ContextLengthError for a prompt with no room under the
        context length."""
        check_mode(mode)
        where = f"prompt {index}" if index is not None else "the prompt"
        named = f"prompt {index}" if index is not None else "prompt"  # the engine's earlier wording
        if isinstance(prompt, str):
            _check_text(prompt, "prompt", named)
            self._check_text_fits(len(prompt.encode("utf-8")), where)
            if not chat_template:
                ids = encode_text(self.tokenizer, prompt)
                if not ids:
                    raise ParameterError("prompt", prompt, message=f"{where} is empty")
            elif mode != "sequential":  # pasta and inline: the dialect's prompt
                msgs = dialect_prompt(resolve_dialect(dialect), self.config.pasta_prompt).messages(prompt)
                ids = encode_prompt(self.tokenizer, msgs, self.config.prompt_special_tokens)
            else:
                ids = encode_prompt(self.tokenizer, [{"role": "user", "content": prompt}],
                                    self.config.prompt_special_tokens)
        elif is_chat(prompt):
            ids = self.format_chat(prompt, mode, dialect)
        else:
            ids = self._check_ids(prompt, named)
        self.check_length(len(ids), where)
        return ids

    def format_chat(self, messages: Sequence[dict[str, Any]], mode: str = "pasta",
                    dialect: str | Dialect | None = None) -> list[int]:
        """Prompt token ids for chat messages, through the model's chat template.

        Args:
            messages: ``[{"role": "system" | "developer" | "user" | "assistant", "content": str
                or a list of {"type": "text", "text": str} parts}, ...]``, ending with a user
                message. A message has no other key and a part no other key
                (:data:`MESSAGE_KEYS`, :data:`TEXT_PART_KEYS`): ``name``, ``tool_calls``,
                ``cache_control`` and the like are refused, since the prompt would not honour them.
            mode: in ``pasta`` and ``inline`` modes the dialect's system prompt (its
                instructions, then the messages' own system text) and its example exchanges
                come first.
            dialect: the request's dialect (a name or a Dialect; None: PASTA-LANG, whose prompt
                is ``config.pasta_prompt``; any other brings its own).

        Raises ParameterError naming ``mode`` (not one of :data:`MODES`), ``messages`` (with the
        index of the bad one and, for a key it does not take, the key), or ``dialect`` for an
        unknown one; ContextLengthError for text that cannot fit."""
        check_mode(mode)
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ParameterError("messages", messages, "a non-empty list of {role, content} objects")
        system: list[str] = []
        turns: list[dict[str, str]] = []
        for i, m in enumerate(messages):
            role = m.get("role") if isinstance(m, dict) else None
            if role not in CHAT_ROLES:
                raise ParameterError("messages", messages, message=f"messages[{i}]: role {role!r} is not supported: "
                                     f"expected one of {', '.join(CHAT_ROLES)}")
            extra = next((k for k in m if k not in MESSAGE_KEYS), None)
            if extra is not None:
                raise ParameterError("messages", messages, message=(
                    f"messages[{i}]: key {extra!r} is not supported: a message has only 'role' and 'content' "
                    f"(remove {extra!r}; the engine does not honour it)"))
            content = m.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise ParameterError("messages", messages, message=f"messages[{i}]: only text content parts "
                                         f"({{\"type\": \"text\", \"text\": ...}}) are supported")
                for j, part in enumerate(content):
                    extra = next((k for k in part if k not in TEXT_PART_KEYS), None)
                    if extra is not None:
                        raise ParameterError("messages", messages, message=(
                            f"messages[{i}]: content part {j}: key {extra!r} is not supported: a text part has only "
                            f"'type' and 'text' (remove {extra!r}; the engine does not honour it)"))
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise ParameterError("messages", messages, message=f"messages[{i}]: content must be a string or a "
                                     f"list of text parts, got {type(content).__name__}")
            _check_text(content, "messages", f"messages[{i}]")
            if role in ("system", "developer"):
                system.append(content)
            else:
                turns.append({"role": role, "content": content})
        if not turns or turns[-1]["role"] != "user":
            raise ParameterError("messages", messages, message="the last message must be the user's (role 'user')")
        self._check_text_fits(sum(len(t["content"].encode("utf-8")) for t in turns)
                              + sum(len(s.encode("utf-8")) for s in system), "the messages")
        head: list[dict[str, str]] = []
        if mode != "sequential":  # pasta and inline
            pp = dialect_prompt(resolve_dialect(dialect), self.config.pasta_prompt)
            system = [pp.system, *system] if pp.system else system
            for q, a in pp.examples:
                head += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if system:
            head.insert(0, {"role": "system", "content": "\n\n".join(system)})
        return encode_prompt(self.tokenizer, head + turns, self.config.prompt_special_tokens)

    def check_length(self, n: int, where: str = "the prompt") -> None:
        """Raise ContextLengthError when a prompt of ``n`` tokens leaves no room under the
        model's context length (at least one token must be sampled)."""
        if self.max_positions is not None and n >= self.max_positions:
            raise ContextLengthError("prompt", n, message=(
                f"{where} has {n} tokens, which leaves no room under the model's context length of "
                f"{self.max_positions} tokens"))

    def _check_text_fits(self, nbytes: int, where: str) -> None:
        """Refuse, before tokenizing it, text too long to fit however it tokenizes: no token of
        the vocabulary spells more than ``bytes_per_token`` bytes (a 1 MB prompt is refused at
        once, not after seconds of tokenizing)."""
        if self.max_positions is None or nbytes < self.max_positions:  # fits at one byte per token or more
            return
        if nbytes >= self.bytes_per_token * self.max_positions:
            raise ContextLengthError("prompt", nbytes, message=(
                f"{where} has at least {nbytes // self.bytes_per_token} tokens ({nbytes} bytes of text), which "
                f"leaves no room under the model's context length of {self.max_positions} tokens"))

    def _check_ids(self, prompt: Any, where: str) -> list[int]:
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
            raise ParameterError("prompt", prompt, message=f"{where} must be a string or a list of token ids, got "
                                 f"{type(prompt).__name__} (chat messages: a list of {{role, content}} dicts)")
        if not prompt:
            raise ParameterError("prompt", prompt, message=f"{where} is an empty list of token ids")
        return self.check_token_ids(prompt, "prompt", where)

    def check_token_ids(self, ids: Any, param: str = "token_ids", where: str | None = None) -> list[int]:
        """``ids`` (a sequence of integer token ids: ints or numpy integers, not bools) as a list
        of ``int``, each in ``[0, vocab_size)``. Raises ParameterError naming ``param`` for a value
        that is not such a sequence, an id that is not an integer, or one outside the vocabulary
        (``where`` names it in the message; default ``param``)."""
        where = where or param
        if isinstance(ids, (str, bytes, bytearray, dict)) or not isinstance(ids, Iterable):
            raise ParameterError(param, ids, f"a list of integer token ids from 0 to {self.vocab_size - 1}")
        out = []
        for j, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise ParameterError(param, ids, message=f"{where}: token {j} is {t!r} ({type(t).__name__}), "
                                     f"not an integer token id")
            if not 0 <= t < self.vocab_size:
                raise ParameterError(param, ids, message=f"{where}: token id {t} (position {j}) is outside the "
                                     f"model's vocabulary of {self.vocab_size}")
            out.append(int(t))
        return out

    # ------------------------------------------------------------------ requests

    @staticmethod
    def merge_stop(params: SamplingParams | None, stop: Sequence[str] | str | None) -> SamplingParams | None:
        """``params`` with the stop strings of a separate ``stop`` argument (the async engine's)
        in ``params.stop``: the one place a request's stop strings are gathered.

        Raises ParameterError naming ``params`` when it is neither None nor a SamplingParams,
        ``stop`` for a bad list, or when both give strings."""
        if params is not None and not isinstance(params, SamplingParams):
            raise ParameterError("params", params, "a pasta_engine.SamplingParams")
        if stop is None:
            return params
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
            raise ParameterError("stop", stop, "a non-empty string or a list of non-empty strings")
        if not stops:
            return params
        if params is not None and params.stop:
            raise ParameterError("stop", stop, message="stop strings are given twice (the stop argument and "
                                 "SamplingParams.stop): give them once")
        return dataclasses.replace(params if params is not None else SamplingParams(), stop=tuple(stops))

    def process(self, inputs: RequestInputs, *, allow_n: bool = False) -> ProcessedRequest:
        """Check one request and tokenize its prompt (it holds no resource yet).

        Args:
            inputs: the request.
            allow_n: accept ``params.n > 1`` (the caller expands the choices itself); otherwise
                it is refused, naming ``n``.

        Raises ParameterError naming the first bad parameter (``mode``, ``dialect``,
        ``params``, a sampling field a replay cannot honour
        (:func:`~pasta_engine.core.replay.check_replay_sampling`), ``n``, ``limits``, ``fork_threshold``, ``position_policy``,
        ``annotated_response``, ``prompt``, ``messages``, ``stop_token_ids``), and
        ContextLengthError for a prompt with no room under the context length."""
        mode = check_mode(inputs.mode)
        lang = resolve_dialect(inputs.dialect)
        if mode == "inline" and (lang.nesting or lang.fork_joins):
            raise ParameterError("mode", mode, message=(
                f"mode 'inline' decodes one chunk per fork in place, and the {lang.name!r} dialect nests or joins at "
                "its forks: use 'pasta' or 'sequential'"))
        replay = inputs.annotated_response is not None
        params = inputs.params
        if params is None:
            params = SamplingParams(max_new_tokens=1) if replay else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ParameterError("params", params, "a pasta_engine.SamplingParams")
        if replay:  # what a replay cannot honour is refused, never ignored (before the fresh seed below)
            check_replay_sampling(params, "annotated_response")
        if params.n != 1 and not allow_n:
            raise ParameterError("n", params.n, message=(
                f"n={params.n}: a request of the step API or of AsyncEngine is one completion; add n requests "
                "(pasta_engine.engine.input_processor.choice_params gives their params, each its own seed) or use "
                "Engine.generate, which returns the n completions in RequestResult.outputs"))
        if params.seed is None:  # vLLM's default: each request its own fresh seed
            params = dataclasses.replace(params, seed=self._seeds.randrange(MAX_SEED + 1))
        limits = self._limits(inputs.limits, mode, lang, replay)
        try:
            policy = (PositionPolicy.parse(inputs.position_policy) if inputs.position_policy is not None
                      else self.config.position_policy)
        except ValueError as e:
            raise ParameterError("position_policy", inputs.position_policy, message=str(e)) from None
        if replay:
            if not isinstance(inputs.annotated_response, str):
                raise ParameterError("annotated_response", inputs.annotated_response, "a string")
            _check_text(inputs.annotated_response, "annotated_response", "the annotated response")
        # a replay's prompt is pasta's in both modes: both modes then see the same prompt
        prompt_ids = self.tokenize(inputs.prompt, "pasta" if replay else mode, lang,
                                   chat_template=inputs.chat_template, index=inputs.index)
        bad_stop = [i for i in params.stop_token_ids if i >= self.vocab_size]
        if bad_stop:
            raise ParameterError("stop_token_ids", bad_stop[0], message=(
                f"stop_token_ids holds {bad_stop[0]}, outside the model's vocabulary of {self.vocab_size} tokens"))
        end_ids = list(self.eos_ids)
        if not replay:  # a stop token ends a thread as EOS does; a replay's forced tokens are the response
            end_ids += [i for i in dict.fromkeys(params.stop_token_ids) if i not in self.eos_ids]
        return ProcessedRequest(prompt_ids=prompt_ids, params=params, mode=mode, dialect=lang,
                                annotated_response=inputs.annotated_response, limits=limits, policy=policy,
                                end_ids=tuple(end_ids), request_id=inputs.request_id,
                                output_kind=inputs.output_kind, index=inputs.index)

    def _limits(self, limits: Limits | None, mode: str, lang: Dialect, replay: bool) -> Limits:
        """The request's limits: its own or the engine's, the grammar knobs
        (``Limits.GRAMMAR_KNOBS``: ``fork_threshold``, ``independent_topics``,
        ``fork_headroom_tokens``) checked where they
        apply: one the request asks for that cannot apply is refused (ParameterError naming
        it); the engine's default is dropped there."""
        if limits is not None and not isinstance(limits, Limits):
            raise ParameterError("limits", limits, "a pasta_engine.Limits")
        default = self.config.limits
        knobs = (limits or default).grammar_knobs()
        if not knobs:
            return limits or default
        # all act on the PASTA-LANG grammar's states (the knob where the main thread may open a
        # promise, the topic rule at a topic's first token): a dialect whose grammar never starts
        # the main thread there has none of them
        promises = lang.grammar_state(True, "", True) == GrammarState.MAIN
        why = ("a replay (its tokens are forced)" if replay
               else f"mode {mode!r} (tags are acted on in pasta and inline modes)" if mode == "sequential"
               else f"the {lang.name!r} dialect (it decides PASTA-LANG promises)" if not promises
               else "a model without the PASTA-LANG pieces as tokens (train the adapter with --tag-tokens)"
               if not self.grammar else None)
        if why is None:
            return limits or default
        off = Limits.GRAMMAR_KNOBS
        for name, value in knobs.items():
            if limits is not None and value != getattr(default, name):  # the request asked for it
                raise ParameterError(name, value, message=f"{name}={value} cannot apply to {why}; leave it {off[name]}")
        return dataclasses.replace(limits or default, **off)  # the engine's defaults: only where they apply


def _check_text(text: str, param: str, where: str) -> None:
    """Raise ParameterError when ``text`` is not valid Unicode (a lone surrogate, e.g. a byte that
    was not UTF-8 in a command line): no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ParameterError(param, text, message=f"{where} is not valid text: {text[e.start]!r} at character "
                             f"{e.start} is a lone surrogate (bytes that were not UTF-8?)") from None
