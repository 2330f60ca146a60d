"""The request bodies of the OpenAI-compatible server, as pydantic models (vLLM's names).

Every field a request may send is declared here, with its type and bounds; ``/openapi.json``
documents these models. A field the engine does not honour is refused with HTTP 400 naming it
and its value, unless it holds the value that asks for nothing (``min_p=0``,
``repetition_penalty=1``, ``ignore_eos=false``, ...: a default value is not a request for the
feature); an unknown field is refused too. Nothing is silently ignored (``user`` is accepted:
it names the caller and changes nothing in OpenAI's API either).

Numbers are bounded before use: every integer field has an upper bound, floats must be finite
(:func:`decode_json`, the JSON reader, also refuses integers of more than :data:`MAX_INT_DIGITS` digits and
documents nested deeper than :data:`MAX_JSON_DEPTH` before these models see them).
``top_p`` below :data:`MIN_TOP_P` is taken as :data:`MIN_TOP_P`: only the most likely token is
kept, exactly as any ``top_p`` below ``1 / vocabulary size`` keeps it (a smaller value would
round to 0 in the sampler's float32 and keep nothing).

Parsing and the refusals raise :class:`~pasta_engine.errors.ParameterError` naming the field as
OpenAI spells it (``pasta.position_policy`` for the ``pasta`` extension's options).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ...config import MAX_SEED, MAX_STOP_CHARS, MAX_STOPS, PositionPolicy, SamplingParams
from ...core.replay import check_replay_sampling
from ...errors import ParameterError
from ...lang.dialect import DIALECT_NAMES
from .errors import OpenAIError

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "ChatMessage",
    "PastaOptions",
    "StreamOptions",
    "TokenizeRequest",
    "DetokenizeRequest",
    "parse_request",
    "check_supported",
    "engine_sampling_fields",
    "decode_json",
    "MAX_N",
    "MAX_TOKENS",
    "MIN_TOP_P",
    "MAX_INT_DIGITS",
    "MAX_JSON_DEPTH",
]

#: Most choices (``n``) of one request.
MAX_N = 16
#: Largest ``max_tokens`` (the model's context bounds a response further).
MAX_TOKENS = 2**31 - 1
#: ``top_p`` below this is taken as this (see the module's docstring).
MIN_TOP_P = 1e-6
#: Integers in a request body may have at most this many digits (a seed needs 20).
MAX_INT_DIGITS = 20
#: JSON objects and arrays may nest at most this deep in a request body.
MAX_JSON_DEPTH = 32

#: The description of a vLLM field the engine may not implement.
NOT_IMPLEMENTED = "refused unless {} while the engine does not implement it (see SamplingParams)"

_MODEL = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
_TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
_POLICY = re.compile(r"\s*(predicted|none|oracle|constant:\s*[0-9]{1,9})\s*", re.IGNORECASE | re.ASCII)


class TextPart(BaseModel):
    """A text part of a message's content."""

    model_config = _MODEL
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message: a role and its text."""

    model_config = _MODEL
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = Field(description="a string, or a list of {type: text, text} parts")

    @field_validator("content", mode="wrap")
    @classmethod
    def _content(cls, value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("content must be a string or a list of {\"type\": \"text\", \"text\": string} "
                             "parts") from None

    def text(self) -> str:
        """The content as one string."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    """``stream_options`` (only with ``stream=true``)."""

    model_config = _MODEL
    include_usage: bool = False


class PastaOptions(BaseModel):
    """The ``pasta`` extension of a request."""

    model_config = _MODEL
    mode: Literal["pasta", "sequential", "inline"] = Field(
        "pasta", description="pasta: act on the dialect's fork tags; sequential: one thread, tags as text; inline: acts "
        "on tags like pasta, but decodes each promise's chunk in place in the same thread (no fork): the same weights "
        "sequentially, the baseline for realized speedup of a PASTA-LANG model")
    dialect: Literal[DIALECT_NAMES] = Field(  # type: ignore[valid-type]
        "pasta", description="the decoding language the model writes: pasta (PASTA-LANG), apar (APAR) or "
        "multiverse (Multiverse); a replay's annotated_response is read in it")
    position_policy: str | None = Field(
        None, max_length=64, description="predicted | none | oracle (replay only) | constant:K (0 <= K < 10**9); pasta "
        "mode only (the positions a fork reserves)")
    max_threads: int | None = Field(None, ge=0, le=2**20, description="threads decoding together (0 = unlimited); "
                                    "pasta mode only")
    max_forks: int | None = Field(None, ge=0, le=2**20, description="forks per request (inline: chunks decoded in "
                                  "place); pasta and inline modes only")
    max_fork_depth: int | None = Field(None, ge=1, le=64, description="how deep forks nest in a dialect that nests "
                                       "them (multiverse); deeper blocks decode inline; pasta mode and a nesting "
                                       "dialect only")
    fork_threshold: float | None = Field(
        None, gt=0, le=1, description="the fork knob: the main thread opens a promise exactly where the promise "
        "token's probability is at least this (lower forks more; unset: the model decides as it samples); pasta mode, "
        "PASTA-LANG dialect and a model with the tag tokens only")
    length_cut: Literal["prefix", "keep"] | None = Field(
        None, description="when max_tokens runs out with chunks unfinished: prefix (default) ends the text where the "
        "first unfinished chunk stopped; keep gives every thread's text, holes and all; pasta mode only")
    distinct_topics: bool | None = Field(
        None, description="a promise's topic may not repeat one already promised in the response (default true; "
        "where the sampler enforces the PASTA-LANG grammar: refused in sequential mode and in a replay)")
    chunk_clean_end: bool | None = Field(
        None, description="a chunk may not end empty or at a colon, comma or semicolon, and one at its cap "
        "mid-sentence gets up to 32 more tokens to end it (default true; where the sampler enforces the PASTA-LANG "
        "grammar: refused in sequential mode and in a replay)")
    independent_topics: bool | None = Field(
        None, description="a promise's topic may not open with a word that leans on what came before (Another, "
        "Furthermore, This, Finally, ...; default false; where the sampler enforces the PASTA-LANG grammar)")
    fork_headroom_tokens: int | None = Field(
        None, ge=0, lt=2**31, description="the main thread may open a promise only while the tokens left under "
        "max_tokens cover what the running chunks were promised and have not written, plus this many (a chunk the "
        "budget cannot finish is cut, and the text after it lost); unset: off; where the sampler enforces the "
        "PASTA-LANG grammar")
    events: bool = Field(False, description="stream the thread events of each step (pasta.events)")
    annotated_response: str | None = Field(None, description=(
        "replay this annotated response (forced decoding): a sampling field or seed is refused, so is n > 1 "
        "(its choices would be the same tokens), and max_tokens below the replay's length (it cannot end early)"))

    @field_validator("position_policy")
    @classmethod
    def _policy(cls, value: str | None) -> str | None:
        if value is not None:
            if not _POLICY.fullmatch(value):
                raise ValueError("expected 'predicted', 'none', 'oracle' or 'constant:K' with 0 <= K < 10**9")
            PositionPolicy.parse(value)
        return value


class _Request(BaseModel):
    """Fields common to both completions endpoints."""

    model_config = _MODEL
    model: str | None = Field(None, description="the served model's name (or leave it out)")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description=(
        "tokens the response may hold (all threads); with pasta.annotated_response at least the replay's length"))
    max_new_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="the engine's name for max_tokens")
    n: int = Field(1, ge=1, le=MAX_N, description="choices")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 (or below 1e-5): greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0,
                                description=f"nucleus mass; below {MIN_TOP_P} taken as {MIN_TOP_P} (the top token)")
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1, description="0 or -1: all tokens")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="choice i uses seed + i (refused in a replay)")
    stop: str | list[str] | None = Field(None, description=f"at most {MAX_STOPS} non-empty strings")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256, description="the caller's name (accepted, unused)")
    pasta: PastaOptions = Field(default_factory=PastaOptions)
    # vLLM's sampling fields: honoured when SamplingParams has them (its docstring gives their
    # meaning; it validates them again, one set of rules for the Python API and the server),
    # else refused unless they ask for nothing
    min_p: float = Field(0.0, ge=0.0, le=1.0, description=(
        "keep tokens with probability >= min_p x the top token's (after temperature, top-k, top-p; 0 = off)"))
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description=(
        "subtracted from the logit of each token present in the response tokens the thread sees"))
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description=(
        "x count subtracted from each token's logit, count over the response tokens the thread sees"))
    repetition_penalty: float = Field(1.0, ge=0.01, le=100.0, description=(
        "CTRL's penalty (1 = none) on every token the thread has seen, prompt included"))
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS, description=(
        "EOS and stop_token_ids are masked until the response (all threads) has this many tokens; "
        "at most max_tokens"))
    ignore_eos: bool = Field(False, description=(
        "mask the end-of-sequence token: the response runs to max_tokens, a stop token or a stop string"))
    stop_token_ids: list[_TokenId] | None = Field(None, max_length=1024, description=(
        "token ids that end a thread as EOS does (in pasta mode a chunk's ends only that chunk); "
        "ids outside the vocabulary are refused"))
    skip_special_tokens: bool = Field(True, description=(
        "only true: a special token that is no tag (<|im_start|>, BOS, ...) leaves no text in the response, streamed "
        "or not (tags are never in the text either; the annotated text is in choices[].pasta.annotated_text)"))
    spaces_between_special_tokens: bool = Field(True, description="not supported: only true")
    include_stop_str_in_output: bool = Field(False, description=NOT_IMPLEMENTED.format("false"))
    logit_bias: dict[str, float] | None = Field(None, description=NOT_IMPLEMENTED.format("{}"))

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop(cls, value: Any, handler: Any) -> Any:
        try:
            value = handler(value)
        except ValidationError:
            value = None
        else:
            stops = [value] if isinstance(value, str) else value
            if stops is None or (len(stops) <= MAX_STOPS and all(0 < len(s) <= MAX_STOP_CHARS for s in stops)):
                return value
        raise ValueError(f"expected a non-empty string or a list of at most {MAX_STOPS} of them (each at most "
                         f"{MAX_STOP_CHARS} characters)")

    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="OpenAI's newer max_tokens")
    logprobs: bool = Field(False, description="the logprob of each sampled token")
    top_logprobs: int = Field(0, ge=0, le=20, description="not supported: only 0")
    response_format: dict[str, Any] | None = Field(None, description="only {\"type\": \"text\"}")
    tools: list[Any] | None = Field(None, description="not supported")
    functions: list[Any] | None = Field(None, description="not supported")
    tool_choice: str | dict[str, Any] | None = Field(None, description="not supported: only \"none\"")
    function_call: str | dict[str, Any] | None = Field(None, description="not supported: only \"none\"")
    parallel_tool_calls: bool | None = Field(None, description="not supported (no tools)")


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: str | list[_TokenId] | list[str] | list[list[_TokenId]] = Field(
        description="a string, a list of token ids, or a list of either")
    logprobs: int | None = Field(None, ge=0, le=20, description="only 0: the sampled tokens' logprobs")
    echo: bool = Field(False, description="not supported: only false")
    suffix: str | None = Field(None, description="not supported")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only n")

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, handler: Any) -> Any:
        try:
            value = handler(value)
        except ValidationError:
            value = None
        if isinstance(value, str) or (value and all(isinstance(p, (str, int)) or p for p in value)):
            return value
        raise ValueError("expected a string, a non-empty list of token ids (integers in [0, 2**31)), or a "
                         "non-empty list of strings or of such lists")


# (field, the value that asks for nothing, why it is refused otherwise); a field SamplingParams
# has (_honoured: min_p, the penalties, min_tokens, ignore_eos, stop_token_ids) is passed on
# instead, and its "why" is used only by an engine without it
_UNSUPPORTED: list[tuple[str, Any, str]] = [
    ("min_p", 0.0, "min-p filtering is not implemented (leave it 0)"),
    ("presence_penalty", 0.0, "penalties are not implemented (leave it 0)"),
    ("frequency_penalty", 0.0, "penalties are not implemented (leave it 0)"),
    ("repetition_penalty", 1.0, "penalties are not implemented (leave it 1)"),
    ("min_tokens", 0, "min_tokens is not implemented (leave it 0)"),
    ("ignore_eos", False, "the end-of-sequence token always ends a thread"),
    ("skip_special_tokens", True, "a response's text never carries a special token's text (a tag's is in "
     "choices[].pasta.annotated_text)"),
    ("spaces_between_special_tokens", True, "responses never carry special tokens"),
    ("include_stop_str_in_output", False, "the response ends right before its stop string"),
    ("top_logprobs", 0, "only the sampled token's logprob is returned (logprobs=true)"),
    ("echo", False, "the prompt is not echoed"),
    ("parallel_tool_calls", None, "tools are not supported"),
]
# fields refused unless absent or empty (None, "", [], {}) or one of the listed values
_UNSUPPORTED_SET: list[tuple[str, tuple[Any, ...], str]] = [
    ("stop_token_ids", (), "stop tokens are not implemented: use stop strings"),
    ("logit_bias", (), "logit_bias is not implemented"),
    ("suffix", (), "suffix is not supported"),
    ("tools", (), "tools are not supported"),
    ("functions", (), "functions are not supported"),
    ("tool_choice", ("none",), "tools are not supported"),
    ("function_call", ("none",), "functions are not supported"),
    ("response_format", ({"type": "text"},), "only response_format {\"type\": \"text\"} is supported"),
]


def _honoured() -> set[str]:
    """vLLM's sampling fields that :class:`~pasta_engine.config.SamplingParams` has under the
    same name (the engine honours them: they are passed on, not refused)."""
    return {f.name for f in dataclasses.fields(SamplingParams)}


def engine_sampling_fields(req: _Request) -> dict[str, Any]:
    """The fields of :data:`_UNSUPPORTED` the engine honours (a :class:`SamplingParams` field of
    the same name: ``min_p``, the three penalties, ``min_tokens``, ``ignore_eos``,
    ``stop_token_ids``) and the request sets to something other than their neutral value, to be
    passed to :class:`SamplingParams` (which validates them: a bad value is a ParameterError
    naming the field, a 400)."""
    honoured, fields = _honoured(), type(req).model_fields
    out = {name: getattr(req, name) for name, neutral, _ in _UNSUPPORTED
           if name in honoured and name in fields and getattr(req, name) != neutral}
    out.update({name: getattr(req, name) for name, _, _ in _UNSUPPORTED_SET
                if name in honoured and name in fields and getattr(req, name) not in (None, "", [], {})})
    return out


def check_supported(req: _Request) -> None:
    """Raise ParameterError naming the first field that asks for something the engine does not
    do (its value shown). A field :class:`SamplingParams` has under the same name is honoured,
    not refused."""
    honoured = _honoured()
    for name, neutral, why in _UNSUPPORTED:
        if name in type(req).model_fields and name not in honoured:
            value = getattr(req, name)
            if value != neutral and not (neutral is None and value is False):
                raise ParameterError(name, value, message=f"{name}={value!r} is not supported by pasta-engine: {why}")
    for name, allowed, why in _UNSUPPORTED_SET:
        if name in type(req).model_fields and name not in honoured:
            value = getattr(req, name)
            if value not in (None, "", [], {}) and value not in allowed:
                shown = repr(value)
                shown = shown if len(shown) <= 80 else shown[:77] + "..."
                raise ParameterError(name, value, message=f"{name}={shown} is not supported by pasta-engine: {why}")
    if isinstance(req, CompletionRequest):
        if req.logprobs not in (None, 0):
            raise ParameterError("logprobs", req.logprobs, message=f"logprobs={req.logprobs} is not supported by "
                                 "pasta-engine: only logprobs=0 (the sampled tokens' logprobs, no alternatives)")
        if req.best_of is not None and req.best_of != req.n:
            raise ParameterError("best_of", req.best_of, message=f"best_of={req.best_of} is not supported by "
                                 f"pasta-engine: only best_of = n ({req.n})")
    if req.stream_options is not None and not req.stream:
        raise ParameterError("stream_options", req.stream_options.model_dump(),
                             message="stream_options is only allowed with stream=true")
    if req.pasta.events and not req.stream:
        raise ParameterError("pasta.events", True, message="pasta.events streams each step's thread events: it is "
                             "only allowed with stream=true")
    if req.pasta.annotated_response is not None:
        # the rule the Python API's Engine.replay follows too; a replay's max_tokens is checked
        # against its length by the server (Server.start)
        check_replay_sampling(req, "pasta.annotated_response")


def max_tokens_of(req: _Request) -> tuple[str, int] | None:
    """``(field, value)`` of the response length the request asks for (``max_completion_tokens``,
    ``max_tokens`` or ``max_new_tokens``), None when it gives none. Raises ParameterError when
    two of them disagree."""
    given = [(name, getattr(req, name)) for name in ("max_completion_tokens", "max_tokens", "max_new_tokens")
             if getattr(req, name, None) is not None]
    for name, value in given[1:]:
        if value != given[0][1]:
            raise ParameterError(name, value, message=f"{name}={value} disagrees with {given[0][0]}={given[0][1]}: "
                                 "give one of them")
    return given[0] if given else None


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _param(loc: tuple[Any, ...]) -> str | None:
    """The OpenAI ``param`` of an error at ``loc``: the top-level field (``pasta.<option>`` for
    the ``pasta`` extension)."""
    if not loc:
        return None
    if loc[0] == "pasta" and len(loc) > 1 and isinstance(loc[1], str):
        return f"pasta.{loc[1]}"
    return str(loc[0])


def _short(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


_NICE = {
    "model_type": "expected an object",
    "dict_type": "expected an object",
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "bool_type": "expected true or false",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "finite_number": "expected a finite number",
}


class TokenizeOptions(BaseModel):
    """The ``pasta`` extension of ``/tokenize``: the chat template of which mode and dialect."""

    model_config = _MODEL
    mode: Literal["pasta", "sequential", "inline"] = Field(
        "pasta", description="pasta and inline: with the dialect's system prompt")
    dialect: Literal[DIALECT_NAMES] = Field("pasta", description="whose system prompt")  # type: ignore[valid-type]


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): the token ids the completions endpoints give a prompt: a text
    as ``/v1/completions`` tokenizes it (no template, no special tokens added), or chat
    ``messages`` through the chat template with the generation prompt, as
    ``/v1/chat/completions`` in ``pasta.mode``."""

    model_config = _MODEL
    model: str | None = Field(None, description="the served model's name (or leave it out)")
    prompt: str | None = Field(None, description="a text (give prompt or messages)")
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=4096, description="a chat")
    pasta: TokenizeOptions = Field(default_factory=TokenizeOptions)

    @model_validator(mode="after")
    def _one(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): the text of token ids."""

    model_config = _MODEL
    model: str | None = Field(None, description="the served model's name (or leave it out)")
    tokens: list[_TokenId] = Field(max_length=1 << 20, description="token ids")


#: The field a body-wide rule of a request model names (its model validator has no field path).
_BODY_RULE_PARAMS: dict[type, str] = {TokenizeRequest: "prompt"}


def parse_request(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """Validate a request body against ``model`` (then :func:`check_supported`).

    A ``null`` field (at the top or in ``pasta``) is taken as left out: its default applies.

    Raises ParameterError naming the first bad field as OpenAI spells it, with its path and
    value in the message."""
    body = {k: v for k, v in body.items() if v is not None}
    if isinstance(body.get("pasta"), dict):
        body["pasta"] = {k: v for k, v in body["pasta"].items() if v is not None}
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = tuple(err["loc"])
        path, kind = _path(loc), err["type"]
        if kind == "missing":
            message = f"{path} is required"
        elif kind == "extra_forbidden":
            owner = (model.model_fields["pasta"].annotation if loc[0] == "pasta" and len(loc) == 2
                     else model if len(loc) == 1 else None)  # the endpoint's own pasta options
            known = f": known fields are {', '.join(owner.model_fields)}" if owner is not None else ""
            message = f"unknown field {path}{known}"
        else:
            msg = err["msg"].removeprefix("Value error, ")
            # a rule over the whole body (no field path) says what it wants by itself
            message = f"invalid {path}={_short(err.get('input'))}: {_NICE.get(kind, msg)}" if loc else msg
        param = _param(loc) or _BODY_RULE_PARAMS.get(model, "body")
        raise ParameterError(param, err.get("input") if loc else None, message=message) from None
    if isinstance(req, _Request):
        check_supported(req)
    return req


# --------------------------------------------------------------------------- the JSON body


class _BigNumber:
    """A number literal of the request body too long to read (kept to name its field)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"<a number of {len(self.text)} characters>"


def _parse_int(text: str) -> int | _BigNumber:
    return int(text) if len(text.lstrip("-")) <= MAX_INT_DIGITS else _BigNumber(text)


def _parse_float(text: str) -> float | _BigNumber:
    return float(text) if len(text) <= 64 else _BigNumber(text)


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a JSON number")


def _loc_param(loc: tuple[Any, ...]) -> tuple[str, str]:
    """``(param, path)`` of a place in the request body (param as OpenAI spells it)."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    if not loc:
        return "body", "the request body"
    if loc[0] == "pasta" and len(loc) > 1 and isinstance(loc[1], str):
        return f"pasta.{loc[1]}", path
    return str(loc[0]), path


def _check_json(body: Any) -> None:
    """Raise ParameterError for what the request models cannot see or should never get: a
    number literal too long to read, nesting deeper than MAX_JSON_DEPTH, a string that is not
    text (a lone surrogate such as ``"\\udcff"``: it cannot be encoded, so neither tokenized)."""
    stack: list[tuple[Any, tuple[Any, ...], int]] = [(body, (), 0)]
    while stack:
        obj, loc, depth = stack.pop()
        if isinstance(obj, str):
            if not obj.isascii():
                try:
                    obj.encode("utf-8")
                except UnicodeEncodeError as e:
                    param, path = _loc_param(loc)
                    raise ParameterError(param, obj, message=f"invalid {path}: character {e.start} is a lone "
                                         f"surrogate ({obj[e.start]!r}), not text") from None
        elif isinstance(obj, _BigNumber):
            param, path = _loc_param(loc)
            raise ParameterError(param, obj, message=f"invalid {path}: a number of {len(obj.text)} characters "
                                 f"(integers have at most {MAX_INT_DIGITS} digits)")
        elif isinstance(obj, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                param, path = _loc_param(loc)
                raise ParameterError(param, None, message=f"the request body nests deeper than {MAX_JSON_DEPTH} "
                                     f"levels (at {path})")
            if isinstance(obj, dict):
                for k, v in obj.items():
                    stack.append((k, loc, depth + 1))
                    stack.append((v, (*loc, k), depth + 1))
            else:
                stack.extend((v, (*loc, i), depth + 1) for i, v in enumerate(obj))


def decode_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, checked by :func:`_check_json` (runs off the event
    loop). Raises OpenAIError 400 or ParameterError."""
    try:
        body = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_no_constant)
    except RecursionError:
        raise OpenAIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", param="body") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity
        raise OpenAIError(400, f"the request body is not valid JSON: {e}", param="body") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object", param="body")
    _check_json(body)
    return body
