"""pasta_engine.layers.linear: the small-batch CPU GEMM orientation choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pasta_engine.layers.linear as lin


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(lin, "_choices", {})


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("with_bias", [False, True])
def test_transposed_product_equals_f_linear(monkeypatch, rows, with_bias):
    monkeypatch.setattr(lin, "_choose", lambda x, w: True)  # force the transposed orientation
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(1024, 256, generator=g)
    x = torch.randn(rows, 256, generator=g)
    b = torch.randn(1024, generator=g) if with_bias else None
    y = lin.linear(x, w, b)
    assert y.shape == (rows, 1024) and y.is_contiguous()
    # entries are sums of 256 products of N(0, 1) values (about 16 in size): float rounding only
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert lin.gemm_choices() == {f"1024x256 float32 {rows}": "W@x^T"}


def test_small_weights_many_rows_and_other_ranks_run_f_linear_bitwise(monkeypatch):
    calls = []
    monkeypatch.setattr(lin, "_choose", lambda x, w: calls.append(1) or True)
    small = torch.randn(64, 32)
    x = torch.randn(3, 32)
    assert torch.equal(lin.linear(x, small), F.linear(x, small))  # below MIN_WEIGHT_ELEMENTS
    big = torch.randn(1024, 256)
    many = torch.randn(lin.MAX_ROWS + 1, 256)
    assert torch.equal(lin.linear(many, big), F.linear(many, big))
    batched = torch.randn(2, 3, 256)  # 3-D input: not a decode batch
    assert torch.equal(lin.linear(batched, big), F.linear(batched, big))
    half = torch.randn(2, 256).half()  # dtype differs from the weight: F.linear raises as usual
    with pytest.raises(RuntimeError):
        lin.linear(half, big)
    assert calls == [] and lin.gemm_choices() == {}


def test_choice_is_made_once_per_shape_and_row_count(monkeypatch):
    seen = []
    monkeypatch.setattr(lin, "_choose", lambda x, w: seen.append((tuple(w.shape), x.shape[0])) or False)
    w = torch.randn(1024, 256)
    for _ in range(3):
        for rows in (1, 2):
            y = lin.linear(torch.ones(rows, 256), w)
            assert torch.equal(y, F.linear(torch.ones(rows, 256), w))  # chose F.linear: bitwise
    assert seen == [((1024, 256), 1), ((1024, 256), 2)]
    assert lin.gemm_choices() == {"1024x256 float32 1": "F.linear", "1024x256 float32 2": "F.linear"}


def test_the_timing_choice_returns_a_bool_and_reads_cold_copies(monkeypatch):
    monkeypatch.setattr(lin, "COLD_BYTES", 4 * 1024 * 256 * 3)  # three copies of the weight
    passes = []
    real = lin._best_of

    def spy(fn, weights, x, repeats=3):
        passes.append(len(weights))
        return real(fn, weights, x, repeats=1)

    monkeypatch.setattr(lin, "_best_of", spy)
    choice = lin._choose(torch.randn(2, 256), torch.randn(1024, 256))
    assert isinstance(choice, bool) and passes == [3, 3]


def test_prepare_chooses_once_for_each_distinct_shape_and_row_count(monkeypatch):
    seen = []
    monkeypatch.setattr(lin, "_choose", lambda x, w: seen.append((tuple(w.shape), x.shape[0])) or False)
    big_a, big_b = torch.randn(1024, 256), torch.randn(512, 512)
    weights = [big_a, big_a.clone(), big_b, torch.randn(8, 8), torch.randn(1024)]  # a copy, a small, a 1-D one
    assert lin.prepare(weights, max_rows=3) == 6
    assert seen == [((1024, 256), r) for r in (1, 2, 3)] + [((512, 512), r) for r in (1, 2, 3)]
    assert lin.prepare(weights, max_rows=3) == 0  # already made


def test_linear_for_picks_f_linear_unless_a_large_cpu_weight_can_take_part():
    small, big = torch.randn(64, 32), torch.randn(1024, 256)
    assert lin.linear_for([small], torch.device("cpu")) is F.linear
    assert lin.linear_for([small, big], torch.device("cpu")) is lin.linear
    assert lin.linear_for([big], torch.device("cuda")) is F.linear  # only a device name: no GPU needed
