"""Speedup metrics, defined once (DESIGN.md section 3; Jin et al., ICML 2025, section 5).

Units: a *step* is one forward pass that samples tokens for a request. The prompt's prefill
pass counts as the first step because it samples the first response token, so a sequential
response of T sampled tokens (EOS included) takes T steps and has critical path T.

* critical path: steps the response needs with unlimited parallel width, from its structure:
  the main thread samples one token per step; a child forked at the main token sampled at
  step ``s`` samples its ``L`` tokens at steps ``s+1 .. s+L``; after a sync completed at step
  ``s`` the main thread's next token comes at ``max(s, ends of outstanding children) + 1``;
  the response ends when the main thread and every child have ended.
* theoretical speedup = steps of sequential decoding of the same content / critical path,
  where the same content is every token of the spliced response (the ``<async>`` tokens the
  interpreter inserts included: one thread would have to decode them);
  the paper's variant divides a sequential baseline response's token count instead
  (:func:`theoretical_speedup_vs_baseline`).
* theoretical parallelism = tokens sampled by all threads / critical path: the mean number of
  threads sampling per step.
* realized speedup = wall time of sequential decoding / wall time of PASTA decoding;
  aggregated over prompts by geometric mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

__all__ = [
    "ResponseStructure",
    "critical_path",
    "simulate_steps",
    "theoretical_speedup",
    "theoretical_speedup_vs_baseline",
    "theoretical_parallelism",
    "realized_speedup",
    "realized_over_theoretical",
    "step_speedup",
    "geomean",
]


@dataclass
class ResponseStructure:
    """Token counts of one response, as the interpreter decoded it.

    Attributes:
        main_tokens: tokens the main thread sampled (EOS included).
        forks: ``(k, L)`` per child in fork order: forked after the main thread's k-th sampled
            token (1-based), sampled L tokens (content, closing tag or EOS).
        syncs: main-thread token indices (1-based) that completed a ``<sync/>``.
        inserted: tokens the interpreter inserted (the ``<async>`` tags of all children).
    """

    main_tokens: int
    forks: list[tuple[int, int]] = field(default_factory=list)
    syncs: list[int] = field(default_factory=list)
    inserted: int = 0

    @property
    def tokens(self) -> int:
        """Tokens sampled by all threads."""
        return self.main_tokens + sum(n for _, n in self.forks)

    @property
    def content_tokens(self) -> int:
        """Tokens of the spliced response (sampled plus inserted): the steps sequential
        decoding of the same content takes."""
        return self.tokens + self.inserted


def critical_path(s: ResponseStructure) -> int:
    """Steps with unlimited width (see the module docstring): :func:`simulate_steps` with no
    width limit. Raises ValueError for a fork or sync index outside ``1..main_tokens``."""
    return simulate_steps(s, None)


def simulate_steps(s: ResponseStructure, max_threads: int | None = None) -> int:
    """Steps a response takes at a width of ``max_threads`` sampling threads (None =
    unlimited), under the interpreter's policy: the main thread first, then children in fork
    order. The one simulation of the interpreter's timing: at unlimited width it is the
    critical path, at width 1 it is ``s.tokens``.

    A step samples one token for each runnable thread: the main thread unless it is stalled at
    a sync, and each child with tokens left. A child forked at the main thread's k-th token
    starts in the next step; a sync completed at the main thread's k-th token stalls it until
    every child forked so far has sampled all its tokens.

    Raises ValueError for a fork or sync index outside ``1..main_tokens`` or a width < 1."""
    for k, n in s.forks:
        if not 1 <= k <= s.main_tokens or n < 0:
            raise ValueError(f"fork ({k}, {n}) outside a main thread of {s.main_tokens} tokens")
    for k in s.syncs:
        if not 1 <= k <= s.main_tokens:
            raise ValueError(f"sync at {k} outside a main thread of {s.main_tokens} tokens")
    if max_threads is not None and max_threads < 1:
        raise ValueError(f"max_threads must be >= 1, got {max_threads}")
    fork_at: dict[int, list[int]] = {}
    for k, n in s.forks:
        fork_at.setdefault(k, []).append(n)
    syncs = set(s.syncs)
    main_done = 0  # main tokens sampled
    stalled = False
    children: list[list[int]] = []  # [remaining tokens] in fork order
    outstanding: list[list[int]] = []
    steps = 0
    while main_done < s.main_tokens or any(c[0] > 0 for c in children):
        if stalled and all(c[0] == 0 for c in outstanding):
            stalled, outstanding = False, []
        runnable: list[list[int] | None] = []
        if main_done < s.main_tokens and not stalled:
            runnable.append(None)
        runnable += [c for c in children if c[0] > 0]
        if max_threads is not None:
            runnable = runnable[:max_threads]
        steps += 1
        for r in runnable:
            if r is None:
                main_done += 1
                for n in fork_at.get(main_done, []):
                    c = [n]
                    children.append(c)
                    outstanding.append(c)
                if main_done in syncs:
                    stalled = True
            else:
                r[0] -= 1
    return steps


def theoretical_speedup(s: ResponseStructure, critical: int | None = None) -> float:
    """Steps of sequential decoding of the same content / critical path (one thread vs many).
    ``critical``: the critical path when already computed."""
    return s.content_tokens / (critical or critical_path(s))


def theoretical_speedup_vs_baseline(s: ResponseStructure, baseline_tokens: int) -> float:
    """The paper's variant: a sequential baseline response's length / critical path."""
    return baseline_tokens / critical_path(s)


def theoretical_parallelism(s: ResponseStructure, critical: int | None = None) -> float:
    """Tokens sampled by all threads / critical path: mean sampling threads per step.
    ``critical``: the critical path when already computed."""
    return s.tokens / (critical or critical_path(s))


def realized_speedup(sequential_wall_s: float, pasta_wall_s: float) -> float:
    """Wall time of sequential decoding / wall time of PASTA decoding (seconds / seconds).

    Raises ValueError for a non-positive time."""
    if sequential_wall_s <= 0 or pasta_wall_s <= 0:
        raise ValueError(f"wall times must be positive, got {sequential_wall_s} and {pasta_wall_s}")
    return sequential_wall_s / pasta_wall_s


def step_speedup(sequential_steps: int, pasta_steps: int) -> float:
    """Decode steps of sequential decoding / decode steps of PASTA decoding (equals the
    theoretical speedup when the same content is decoded at unlimited width). Raises ValueError
    for a non-positive step count."""
    if sequential_steps <= 0 or pasta_steps <= 0:
        raise ValueError(f"step counts must be positive, got {sequential_steps} and {pasta_steps}")
    return sequential_steps / pasta_steps


def realized_over_theoretical(realized: float, theoretical: float) -> float:
    """How much of the available speedup the engine turns into time (DESIGN.md section 3):
    realized speedup / theoretical speedup; 1 is the ideal."""
    return realized / theoretical


def geomean(values: Iterable[float]) -> float:
    """Geometric mean (the paper's aggregate over prompts). Raises ValueError on an empty
    input or a non-positive value."""
    vals = list(values)
    if not vals:
        raise ValueError("geometric mean of no values")
    if any(v <= 0 for v in vals):
        raise ValueError("geometric mean needs positive values")
    return math.exp(sum(math.log(v) for v in vals) / len(vals))
