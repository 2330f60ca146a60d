"""The paged KV cache: every layer's keys and values, and the logical position of every slot.

A *slot* is one token's place in the cache: slot ``s`` is row ``s % page_size`` of page
``s // page_size`` (the block manager hands out pages; the scheduler turns them into slots).
The K/V of a token are written into its slot by the attention backend during the forward
(:meth:`~pasta_engine.layers.attention.AttentionBackend.rope_and_write_qkv`); the token's
logical position is written into the slot's entry of :attr:`KVCache.key_positions` by the
model runner in the same step (:meth:`KVCache.record_positions`), so a sliding-window layer
can tell how far back a key is without knowing which thread wrote it (PASTA positions are
logical, not slot order: docs/DESIGN.md section 2).

Allocated once by the model runner; the model reads it through :meth:`KVCache.layer` and
:attr:`KVCache.key_positions` and never allocates cache state of its own.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache", "kv_bytes_per_token"]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V of one token across all layers (the key-positions table, 4 bytes per
    slot when a model has windows, is not counted)."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class KVCache:
    """K/V tensors of all layers and the per-slot key-positions table.

    Args:
        num_layers, num_pages, page_size, num_kv_heads, head_dim: the cache's shape (pages and
            page rows in tokens).
        dtype, device: the model's.
        track_positions: keep :attr:`key_positions` (a model with a sliding window on some
            layer needs it); without it :meth:`record_positions` does nothing.

    Attributes:
        kv: ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`` in ``dtype``
            (index 0 of the second dim holds K, 1 holds V), zeros at allocation.
        key_positions: int32 ``[num_pages, page_size]``: the logical position of the token in
            every slot (slots never written hold 0 and are in no attention view), or None
            without ``track_positions``. A view of a ``[num_pages * page_size + 1]`` table whose
            last entry takes the writes of padding rows (slot < 0).

    Raises torch.OutOfMemoryError (a RuntimeError) when the tensors do not fit the device."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, track_positions: bool = False):
        device = torch.device(device)
        self.kv = torch.zeros((num_layers, 2, num_pages, page_size, num_kv_heads, head_dim), dtype=dtype,
                              device=device)
        self._positions: torch.Tensor | None = None
        self.key_positions: torch.Tensor | None = None
        if track_positions:
            self._positions = torch.zeros(num_pages * page_size + 1, dtype=torch.int32, device=device)
            self.key_positions = self._positions[:-1].view(num_pages, page_size)

    @property
    def num_layers(self) -> int:
        """Layers held."""
        return self.kv.shape[0]

    @property
    def num_pages(self) -> int:
        """Pages held (the block manager's pool)."""
        return self.kv.shape[2]

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.kv.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        """The K/V dtype (the model's)."""
        return self.kv.dtype

    @property
    def device(self) -> torch.device:
        """Where the cache lives."""
        return self.kv.device

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V tensors and the key-positions table."""
        extra = 0 if self._positions is None else self._positions.numel() * 4
        return self.kv.numel() * self.kv.element_size() + extra

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s ``(k_cache, v_cache)``, each ``[num_pages, page_size, num_kv_heads,
        head_dim]`` (views: writes land in the cache)."""
        k, v = self.kv[i].unbind(0)
        return k, v

    def record_positions(self, slot_mapping: torch.Tensor, positions: torch.Tensor) -> None:
        """Write each new token's logical position into its slot's entry of
        :attr:`key_positions` (no host sync: capturable in a CUDA graph). A no-op without
        ``track_positions``.

        Args:
            slot_mapping: ``[T]`` int64 slot of every token of the step; a negative slot
                (a padding row) writes nothing visible.
            positions: ``[T]`` int64 logical position of every token."""
        table = self._positions
        if table is None:
            return
        dump = torch.full_like(slot_mapping, table.shape[0] - 1)
        table.index_copy_(0, torch.where(slot_mapping >= 0, slot_mapping, dump), positions.to(torch.int32))
