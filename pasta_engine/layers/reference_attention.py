"""The torch reference attention backend (``attention_backend="torch"``), and its CPU caches.

:class:`TorchAttention` gathers each sequence's KV view into a dense tensor and calls
``scaled_dot_product_attention`` with explicit masks (or the same math written out with a
soft-cap): the backend every other one is checked against, and the one a CPU runs. What it keeps
across steps so that a CPU decode step costs little: the decode plan (:class:`DecodeTable`, one
row of KV-slot ids per decode sequence, appended to while views only grow) and the mirrors of
the decode rows' K/V. The interface it implements, the step's metadata and the per-layer options
are :mod:`pasta_engine.layers.attention`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import AttentionBackend, AttentionMetadata, PlanHistory, check_attention_options, same_view, view_slots
from .utils import to_device

__all__ = ["TorchAttention", "DecodeTable"]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
               logit_softcap: float | None) -> torch.Tensor:
    """Masked attention ``[..., Hq, Q, D]`` over ``k, v`` ``[..., Hkv, L, D]`` with a ``mask``
    broadcastable to ``[..., Hq, Q, L]``: bool (True: visible) or additive float (0 or -inf, in
    q's dtype). ``scaled_dot_product_attention``, or with a soft-cap the same math written out
    (scores and softmax in float32, as ``transformers``' eager Gemma 2 attention takes its
    softmax)."""
    hq, hkv = q.shape[-3], k.shape[-3]
    if logit_softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=-3)
        v = v.repeat_interleave(hq // hkv, dim=-3)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = torch.tanh(s / logit_softcap) * logit_softcap
    s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v.float()).to(q.dtype)


class DecodeTable:
    """The torch backend's decode plan, kept across steps: one table row per decode sequence
    with the slot ids of its whole view (padded) and an additive mask (0 where a slot is used,
    -inf in the padding).

    Tensors (on the backend's device): ``slots`` ``[rows_cap, len_cap]`` int64, ``mask``
    ``[rows_cap, len_cap]`` float32, ``next`` ``[rows_cap]`` int64 (flat index of each row's
    first unused entry). Host side: ``history`` (the :class:`PlanHistory` of the rows' views:
    ``keys[r]``, :meth:`AttentionMetadata.view_key` of the sequence in row ``r``, and ``step``,
    the step of the last update), ``lens[r]`` (used entries), ``longest`` and ``bumped`` (the
    last update's new slot of each row when every row only grew by it, else None).

    :meth:`update` makes row ``r`` hold sequence ``r`` of the step: a row whose sequence is the
    one it held at the previous step (:func:`same_view`) only gets its new slot appended (one
    vectorized write for all such rows); any other row is filled again from its runs (forks,
    joins, threads that start or end, after a step that did not plan). Capacities double when
    exceeded."""

    def __init__(self, device: torch.device):
        self.device = device
        self.slots = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.mask = torch.zeros(0, 0, dtype=torch.float32, device=device)
        self._set_next(torch.zeros(0, dtype=torch.long, device=device))
        self.history = PlanHistory()
        self.lens: list[int] = []
        self.longest = 0
        self.bumped: list[int] | None = None  # the last update's new slots when it only appended

    @property
    def step(self) -> int | None:
        """The step of the last update (or of the last step planned without decode rows)."""
        return self.history.step

    @property
    def keys(self) -> list[tuple[int, int]]:
        """The view key of the sequence in each row."""
        return self.history.keys

    def _grow(self, rows: int, length: int) -> None:
        r_cap, l_cap = self.slots.shape
        if rows <= r_cap and length <= l_cap:
            return
        r_new = max(rows, 2 * r_cap, 16) if rows > r_cap else r_cap
        l_new = max(length, 2 * l_cap, 64) if length > l_cap else l_cap
        slots = torch.zeros(r_new, l_new, dtype=torch.long, device=self.device)
        mask = torch.full((r_new, l_new), float("-inf"), dtype=torch.float32, device=self.device)
        slots[:r_cap, :l_cap] = self.slots
        mask[:r_cap, :l_cap] = self.mask
        self.slots, self.mask = slots, mask
        self.lens += [0] * (r_new - r_cap)
        self._set_next(torch.arange(r_new, device=self.device) * l_new + to_device(self.lens, torch.long, self.device))

    def _set_next(self, nxt: torch.Tensor) -> None:
        self.next = nxt
        # on a CPU the per-step bump writes through numpy views (a few microseconds, where
        # each torch op costs as much as the whole write)
        self._np = (self.slots.numpy().reshape(-1), self.mask.numpy().reshape(-1), nxt.numpy()) \
            if self.device.type == "cpu" else None

    def update(self, meta: AttentionMetadata, seqs: list[int], new_slots: list[int]) -> int:
        """Make rows ``0..len(seqs)-1`` hold the views of ``meta``'s sequences ``seqs`` (single
        -token ones) whose new tokens go to ``new_slots`` (one KV slot each); returns the longest
        row's length in tokens. Raises nothing of its own (tensor errors propagate)."""
        n = len(seqs)
        runs = meta.runs
        keys = [(runs[b][-1][0], len(runs[b])) for b in seqs]  # meta.view_key(b), inlined (per step)
        history = self.history
        self.bumped = None
        lens = self.lens
        dev = self.device
        if history.advance(meta, keys):  # the common step: every row grows by one slot
            if self.longest + 1 > self.slots.shape[1]:
                self._grow(n, self.longest + 1)
                lens = self.lens
            if self._np is not None:
                slots_np, mask_np, next_np = self._np
                at = next_np[:n]
                slots_np[at] = new_slots
                mask_np[at] = 0.0
            else:
                at = self.next[:n]
                self.slots.view(-1).index_copy_(0, at, to_device(new_slots, torch.long, dev))
                self.mask.view(-1).index_fill_(0, at, 0.0)
            at += 1
            lens[:n] = [x + 1 for x in lens[:n]]
            self.longest += 1
            self.bumped = new_slots
            return self.longest
        bump, fill = [], []
        for r in range(n):
            (bump if history.kept(r) else fill).append(r)
        fill_slots = [view_slots(runs[seqs[r]], meta.page_size) for r in fill]
        self._grow(n, max([lens[r] + 1 for r in bump] + [len(x) for x in fill_slots]))
        lens = self.lens
        cap = self.slots.shape[1]
        if bump:
            at = self.next[to_device(bump, torch.long, dev)]
            self.slots.view(-1).index_copy_(0, at, to_device([new_slots[r] for r in bump], torch.long, dev))
            self.mask.view(-1).index_fill_(0, at, 0.0)
            for r in bump:
                lens[r] += 1
        if fill:
            width = max(len(x) for x in fill_slots)
            padded = [s for x in fill_slots for s in x + [0] * (width - len(x))]
            rows = to_device(fill, torch.long, dev)
            fl = to_device([len(x) for x in fill_slots], torch.long, dev)
            self.slots[rows, :width] = to_device(padded, torch.long, dev).view(len(fill), width)
            used = torch.arange(cap, device=dev)[None, :] < fl[:, None]
            self.mask[rows] = torch.where(used, 0.0, float("-inf"))
            for r, x in zip(fill, fill_slots):
                lens[r] = len(x)
        self._set_next(torch.arange(len(lens), device=dev) * cap + to_device(lens, torch.long, dev))
        self.longest = max(lens[:n])
        return self.longest


@dataclass
class _TorchPlan:
    # single-token sequences: rows [0, R) of the decode table, padded to the longest view
    dec_rows: torch.Tensor | None = None  # [R] query rows of T (None: all rows, in order)
    dec_n: int = 0  # R
    dec_len: int = 0  # the longest view (L)
    dec_flat: torch.Tensor | None = None  # [R * L] int64 the rows' slots (set by the first attend)
    dec_mask: torch.Tensor | None = None  # [R, 1, 1, L] additive mask in q's dtype (idem)
    dec_bump: tuple[torch.Tensor, torch.Tensor] | None = None  # mirror positions, slots [R] (idem)
    # multi-token rows: each sequence's view padded to a dense tensor, causal inside the chunk
    gather: torch.Tensor | None = None  # [B, Lmax] slot ids (padded with 0)
    mask: torch.Tensor | None = None  # [B, 1, Qmax, Lmax] bool
    q_index: torch.Tensor | None = None  # [B, Qmax] row of T (padded with 0)
    q_valid: torch.Tensor | None = None  # [B, Qmax] bool


@dataclass
class _Mirror:
    # one layer's copy of the decode rows' K/V: [rows_cap, len_cap, Hkv, D] each (the decode
    # table's capacities), valid for the table as it was at plan step `synced`
    k: torch.Tensor
    v: torch.Tensor
    synced: int | None = None

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class TorchAttention(AttentionBackend):
    """Reference backend built on ``torch.nn.functional.scaled_dot_product_attention`` with
    explicit masks.

    Single-token rows (decode steps) attend over their own views, gathered from the
    :class:`DecodeTable` the backend keeps across steps (a row's slots are appended to, not
    rebuilt, while its view only grows): one batched attention over ``[R, L]`` padded keys,
    read from a per-layer copy of the rows' K/V that a plain decode step appends ``R`` tokens
    to (:meth:`_mirrored`; up to :attr:`mirror_bytes`, else gathered from the cache). (Gathering the union of the views once and masking every row against it reads shared
    pages once but computes ``R x union`` scores, which on a CPU costs more than the repeated
    gathers.) Multi-token rows (prefill chunks, inserted tags) gather their view into a padded
    dense tensor, with the chunk's tokens masked causally, planned every step."""

    name = "torch"
    #: bytes all layers' K/V mirrors may take together (see :meth:`_mirrored`); past it the
    #: rows are gathered from the cache every step
    mirror_bytes = 64 * 2**20

    def __init__(self) -> None:
        self.device = torch.device("cpu")  # until configure() says otherwise
        self._plan: _TorchPlan | None = None
        self._table: DecodeTable | None = None
        self._mirrors: dict[tuple, _Mirror] = {}  # per layer's cache: (data_ptr, shape, dtype) -> mirror

    def plan(self, meta: AttentionMetadata) -> bool:
        device = self.device
        pl = _TorchPlan()
        dec, ext = meta.decode_seqs, meta.extend_seqs
        slots = meta.row_slots()
        dec_slots = slots if meta.is_decode else [slots[r] for r in meta.decode_rows]
        ps = meta.page_size
        if self._table is None or self._table.device != device:
            self._table = DecodeTable(device)
        if dec:
            pl.dec_len = self._table.update(meta, dec, dec_slots)
            pl.dec_n = len(dec)
            if ext:
                pl.dec_rows = to_device(meta.decode_rows, torch.long, device)
        else:
            self._table.history.forget(meta.step)
            self._table.bumped = None
        if ext:
            starts = meta.q_starts()
            q_len = torch.tensor([meta.q_lens[b] for b in ext])
            kv_len = torch.tensor([meta.kv_len(b) for b in ext])
            qmax, lmax = int(q_len.max()), int(kv_len.max())
            gather = torch.zeros(len(ext), lmax, dtype=torch.long)
            for i, b in enumerate(ext):
                gather[i, : int(kv_len[i])] = torch.tensor(view_slots(meta.runs[b], ps), dtype=torch.long)
            qi, kj = torch.arange(qmax), torch.arange(lmax)
            # query i of a sequence sees key j iff j <= kv_len - q_len + i
            limit = (kv_len - q_len)[:, None] + qi[None, :]
            q_valid = qi[None, :] < q_len[:, None]
            mask = (kj[None, None, :] <= limit[:, :, None]) & q_valid[:, :, None]
            mask[:, :, 0] |= ~q_valid  # padded rows attend to one key (discarded) to avoid NaN
            first = torch.tensor([starts[b] for b in ext])
            q_index = torch.where(q_valid, first[:, None] + qi[None, :], torch.zeros_like(qi)[None, :])
            pl.gather, pl.mask = gather.to(device), mask[:, None].to(device)
            pl.q_index, pl.q_valid = q_index.to(device), q_valid.to(device)
        self._plan = pl
        return True

    def decode_views(self) -> list[list[int]]:
        """The current plan's decode rows as slot lists (tests: compare with a fresh plan)."""
        pl, t = self._plan, self._table
        if pl is None or not pl.dec_n:
            return []
        return [t.slots[r, : t.lens[r]].tolist() for r in range(pl.dec_n)]

    def _dec_flat(self, pl: _TorchPlan) -> torch.Tensor:
        """The decode rows' slots ``[R * L]`` int64 (padding: slot 0), made once per step."""
        if pl.dec_flat is None:
            pl.dec_flat = self._table.slots[: pl.dec_n, : pl.dec_len].reshape(-1)
        return pl.dec_flat

    def _mirrored(self, pl: _TorchPlan, k_cache: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decode rows' keys and values ``[R, L, Hkv, D]`` (views of this layer's
        :class:`_Mirror`), or None when the mirrors would pass :attr:`mirror_bytes`.

        The mirror holds, for each decode-table row, a copy of its view's K/V. After a step in
        which every row only grew by its new token (:attr:`DecodeTable.bumped`) it takes just
        those ``R`` tokens from the cache (written by this step's :meth:`rope_and_write`);
        after any other step (forks, joins, new threads, a grown table, a step without a plan
        number) it is gathered again from the cache. The values are the gathered ones, so the
        attention is bitwise the same (padding holds finite stale values, masked to -inf as
        before)."""
        table, n, length = self._table, pl.dec_n, pl.dec_len
        key = (k_cache.data_ptr(), tuple(k_cache.shape), k_cache.dtype)
        m = self._mirrors.get(key)
        cap = tuple(table.slots.shape)
        if m is None or tuple(m.k.shape[:2]) != cap:
            nbytes = 2 * cap[0] * cap[1] * kf[0].numel() * kf.element_size()
            others = sum(x.nbytes for k2, x in self._mirrors.items() if k2 != key)
            if others + nbytes > self.mirror_bytes:
                self._mirrors.pop(key, None)
                return None
            shape = (*cap, *kf.shape[1:])
            m = _Mirror(torch.zeros(shape, dtype=kf.dtype, device=kf.device),
                        torch.zeros(shape, dtype=vf.dtype, device=vf.device))
            self._mirrors[key] = m
        step = table.step
        if step is None or m.synced != step:
            if step is not None and m.synced == step - 1 and table.bumped is not None:
                if pl.dec_bump is None:  # once per step: flat mirror positions of the new tokens, their slots
                    pl.dec_bump = (table.next[:n] - 1, to_device(table.bumped, torch.long, table.device))
                at, new = pl.dec_bump
                m.k.view(-1, *kf.shape[1:]).index_copy_(0, at, kf.index_select(0, new))
                m.v.view(-1, *vf.shape[1:]).index_copy_(0, at, vf.index_select(0, new))
            else:
                flat = self._dec_flat(pl)
                m.k[:n, :length] = kf.index_select(0, flat).view(n, length, *kf.shape[1:])
                m.v[:n, :length] = vf.index_select(0, flat).view(n, length, *vf.shape[1:])
            m.synced = step
        return m.k[:n, :length], m.v[:n, :length]

    def attend(self, q, k_cache, v_cache, scale, *, sliding_window=None, logit_softcap=None, positions=None,
               key_positions=None):
        pl = self._plan
        if pl is None:
            raise RuntimeError("TorchAttention.attend before plan()")
        check_attention_options(sliding_window, logit_softcap, positions, key_positions, q, k_cache)
        t, hq, d = q.shape
        hkv = k_cache.shape[2]
        kf, vf = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
        kpos = key_positions.reshape(-1) if sliding_window is not None else None
        if pl.dec_n:
            n, length = pl.dec_n, pl.dec_len
            table = self._table
            kv = self._mirrored(pl, k_cache, kf, vf)
            if kv is None:
                flat = self._dec_flat(pl)
                kv = kf.index_select(0, flat).view(n, length, hkv, d), vf.index_select(0, flat).view(n, length, hkv, d)
            k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [R, Hkv, L, D]
            if k.dtype != q.dtype:
                k, v = k.to(q.dtype), v.to(q.dtype)
            rows = pl.dec_rows
            qd = (q if rows is None else q.index_select(0, rows)).unsqueeze(2)  # [R, Hq, 1, D]
            if kpos is not None:  # key position inside the row's window
                row_pos = positions if rows is None else positions[rows]
                mask = table.mask[:n, :length].masked_fill(
                    kpos[self._dec_flat(pl)].view(n, length) <= row_pos[:, None] - sliding_window, float("-inf"))
                mask = mask.view(n, 1, 1, length).to(q.dtype)
            else:
                if pl.dec_mask is None or pl.dec_mask.dtype != q.dtype:  # [R, 1, 1, L], once per step
                    pl.dec_mask = table.mask[:n, :length].view(n, 1, 1, length).to(q.dtype)
                mask = pl.dec_mask
            out = _attention(qd, k, v, mask, scale, logit_softcap).select(2, 0)
            if rows is None and pl.gather is None:
                return out
        res = torch.empty_like(q)
        if pl.dec_n:
            res[pl.dec_rows] = out
        if pl.gather is not None:
            k = kf[pl.gather].transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
            v = vf[pl.gather].transpose(1, 2).to(q.dtype)
            qd = q[pl.q_index].transpose(1, 2)  # [B, Hq, Qmax, D]
            mask = pl.mask
            if kpos is not None:  # [B, 1, Qmax, L]; padded rows keep their one key
                inside = kpos[pl.gather][:, None, :] > positions[pl.q_index][:, :, None] - sliding_window
                mask = mask & (inside | ~pl.q_valid[:, :, None])[:, None]
            out = _attention(qd, k, v, mask, scale, logit_softcap).transpose(1, 2)
            res[pl.q_index[pl.q_valid]] = out[pl.q_valid]
        return res
