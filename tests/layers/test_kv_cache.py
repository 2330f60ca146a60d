"""The KV cache owns the per-slot key positions (issue 21 item 3): shapes, layer views that
write through, position records that skip padding rows, and no table without windows."""

from __future__ import annotations

import torch

from pasta_engine.layers.kv_cache import KVCache, kv_bytes_per_token


def test_shape_views_and_size():
    cache = KVCache(3, 5, 4, 2, 8, torch.float16, "cpu")
    assert cache.kv.shape == (3, 2, 5, 4, 2, 8) and cache.dtype == torch.float16
    assert (cache.num_layers, cache.num_pages, cache.page_size) == (3, 5, 4)
    assert cache.key_positions is None
    assert cache.nbytes == 5 * 4 * kv_bytes_per_token(3, 2, 8, torch.float16)
    k, v = cache.layer(1)
    assert k.shape == v.shape == (5, 4, 2, 8)
    k[2, 3] = 1.0
    v[0, 0] = 2.0
    assert cache.kv[1, 0, 2, 3].eq(1.0).all() and cache.kv[1, 1, 0, 0].eq(2.0).all()


def test_record_positions_writes_each_slot_and_skips_padding():
    cache = KVCache(1, 3, 4, 1, 4, torch.float32, "cpu", track_positions=True)
    assert cache.key_positions.shape == (3, 4) and cache.key_positions.dtype == torch.int32
    assert cache.nbytes == 3 * 4 * kv_bytes_per_token(1, 1, 4, torch.float32) + (3 * 4 + 1) * 4
    cache.record_positions(torch.tensor([0, 5, -1, 11]), torch.tensor([7, 9, 1000, 42]))
    want = torch.zeros(12, dtype=torch.int32)
    want[0], want[5], want[11] = 7, 9, 42
    assert torch.equal(cache.key_positions.reshape(-1), want)  # the padding row's 1000 is nowhere visible
    cache.record_positions(torch.tensor([5]), torch.tensor([3]))  # a slot reused by another token
    assert cache.key_positions[1, 1] == 3


def test_without_tracking_recording_is_a_no_op():
    cache = KVCache(1, 2, 2, 1, 2, torch.float32, "cpu")
    cache.record_positions(torch.tensor([0, 1]), torch.tensor([4, 5]))
    assert cache.key_positions is None
