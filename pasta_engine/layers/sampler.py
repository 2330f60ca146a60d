"""The sampler: penalties, greedy, temperature, top-k, top-p, min-p (parameters in
:mod:`pasta_engine.config`).

:func:`sample` picks the tokens of one request's rows; :func:`sample_batch` does the same for
every row of a step in one call (per-row parameters as tensors, each request's random numbers
drawn from its own generator by :func:`draw_noise`) and picks the same tokens.
:class:`SamplingBatch` is one step's sampling, packed once from the scheduler's per-thread
sampling rows (SGLang's ``SamplingBatchInfo.from_schedule_batch``): what the model runner's
``sample`` applies to the logits and samples from."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import groupby
from typing import Mapping, Protocol, Sequence

import numpy as np
import torch

from ..config import SamplingParams
from .utils import to_device

__all__ = ["sample", "sample_batch", "draw_noise", "request_generator", "logprobs_of", "apply_repetition_penalty",
           "apply_output_penalties", "mask_tokens", "apply_fork_threshold", "MIN_TOP_P", "SamplingBatch",
           "SamplingRowLike"]

#: A smaller top_p is taken as this one (keeps the most likely token, as any tiny top_p does): a
#: top_p such as 1e-300 rounds to 0 in float32, and a zero top_p dropped every token (nan).
MIN_TOP_P = 1e-6


def apply_repetition_penalty(logits: torch.Tensor, rows: list[int], seen: Sequence[Sequence[int] | Mapping[int, int]],
                             penalties: list[float]) -> torch.Tensor:
    """The logits with the repetition penalty applied (a new tensor): for each ``rows[i]``, the
    logit of every id in ``seen[i]`` is divided by ``penalties[i]`` when positive and multiplied
    by it when negative (Keskar et al. 2019, "CTRL", section 4.1; ``transformers``'
    ``RepetitionPenaltyLogitsProcessor`` rule).

    Args:
        logits: ``[N, vocab]`` float32.
        rows: row indices into ``logits`` that get a penalty.
        seen: per such row, the token ids the thread has seen (repeats allowed; a mapping's
            keys: its ids).
        penalties: per such row, the penalty (> 0)."""
    r = torch.tensor([row for row, ids in zip(rows, seen) for _ in ids], dtype=torch.long)
    c = torch.tensor([i for ids in seen for i in ids], dtype=torch.long)
    p = torch.ones(logits.shape[0], 1, dtype=logits.dtype)
    p[rows, 0] = torch.tensor(penalties, dtype=logits.dtype)
    mask = torch.zeros(logits.shape, dtype=torch.bool)
    mask[r, c] = True
    dev = logits.device
    mask, p = mask.to(dev, non_blocking=True), p.to(dev, non_blocking=True)
    return torch.where(mask, torch.where(logits > 0, logits / p, logits * p), logits)


def apply_output_penalties(logits: torch.Tensor, rows: list[int], output: Sequence[Sequence[int] | Mapping[int, int]],
                           presence: list[float], frequency: list[float]) -> torch.Tensor:
    """The logits with OpenAI's presence and frequency penalties applied (a new tensor): for
    each ``rows[i]``, ``frequency[i] * count[t] + presence[i] * (count[t] > 0)`` is subtracted
    from the logit of every token ``t``, ``count[t]`` its occurrences in ``output[i]`` (OpenAI's
    "Parameter details" formula; vLLM's ``apply_penalties``). The counts are built on the
    logits' device (one ``index_put_`` with accumulation), only the ids travel.

    Args:
        logits: ``[N, vocab]`` float32.
        rows: row indices into ``logits`` that get the penalties.
        output: per such row, the response token ids the thread sees (repeats counted), or a
            mapping of each id to its count (the same counts).
        presence, frequency: per such row, the penalties (any finite number; 0 = none)."""
    dev, n = logits.device, logits.shape[0]
    r = torch.tensor([row for row, ids in zip(rows, output) for _ in ids], dtype=torch.long)
    c = torch.tensor([i for ids in output for i in ids], dtype=torch.long)
    w = torch.tensor([k for ids in output for k in (ids.values() if isinstance(ids, Mapping) else [1] * len(ids))],
                     dtype=logits.dtype)
    pf = torch.zeros(2, n, 1, dtype=logits.dtype)
    pf[0, rows, 0] = torch.tensor(presence, dtype=logits.dtype)
    pf[1, rows, 0] = torch.tensor(frequency, dtype=logits.dtype)
    r, c, pf = r.to(dev, non_blocking=True), c.to(dev, non_blocking=True), pf.to(dev, non_blocking=True)
    counts = torch.zeros(logits.shape, dtype=logits.dtype, device=dev)
    counts.index_put_((r, c), w.to(dev, non_blocking=True), accumulate=True)
    return logits - pf[1] * counts - pf[0] * (counts > 0).to(logits.dtype)


def mask_tokens(logits: torch.Tensor, rows: list[int], ids: list[list[int]]) -> torch.Tensor:
    """The logits with ``ids[i]`` set to ``-inf`` in row ``rows[i]`` (a new tensor; one
    ``masked_fill``): the end-of-sequence and stop tokens a thread may not sample yet
    (``min_tokens``) or at all (``ignore_eos``). Ids must be below ``logits.shape[-1]``."""
    dev = logits.device
    r = torch.tensor([row for row, row_ids in zip(rows, ids) for _ in row_ids], dtype=torch.long)
    c = torch.tensor([i for row_ids in ids for i in row_ids], dtype=torch.long)
    mask = torch.zeros(logits.shape, dtype=torch.bool, device=dev)
    mask[r.to(dev, non_blocking=True), c.to(dev, non_blocking=True)] = True
    return logits.masked_fill(mask, float("-inf"))


def apply_fork_threshold(logits: torch.Tensor, rows: list[int], thresholds: list[float], token: int) -> torch.Tensor:
    """The logits with a fork decision made for each of ``rows`` (a new tensor; one softmax over
    those rows and one ``masked_fill``, no host-device sync): where the probability of ``token``
    (the promise piece) under the row's softmax is at least ``thresholds[i]``, every other token
    gets ``-inf`` (the row forks whatever the sampler does next); elsewhere ``token`` gets
    ``-inf`` (the row does not fork). (:attr:`pasta_engine.config.Limits.fork_threshold`; the
    paper's speed-quality knob, Jin et al., ICML 2025, arXiv 2502.11517, section 5, moved from
    training to decoding.)

    Args:
        logits: ``[N, vocab]`` float32, after penalties and masks.
        rows: row indices into ``logits`` that may open a promise now (at least one).
        thresholds: per such row, a probability in ``(0, 1]``.
        token: the promise piece's token id (below ``logits.shape[-1]``)."""
    dev = logits.device
    r = torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)
    thr = torch.tensor(thresholds, dtype=torch.float32).to(dev, non_blocking=True)
    fork = torch.softmax(logits.index_select(0, r).float(), dim=-1)[:, token] >= thr
    forks = torch.zeros(logits.shape[0], dtype=torch.bool, device=dev).index_put_((r,), fork)
    decided = torch.zeros(logits.shape[0], dtype=torch.bool, device=dev).index_put_((r,), ~fork)
    is_token = torch.zeros(logits.shape[-1], dtype=torch.bool, device=dev)
    is_token[token] = True
    mask = (forks[:, None] & ~is_token) | (decided[:, None] & is_token)
    return logits.masked_fill(mask, float("-inf"))


def _min_p_filter(x: torch.Tensor, min_p: torch.Tensor | float) -> torch.Tensor:
    """``x`` with every token whose probability is below ``min_p`` times the row's largest set
    to ``-inf`` (vLLM's ``_apply_min_p``, ``transformers``' ``MinPLogitsWarper``; the most
    likely token always stays)."""
    probs = x.softmax(dim=-1)
    return x.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p, float("-inf"))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``[N, vocab]`` float32 (rows of one request's threads).
        params: the request's :class:`SamplingParams`.
        generator: the request's generator (on the logits' device); unused when greedy.

    Returns ``[N]`` int64 token ids. Filtering follows HF ``generate``'s order: temperature,
    then top-k, then top-p (Holtzman et al. 2020, "The Curious Case of Neural Text
    Degeneration", section 3.1), then min-p (penalties and masks are applied before, by the
    caller)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    x = logits / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(dim=-1)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop = probs.cumsum(dim=-1) - probs >= max(params.top_p, MIN_TOP_P)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, sorted_x)
    if params.min_p > 0.0:
        x = _min_p_filter(x, params.min_p)
    probs = x.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Natural-log probability ``[N]`` float32 of ``tokens`` ``[N]`` under the untempered
    distributions ``logits`` ``[N, vocab]``."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, tokens[:, None]).squeeze(1)


def draw_noise(out: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill ``out`` (``[n, vocab]`` float32, contiguous rows of one request) with Exp(1) noise
    from the request's generator, in place: the numbers ``torch.multinomial(probs, 1,
    generator)`` draws for its exponential-race fast path, so :func:`sample_batch` picks the
    tokens :func:`sample` picks for the same seed."""
    return out.exponential_(1.0, generator=generator)


#: mt19937's state: 624 32-bit words (torch's CPU generator).
_MT_WORDS = 624


def request_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The ``torch.Generator`` a random stream with ``seed`` draws its numbers from (one per
    thread of a request: :func:`~pasta_engine.core.batch.thread_seed` of ``SamplingParams.seed``,
    the seed itself for the main thread): a function of the whole seed (an int in
    ``[0, 2**64 - 1]``), so the same seed gives the same stream and two seeds give two streams.

    ``manual_seed`` of a CPU generator keeps only a seed's low 32 bits (mt19937 is seeded from
    one 32-bit word), so seeds that differ by a multiple of ``2**32`` (a server's fresh 64-bit
    seeds among them) drew the same numbers. On the CPU a seed below ``2**32`` seeds it as
    ``manual_seed`` does (the numbers it always gave); a larger one sets its whole mt19937 state
    from the seed (624 words of ``numpy.random.SeedSequence(seed)``, the way numpy seeds its
    MT19937), and ``initial_seed()`` reports the seed. A CUDA (Philox) generator takes all 64
    bits: ``manual_seed``. Built once per thread, at its first draw (no device sync; a chunk's
    64-bit seed takes the SeedSequence path, tens of microseconds, once).

    Raises ValueError for a seed outside ``[0, 2**64 - 1]``, RuntimeError when the device has
    no generator."""
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64 - 1], got {seed}")
    gen = torch.Generator(device=device)
    if gen.device.type != "cpu" or seed < 2**32:
        gen.manual_seed(seed)
        return gen
    layout = _cpu_state_layout()
    if layout is None:  # a torch whose CPU state layout is not the known one: mix all 64 bits into 32
        gen.manual_seed(int(np.random.SeedSequence(seed).generate_state(1, np.uint32)[0]))
        return gen
    words = np.random.SeedSequence(seed).generate_state(_MT_WORDS, np.uint32).astype(np.uint64)
    words[0] |= 0x80000000  # the top bit: never the all-zero state (numpy's init_by_array does the same)
    state = bytearray(layout)
    state[0:8] = seed.to_bytes(8, "little")  # the initial seed
    state[24 : 24 + 8 * _MT_WORDS] = words.astype("<u8").tobytes()
    gen.set_state(torch.frombuffer(state, dtype=torch.uint8).clone())
    return gen


@lru_cache(maxsize=1)
def _cpu_state_layout() -> bytes | None:
    """A CPU generator's state right after ``manual_seed`` (its bytes: the initial seed, int64 at
    0; ``left`` and ``seeded``, int32 at 8 and 12; ``next``, uint64 at 16; the 624 state words,
    uint64 each, at 24; then the cached normal samples, invalid), checked against mt19937's
    seeding of a known seed; None when this torch lays it out otherwise."""
    probe = 0x9E3779B9
    st = bytes(torch.Generator().manual_seed(probe).get_state().numpy().tobytes())
    word = [probe]
    for i in range(1, 3):
        word.append((1812433253 * (word[-1] ^ (word[-1] >> 30)) + i) & 0xFFFFFFFF)
    head = [int.from_bytes(st[a:b], "little") for a, b in ((0, 8), (8, 12), (12, 16), (16, 24))]
    got = [int.from_bytes(st[24 + 8 * i : 32 + 8 * i], "little") for i in range(3)]
    if len(st) < 24 + 8 * _MT_WORDS or head != [probe, 1, 1, 0] or got != word:
        return None
    return st


def sample_batch(
    logits: torch.Tensor,
    greedy: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    noise: torch.Tensor | None,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick one token per row for rows of many requests at once (one call per step).

    Args:
        logits: ``[N, vocab]`` float32.
        greedy: ``[N]`` bool, rows picked by argmax of their logits.
        temperature: ``[N, 1]`` float32 (any positive value on greedy rows).
        top_k: ``[N, 1]`` int64 in ``[1, vocab]`` (``vocab``: no filter), or None when no row filters.
        top_p: ``[N, 1]`` float32 (``inf``: no filter), or None when no row filters.
        noise: ``[N, vocab]`` float32 Exp(1) noise from each row's request generator
            (:func:`draw_noise`; ones on greedy rows), or None when every row is greedy.
        min_p: ``[N, 1]`` float32 in [0, 1] (0: no filter), or None when no row filters.

    Returns ``(tokens [N] int64, bad [N] bool)``: ``bad`` marks rows whose logits hold NaN or
    +inf or are ``-inf`` throughout (greedy rows too: their argmax means nothing) and sampled rows whose distribution holds
    inf or nan (where :func:`torch.multinomial` raises); the runner fails those requests alone. Per row the same
    operations as :func:`sample` in the same order (temperature, top-k, top-p, min-p, softmax, then the
    exponential race ``argmax(probs / noise)`` that ``torch.multinomial(probs, 1)`` runs), so
    tokens are bitwise those of per-request :func:`sample` calls with the same generators."""
    argmax = logits.argmax(dim=-1)
    # argmax takes NaN as the largest value, so a row holding NaN or +inf has it at its argmax:
    # an [N] check, not another pass over [N, vocab] (-inf is a mask, not a fault)
    top = logits.gather(1, argmax[:, None]).squeeze(1)
    # NaN or +inf, or every token masked (-inf throughout: argmax would silently give token 0)
    nonfinite = torch.isnan(top) | torch.isinf(top)
    if noise is None:
        return argmax, nonfinite
    x = logits / temperature
    if top_k is not None:
        kth = torch.sort(x, dim=-1, descending=True).values.gather(1, top_k - 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, sorted_x)
    if min_p is not None:
        x = _min_p_filter(x, min_p)
    probs = x.softmax(dim=-1)
    bad = nonfinite | (~torch.isfinite(probs).all(dim=-1) & ~greedy)
    return torch.where(greedy, argmax, (probs / noise).argmax(dim=-1)), bad


# --------------------------------------------------------------------------- the sampling batch


class SamplingRowLike(Protocol):
    """What :meth:`SamplingBatch.from_rows` reads of a row (the engine's
    ``engine.batch.SamplingRow``; this layer imports no engine): ``seen`` has ``counts`` and
    ``response`` (token id -> count), ``rng`` has ``seed`` and ``generator`` (None until the
    first draw, then the ``torch.Generator`` made here)."""

    request_id: str
    tid: int
    params: SamplingParams
    forced: int | None
    grammar: int
    seen: object | None
    masked_ends: tuple[int, ...]
    fork_threshold: float | None
    rng: object


@dataclass
class SamplingBatch:
    """One step's sampling, packed from its sampling rows by :meth:`from_rows` (host lists;
    each tensor is made where it is used, one transfer per kind).

    Attributes:
        rows: the rows, in batch order (``N``); request_ids: each row's request.
        forced: per row the token replay forces, -1 where it samples; all_forced: no row samples.
        logprobs: per row, whether its request wants logprobs.
        groups: per random stream (each thread has its own: ``core.batch.RandomStream``; rows
            sharing one are consecutive): ``(first row, rows, stream, draws)``, ``draws`` when it
            samples randomly (its rows get noise from its stream).
        repetition: ``(rows, seen counts, penalties)`` of the rows a repetition penalty applies
            to, or None; output: ``(rows, response counts, presence, frequency)``, or None.
        ends: ``(rows, ids)`` of the end tokens masked per row (ids below the vocabulary), or None.
        grammar: ``[N]`` int64 grammar states on the device and the ``[states, vocab]`` bool mask
            table (True: masked), or None when no row is constrained.
        fork: ``(rows, thresholds, token)`` for ``Limits.fork_threshold``, or None.
        greedy, temperature, top_k, top_p, min_p: per-row parameters of :func:`sample_batch`
            (None when every row is forced)."""

    rows: Sequence[SamplingRowLike]
    request_ids: list[str]
    forced: list[int]
    all_forced: bool
    logprobs: list[bool]
    groups: list[tuple[int, int, object, bool]]
    repetition: tuple[list[int], list, list[float]] | None = None
    output: tuple[list[int], list, list[float], list[float]] | None = None
    ends: tuple[list[int], list[list[int]]] | None = None
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None
    fork: tuple[list[int], list[float], int] | None = None
    greedy: list[bool] | None = None
    temperature: list[float] | None = None
    top_k: list[int] | None = None
    top_p: list[float] | None = None
    min_p: list[float] | None = None

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRowLike], vocab: int, device: torch.device,
                  grammar_masks: torch.Tensor | None = None, fork_token: int | None = None,
                  fork_state: int | None = None) -> "SamplingBatch":
        """Pack one step's rows.

        Args:
            rows: the step's sampling rows in batch order (a request's rows consecutive).
            vocab: the logits' width (end ids at or past it are left out; top-k at or past it
                filters nothing).
            device: the logits' device.
            grammar_masks: ``[states, vocab]`` bool on ``device`` (True: masked), or None (no
                grammar; rows' grammar states are then ignored).
            fork_token, fork_state: the promise piece's id and the grammar state in which a
                row's ``fork_threshold`` decides on it (None: no row may fork by threshold)."""
        forced = [-1 if r.forced is None else r.forced for r in rows]
        groups: list[tuple[int, int, object, bool]] = []
        at = 0
        for rng, grp in groupby(rows, key=lambda r: r.rng):
            grp = list(grp)
            groups.append((at, len(grp), rng, not grp[0].params.greedy and any(r.forced is None for r in grp)))
            at += len(grp)
        sb = cls(rows, [r.request_id for r in rows], forced, -1 not in forced,
                 [r.params.return_logprobs for r in rows], groups)
        free = [(k, r) for k, r in enumerate(rows) if r.forced is None]
        rep = [(k, r) for k, r in free if r.params.repetition_penalty != 1.0]
        if rep:
            sb.repetition = ([k for k, _ in rep], [r.seen.counts for _, r in rep],
                             [r.params.repetition_penalty for _, r in rep])
        pf = [(k, r) for k, r in free if r.params.penalised]
        if pf:
            sb.output = ([k for k, _ in pf], [r.seen.response for _, r in pf],
                         [r.params.presence_penalty for _, r in pf], [r.params.frequency_penalty for _, r in pf])
        ends = [(k, ids) for k, r in free if r.masked_ends for ids in [[i for i in r.masked_ends if 0 <= i < vocab]]
                if ids]
        if ends:
            sb.ends = ([k for k, _ in ends], [ids for _, ids in ends])
        if grammar_masks is not None:
            states = [r.grammar for r in rows]
            if any(states):
                sb.grammar = (to_device(states, torch.long, device), grammar_masks)
        if fork_token is not None:
            fk = [(k, r.fork_threshold) for k, r in free if r.fork_threshold is not None and r.grammar == fork_state]
            if fk:
                sb.fork = ([k for k, _ in fk], [t for _, t in fk], fork_token)
        if not sb.all_forced:
            sb._pack_params(vocab)
        return sb

    def _pack_params(self, vocab: int) -> None:
        """The per-row parameters of :func:`sample_batch` (a request that draws no noise is greedy)."""
        self.greedy, self.temperature, self.top_k, self.top_p, self.min_p = [], [], [], [], []
        for a, m, _, draws in self.groups:
            prm = self.rows[a].params
            self.greedy += [not draws] * m
            self.temperature += [prm.temperature if draws else 1.0] * m
            self.top_k += [prm.top_k if draws and 0 < prm.top_k < vocab else vocab] * m
            self.top_p += [max(prm.top_p, MIN_TOP_P) if draws and prm.top_p < 1.0 else float("inf")] * m
            self.min_p += [prm.min_p if draws else 0.0] * m

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits sampling picks from (a new tensor; forced rows untouched): the repetition
        penalty, the presence and frequency penalties, ``-inf`` on the masked end tokens and on
        what the grammar forbids (logprobs see the masks too), then the fork threshold's
        decision. ``logits``: ``[N, vocab]`` float32."""
        if self.repetition is not None:  # before the masks: a masked token stays masked
            logits = apply_repetition_penalty(logits, *self.repetition)
        if self.output is not None:
            logits = apply_output_penalties(logits, *self.output)
        unmasked = logits
        if self.ends is not None:
            logits = mask_tokens(logits, *self.ends)
        if self.grammar is not None:
            states, table = self.grammar
            logits = logits.masked_fill(table[states], float("-inf"))
            if self.ends is not None:
                logits = self._grammar_wins(logits, unmasked, states, table)
        if self.fork is not None:
            logits = apply_fork_threshold(logits, *self.fork)
        return logits

    def _grammar_wins(self, logits: torch.Tensor, unmasked: torch.Tensor, states: torch.Tensor,
                      table: torch.Tensor) -> torch.Tensor:
        """Rows of :attr:`ends` whose masked end ids and grammar together leave no token (a stop
        id that is the only piece closing a tag, under ``min_tokens``): the grammar alone masks
        them, so the tag closes and the end ids wait. Only rows with masked ends are checked."""
        rows = torch.tensor(self.ends[0], dtype=torch.long).to(logits.device, non_blocking=True)
        now = logits.index_select(0, rows)
        grammar_only = unmasked.index_select(0, rows).masked_fill(table[states[rows]], float("-inf"))
        dead = torch.isneginf(now).all(dim=-1, keepdim=True)  # no host-device sync
        return logits.index_copy(0, rows, torch.where(dead, grammar_only, now))

    def pick(self, logits: torch.Tensor, errors: dict[str, str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's token: forced, or sampled by :func:`sample_batch` with each drawing
        thread's noise from its own stream (its generator made from its seed at its first
        draw). A request whose draw raised is named in ``errors``. Returns ``(tokens [N] int64,
        bad [N] bool or None)`` (``bad``: see :func:`sample_batch`; None when all are forced)."""
        dev = logits.device
        if self.all_forced:
            return to_device(self.forced, torch.long, dev), None
        n = len(self.rows)
        noise = None
        if any(g[3] for g in self.groups):
            noise = torch.ones_like(logits)
            for a, m, rng, draws in self.groups:
                if not draws:
                    continue
                try:
                    if rng.generator is None:
                        rng.generator = request_generator(rng.seed, dev)
                    draw_noise(noise[a : a + m], rng.generator)
                except Exception as e:  # noqa: BLE001  (the failure belongs to this request only)
                    errors[self.request_ids[a]] = f"sampling failed: {type(e).__name__}: {e}"
        vocab = logits.shape[-1]
        kmask = any(k < vocab for k in self.top_k)
        pmask = any(p < 1.0 for p in self.top_p)
        mpmask = any(p > 0.0 for p in self.min_p)
        params = to_device(self.temperature + self.top_p + (self.min_p if mpmask else []), torch.float32,
                           dev).view(-1, n, 1)
        tokens, bad = sample_batch(
            logits, to_device(self.greedy, torch.bool, dev), params[0],
            to_device(self.top_k, torch.long, dev).view(n, 1) if kmask else None, params[1] if pmask else None, noise,
            params[2] if mpmask else None)
        if any(f >= 0 for f in self.forced):
            f = to_device(self.forced, torch.long, dev)
            tokens = torch.where(f >= 0, f, tokens)
        return tokens, bad

    def logprobs_of(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``[N]`` float32: each token's logprob under ``logits`` where its request wants
        logprobs, 0.0 elsewhere."""
        if not any(self.logprobs):
            return torch.zeros(len(self.rows), device=logits.device)
        lps = logprobs_of(logits, tokens)
        if all(self.logprobs):
            return lps
        return torch.where(to_device(self.logprobs, torch.bool, logits.device), lps, 0.0)
