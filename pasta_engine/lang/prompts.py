"""Prompts: the PASTA-LANG system prompt that teaches an un-finetuned instruct model the tags,
and the project's sample prompt. (The other dialects' prompts live with their dialects:
``pasta_engine.lang.apar.APAR_PROMPT``, ``pasta_engine.lang.multiverse.MULTIVERSE_PROMPT``.)"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ParameterError

__all__ = ["PastaPrompt", "NO_PROMPT", "DEFAULT_PASTA_PROMPT", "LEARNED_PASTA_PROMPT", "LEARNED_SYSTEM", "SAMPLE_PROMPT"]

SAMPLE_PROMPT = "What are different drawers I should have for clothes?"

_SYSTEM = (
    "You are a helpful assistant. You write answers in PASTA-LANG. When a list has independent "
    "items, write a promise tag for each item instead of the item itself, like "
    '<promise topic="short topic" tokens="30"/>, where tokens is the item\'s length in tokens '
    "(10, 20, 30, 40 or 50). Each promised item is then written in parallel after <async> and ends "
    "with </async>, for example: <async>Go to bed at the same time every day.</async> Write <sync/> "
    "after the last promise, then finish the answer."
)

_EXAMPLE = (
    "Give me three tips for better sleep.",
    "Here are three tips for better sleep:\n"
    '1. <promise topic="regular schedule" tokens="40"/>\n'
    '2. <promise topic="avoid screens" tokens="20"/>\n'
    '3. <promise topic="quiet dark room" tokens="30"/>\n'
    "<sync/>\n"
    "These habits will help you sleep better.",
)


@dataclass(frozen=True)
class PastaPrompt:
    """A system prompt plus example exchanges (user, assistant) placed before the user's
    message in pasta mode. An example turn teaches a small model the format far better than
    instructions alone: SmolLM2-135M-Instruct writes well-formed promise tags with it (and,
    like the paper's un-finetuned baselines, often forgets ``<sync/>``; end of sequence syncs)."""

    system: str = _SYSTEM
    examples: tuple[tuple[str, str], ...] = field(default_factory=lambda: (_EXAMPLE,))

    @classmethod
    def from_dict(cls, d: dict) -> "PastaPrompt":
        """From ``{"system": str, "examples": [[user, assistant], ...]}`` (an adapter manifest's;
        either key may be left out: no system prompt, no examples). Raises ParameterError naming
        ``pasta_prompt`` and what is wrong for anything else: not an object, another key, a
        system prompt that is not a string, an example that is not a [user, assistant] pair of
        strings (each request in pasta mode would fail on it)."""

        def refuse(why: str) -> ParameterError:
            return ParameterError("pasta_prompt", d, message=f"pasta_prompt {why}: expected {{\"system\": str, "
                                  f"\"examples\": [[user, assistant], ...]}}")

        if not isinstance(d, dict):
            raise refuse(f"is a {type(d).__name__} ({d!r:.80}), not an object")
        other = sorted(set(d) - {"system", "examples"}, key=str)
        if other:
            raise refuse(f"has the key {other[0]!r}, which is not honoured")
        system, examples = d.get("system", ""), d.get("examples", [])
        if not isinstance(system, str):
            raise refuse(f"system is {system!r:.80}, not a string")
        if not isinstance(examples, (list, tuple)):
            raise refuse(f"examples is {examples!r:.80}, not a list")
        for i, x in enumerate(examples):
            if not isinstance(x, (list, tuple)) or len(x) != 2 or not all(isinstance(t, str) for t in x):
                raise refuse(f"examples[{i}] is {x!r:.80}, not a [user, assistant] pair of strings")
        return cls(system=system, examples=tuple(tuple(x) for x in examples))

    def to_dict(self) -> dict:
        """The inverse of :meth:`from_dict`."""
        return {"system": self.system, "examples": [list(x) for x in self.examples]}

    def messages(self, user: str) -> list[dict[str, str]]:
        """Chat messages for ``user``'s request."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for q, a in self.examples:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        msgs.append({"role": "user", "content": user})
        return msgs


DEFAULT_PASTA_PROMPT = PastaPrompt()

#: No system prompt and no example: the user's message alone (a dialect without a prompt of its
#: own, :func:`~pasta_engine.lang.dialect.dialect_prompt`).
NO_PROMPT = PastaPrompt(system="", examples=())

#: The one short system line a model finetuned on PASTA-LANG is trained and run with (no
#: examples): the long prompt above costs ~230 prompt tokens per request, which made pasta mode
#: slower than sequential decoding for an un-finetuned model.
LEARNED_SYSTEM = "Write independent parts of your answer as PASTA-LANG promises."
LEARNED_PASTA_PROMPT = PastaPrompt(system=LEARNED_SYSTEM, examples=())
