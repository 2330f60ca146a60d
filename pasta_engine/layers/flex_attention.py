"""The FlexAttention backend: torch's ``flex_attention`` over the step's tree of KV views, with a
block mask built from that tree.

Algorithm: FlexAttention (J. Dong, B. Feng, D. Guessous, Y. Liang, H. He, "Flex Attention: A
Programming Model for Generating Optimized Attention Kernels", 2024, arXiv:2412.05496):
attention variants written as a ``mask_mod`` (which query row sees which key) and a
``score_mod`` (how a score changes), with a :class:`~torch.nn.attention.flex_attention.BlockMask`
naming, per block of query rows, the key blocks it must visit (partial blocks run the
``mask_mod``, full blocks skip it, the rest are never read).

Layout of a step (one ``flex_attention`` call per layer, batch 1): the query rows are the step's
``T`` rows in order; the keys are the *union of the step's views*: every distinct run
(:data:`~pasta_engine.layers.attention.Run`: a KV segment) once, in the order first met, so a
prompt or a parent's prefix that several threads share is gathered once and is one contiguous
key range. Row ``t`` of sequence ``b`` sees key ``j`` iff ``j``'s run is in ``b``'s view and,
when ``j`` is one of ``b``'s new tokens (a multi-token chunk), ``j`` is not after ``t``'s own
token (causal inside the chunk). The block mask is computed on the host from the runs
(which sequences' rows fall in a query block, which runs they see, which key blocks those runs
cover), not by evaluating the mask over the ``T x keys`` grid; a key block is *full* for a query
block when every row of it sees every key of it (no new tokens there, every run there seen by
all its sequences). Sliding windows (over logical positions, as the torch reference) and
logit soft-caps are a ``score_mod``; GQA is ``enable_gqa``.

CPU and CUDA: with ``compile=None`` (default) the call is ``torch.compile``'d on CUDA (the fused
kernel, which reads only the block mask's blocks) and eager on a CPU. Eager ``flex_attention`` is
torch's unfused reference path: it computes the full ``[Hq, T, keys]`` score matrix in float32
and applies the mods by ``vmap`` (the block mask's sparsity is not used), so on a CPU this
backend is a correctness peer, not a fast one; ``compile=True`` on a CPU needs a C++ compiler
and compiles once per shape. No CUDA-graph mode (``supports_cuda_graphs`` False).

Each step is planned from scratch: the plan is a few host lists and tensors of the union's size.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .attention import AttentionBackend, AttentionMetadata, check_attention_options, view_slots

__all__ = ["FlexAttention", "FlexPlan", "build_flex_plan"]

_compiled = None  # torch.compile(flex_attention), made on first use


def _compiled_flex():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention)
    return _compiled


@dataclass
class FlexPlan:
    """One step's plan (all tensors on the backend's device).

    Attributes:
        num_rows: ``T``, the step's query rows.
        num_keys: ``L``, keys of the union of the step's views.
        union: ``[L]`` int64 KV slot (``page * page_size + offset``) of each key.
        row_seq: ``[Tp]`` int32 sequence of each row (``Tp``: ``T`` rounded up to the query
            block; padding rows: 0).
        key_run: ``[Lp]`` int32 run (column of ``visible``) of each key (``Lp``: ``L`` rounded
            up to the key block; padding keys: a run no sequence sees).
        key_seq: ``[Lp]`` int32 sequence whose new token the key is (-1: an older token).
        key_row: ``[Lp]`` int32 row whose new token the key is (-1: an older token).
        visible: ``[B, S + 1]`` bool, sequence ``b`` sees run ``s`` (the last column: padding).
        dense: ``[Tp, Lp]`` bool, row ``t`` sees key ``j`` (the tree mask over the whole grid),
            or None: made only for the eager path, whose ``mask_mod`` then reads it (one lookup
            instead of five under four ``vmap`` levels: half the eager call's cost).
        block_mask: the :class:`~torch.nn.attention.flex_attention.BlockMask` (``mask_mod``
            included) over ``T`` rows and ``L`` keys."""

    num_rows: int
    num_keys: int
    union: torch.Tensor
    row_seq: torch.Tensor
    key_run: torch.Tensor
    key_seq: torch.Tensor
    key_row: torch.Tensor
    visible: torch.Tensor
    dense: torch.Tensor | None
    block_mask: BlockMask


def _mask_mod(row_seq: torch.Tensor, key_run: torch.Tensor, key_seq: torch.Tensor, key_row: torch.Tensor,
              visible: torch.Tensor):
    """The tree mask: row ``q`` sees key ``kv`` iff its sequence's view holds the key's run and the
    key is not a later new token of the same sequence."""

    def mask_mod(b, h, q_idx, kv_idx):
        seq = row_seq[q_idx]
        own = key_seq[kv_idx] == seq
        return visible[seq, key_run[kv_idx]] & (~own | (key_row[kv_idx] <= q_idx))

    return mask_mod


def _dense_mask_mod(grid: torch.Tensor):
    """The tree mask read from its materialized ``[Tp, Lp]`` grid."""

    def mask_mod(b, h, q_idx, kv_idx):
        return grid[q_idx, kv_idx]

    return mask_mod


def _score_mod(logit_softcap: float | None, sliding_window: int | None, q_pos: torch.Tensor | None,
               k_pos: torch.Tensor | None):
    """Soft-cap then window (the torch reference's order), or None when the layer has neither."""
    if logit_softcap is None and sliding_window is None:
        return None
    cap = logit_softcap

    def score_mod(score, b, h, q_idx, kv_idx):
        if cap is not None:
            score = torch.tanh(score / cap) * cap
        if sliding_window is not None:
            score = torch.where(k_pos[kv_idx] > q_pos[q_idx] - sliding_window, score, -float("inf"))
        return score

    return score_mod


def _block_indices(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[nq, nk]`` bool -> (``[1, 1, nq]`` int32 counts, ``[1, 1, nq, nk]`` int32 indices, the
    marked key blocks first, in order)."""
    num = m.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[None, None], idx[None, None]


def build_flex_plan(meta: AttentionMetadata, device: torch.device | str = "cpu",
                    block_size: tuple[int, int] = (128, 128), dense: bool = False) -> FlexPlan:
    """The :class:`FlexPlan` of ``meta`` (see the module docstring). ``block_size``: the block
    mask's ``(query rows, keys)`` per block; ``dense``: also materialize the mask over the grid
    and make the ``mask_mod`` read it (the same mask: the tree ``mask_mod`` evaluated once).
    Raises ValueError when ``meta``'s views do not end with their new tokens (a view shorter
    than its ``q_lens``)."""
    bq, bk = block_size
    ps = meta.page_size
    index: dict[tuple, int] = {}
    run_start: list[int] = []
    run_len: list[int] = []
    slots: list[int] = []
    seq_runs: list[list[int]] = []
    for runs in meta.runs:
        mine = []
        for run in runs:
            key = (run[0], tuple(run[1]), tuple(run[2]))
            s = index.get(key)
            if s is None:
                s = index[key] = len(run_start)
                run_start.append(len(slots))
                slots += view_slots([run], ps)
                run_len.append(len(slots) - run_start[-1])
            mine.append(s)
        seq_runs.append(mine)
    t, n_keys, n_runs, n_seqs = meta.num_tokens, len(slots), len(run_start), len(meta.runs)
    nq, nk = max(1, math.ceil(t / bq)), max(1, math.ceil(n_keys / bk))
    tp, lp = nq * bq, nk * bk
    key_run = torch.full((lp,), n_runs, dtype=torch.int32)
    key_run[:n_keys] = torch.repeat_interleave(torch.arange(n_runs, dtype=torch.int32),
                                               torch.tensor(run_len, dtype=torch.long))
    key_seq = torch.full((lp,), -1, dtype=torch.int32)
    key_row = torch.full((lp,), -1, dtype=torch.int32)
    new_at: list[int] = []  # union index of every new token
    new_seq: list[int] = []
    new_row: list[int] = []
    for b, (q, starts) in enumerate(zip(meta.q_lens, meta.q_starts())):
        need, row = q, starts + q - 1
        for s in reversed(seq_runs[b]):
            if need == 0:
                break
            end = run_start[s] + run_len[s]
            take = min(need, run_len[s])
            new_at += range(end - 1, end - 1 - take, -1)
            new_row += range(row, row - take, -1)
            new_seq += [b] * take
            row -= take
            need -= take
        if need:
            raise ValueError(f"sequence {b}'s view holds fewer tokens than its {q} new ones")
    if new_at:
        at = torch.tensor(new_at, dtype=torch.long)
        key_seq[at] = torch.tensor(new_seq, dtype=torch.int32)
        key_row[at] = torch.tensor(new_row, dtype=torch.int32)
    row_seq = torch.zeros(tp, dtype=torch.int32)
    row_seq[:t] = torch.repeat_interleave(torch.arange(n_seqs, dtype=torch.int32),
                                          torch.tensor(meta.q_lens, dtype=torch.long))
    visible = torch.zeros(n_seqs, n_runs + 1, dtype=torch.bool)
    for b, mine in enumerate(seq_runs):
        visible[b, mine] = True

    # the block mask, from the runs: query block i x key block j
    q_seqs = torch.zeros(nq, n_seqs, dtype=torch.bool)  # sequences with rows in query block i
    q_seqs[torch.arange(t) // bq, row_seq[:t].long()] = True
    run_blocks = torch.zeros(n_runs, nk, dtype=torch.bool)  # key blocks each run covers
    for s, (a, n) in enumerate(zip(run_start, run_len)):
        if n:
            run_blocks[s, a // bk : (a + n - 1) // bk + 1] = True
    qf, vis, rb = q_seqs.float(), visible[:, :n_runs].float(), run_blocks.float()
    sees = (qf @ vis) > 0  # [nq, S]: some row of block i sees run s
    unseen = (qf @ (1 - vis)) > 0  # [nq, S]: some row of block i does not see run s
    touched = ((sees.float() @ rb) > 0)
    mixed = ((unseen.float() @ rb) > 0)  # a run of block j is not seen by every row of block i
    has_new = torch.zeros(nk, dtype=torch.bool)
    if new_at:
        has_new[torch.tensor(new_at) // bk] = True
    whole_k = (torch.arange(nk) + 1) * bk <= n_keys
    whole_q = (torch.arange(nq) + 1) * bq <= t
    full = touched & ~mixed & ~has_new[None] & whole_k[None] & whole_q[:, None]
    partial = touched & ~full
    tensors = [torch.tensor(slots, dtype=torch.long), row_seq, key_run, key_seq, key_row, visible]
    union, row_seq, key_run, key_seq, key_row, visible = (x.to(device) for x in tensors)
    num, idx = _block_indices(partial)
    full_num, full_idx = _block_indices(full)
    mask_mod = _mask_mod(row_seq, key_run, key_seq, key_row, visible)
    grid = None
    if dense:
        grid = mask_mod(None, None, torch.arange(tp, device=device)[:, None], torch.arange(lp, device=device)[None, :])
        mask_mod = _dense_mask_mod(grid)
    block_mask = BlockMask.from_kv_blocks(
        num.to(device), idx.to(device), full_num.to(device), full_idx.to(device), BLOCK_SIZE=(bq, bk),
        mask_mod=mask_mod, seq_lengths=(t, n_keys))
    return FlexPlan(t, n_keys, union, row_seq, key_run, key_seq, key_row, visible, grid, block_mask)


class FlexAttention(AttentionBackend):
    """Attention by ``torch.nn.attention.flex_attention`` (see the module docstring).

    Args:
        compile: run ``torch.compile(flex_attention)`` (None: on CUDA only; a CPU runs the eager
            reference path).
        block_size: the block mask's ``(query rows, keys)`` per block (an int: both); the
            compiled kernel's tiles must divide it (128 does).

    Raises ValueError for a block size that is not a positive int or pair of them."""

    name = "flex"
    supports_cuda_graphs = False

    def __init__(self, compile: bool | None = None, block_size: int | tuple[int, int] = 128):
        bs = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
        if len(bs) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in bs):
            raise ValueError(f"block_size must be a positive int or a pair of them, got {block_size!r}")
        self.compile = compile
        self.block_size: tuple[int, int] = bs
        self.device = torch.device("cpu")
        self._plan: FlexPlan | None = None
        self._key_pos: tuple[torch.Tensor, torch.Tensor] | None = None  # (key_positions, its union gather)

    def plan(self, meta: AttentionMetadata) -> bool:
        """Build the step's :class:`FlexPlan` (every step; see :func:`build_flex_plan`)."""
        compiled = self.compile if self.compile is not None else self.device.type == "cuda"
        self._plan = build_flex_plan(meta, self.device, self.block_size, dense=not compiled)
        self._key_pos = None
        return True

    def _key_positions(self, pl: FlexPlan, key_positions: torch.Tensor) -> torch.Tensor:
        """``[Lp]`` int32 logical position of each union key (once per step: every layer passes
        the same table)."""
        kp = self._key_pos
        if kp is None or kp[0] is not key_positions:
            pos = torch.zeros(pl.key_run.shape[0], dtype=key_positions.dtype, device=key_positions.device)
            pos[: pl.num_keys] = key_positions.reshape(-1).index_select(0, pl.union)
            kp = self._key_pos = (key_positions, pos)
        return kp[1]

    def attend(self, q, k_cache, v_cache, scale, *, sliding_window=None, logit_softcap=None, positions=None,
               key_positions=None):
        """q ``[T, Hq, D]`` -> ``[T, Hq, D]`` (q's dtype; keys and values are cast to it), see
        :meth:`AttentionBackend.attend`."""
        pl = self._plan
        if pl is None:
            raise RuntimeError("FlexAttention.attend before plan()")
        check_attention_options(sliding_window, logit_softcap, positions, key_positions, q, k_cache)
        t, hq, d = q.shape
        hkv = k_cache.shape[2]
        k = k_cache.view(-1, hkv, d).index_select(0, pl.union).to(q.dtype).transpose(0, 1)[None]  # [1, Hkv, L, D]
        v = v_cache.view(-1, hkv, d).index_select(0, pl.union).to(q.dtype).transpose(0, 1)[None]
        q_pos = k_pos = None
        if sliding_window is not None:
            q_pos = torch.zeros(pl.row_seq.shape[0], dtype=torch.long, device=q.device)
            q_pos[:t] = positions
            k_pos = self._key_positions(pl, key_positions)
        score_mod = _score_mod(logit_softcap, sliding_window, q_pos, k_pos)
        qh = q.transpose(0, 1)[None]  # [1, Hq, T, D]
        compile = self.compile if self.compile is not None else q.device.type == "cuda"
        if compile:
            out = _compiled_flex()(qh, k, v, score_mod=score_mod, block_mask=pl.block_mask, scale=scale,
                                   enable_gqa=hq != hkv)
        else:
            with warnings.catch_warnings():  # "called without torch.compile": the eager path is chosen here
                warnings.simplefilter("ignore", UserWarning)
                out = flex_attention(qh, k, v, score_mod=score_mod, block_mask=pl.block_mask, scale=scale,
                                     enable_gqa=hq != hkv)
        return out[0].transpose(0, 1)
