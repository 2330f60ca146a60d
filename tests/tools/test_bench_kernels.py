"""``pasta-engine bench kernels`` (issue 31 item 7) on the CPU, under Triton's interpreter: the
kernels are checked against a float32 reference at small shapes and the record says its times
are the interpreter's; bad shapes and bf16 on the CPU are one error naming the flag. The kernel
API's docstring example runs as written."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pasta_engine.entrypoints.cli import main


def test_bench_kernels_checks_every_kernel_and_writes_json(tmp_path, capsys):
    out = tmp_path / "k.json"
    rc = main(["bench", "kernels", "--threads", "1", "3", "--prefix", "40", "--suffix", "0", "9", "--heads", "4",
               "--kv-heads", "2", "--head-dim", "16", "--page-size", "4", "--repeats", "2", "--warmup", "0",
               "--device", "cpu", "--out", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"]["threads"], r["shape"]["suffix"]) for r in rows] == [(1, 0), (1, 9), (3, 0), (3, 9)]
    for r in rows:
        assert r["interpreter"] and r["physical_limit_us"] is None and "not a performance figure" in r["note"]
        assert r["repeats_unit"] == "calls" and all(k["calls"] == r["repeats"] for k in r["kernels"].values())
        assert set(r["kernels"]) == {"tree", "plain", "sdpa_per_thread"}
        for k in r["kernels"].values():
            assert k["max_abs_error"] <= r["tolerance_abs"] and k["calls"] == 2 and k["p10_us"] <= k["p90_us"]
        t, p, s = r["shape"]["threads"], r["shape"]["prefix"], r["shape"]["suffix"]
        per_token = 2 * 2 * 16 * 2  # K and V, 2 KV heads x 16 dims, fp16
        assert r["tree_bytes"] == (p + t * s) * per_token + 2 * t * 4 * 16 * 2
        assert r["plain_bytes"] - r["tree_bytes"] == (t - 1) * p * per_token  # the prefix read once, not per thread
    assert "T=3 P=40 S=9 float16: tree" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--dtype", "bfloat16"], "bfloat16 on the CPU"),
    (["--heads", "5", "--kv-heads", "2"], "heads=5"),
    (["--prefix", "0", "--suffix", "0"], "prefix and suffix are both 0"),
])
def test_bench_kernels_refuses_what_it_cannot_measure(flags, message, capsys):
    rc = main(["bench", "kernels", "--device", "cpu", "--repeats", "1", "--threads", "1", "--prefix", "8",
               "--heads", "2", "--kv-heads", "1", "--head-dim", "16", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_bench_kernels_device_cuda_without_a_gpu_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same everywhere, GPU or not
    assert main(["bench", "kernels", "--device", "cuda"]) == 2
    assert "no CUDA GPU is visible" in capsys.readouterr().err


def test_the_kernel_docstring_example_runs():
    from pasta_engine.triton_kernels import tree_attention

    doc = tree_attention.tree_decode_attention.__doc__
    code = re.search(r"Example.*?::\n\n(.*)", doc, re.S).group(1)
    ns: dict = {}
    exec(compile("\n".join(line[8:] for line in code.splitlines()), "example", "exec"), ns)
    out, q, k, v = ns["out"], ns["q"], ns["k"], ns["v"]
    assert out.shape == (2, 4, 16)
    # row 1 against SDPA over its context: pages 0 and 1 (8 tokens) and 2 tokens of page 3
    ctx_k = torch.cat([k[0], k[1], k[3, :2]]).float()  # [10, 2, 16]
    ctx_v = torch.cat([v[0], v[1], v[3, :2]]).float()
    want = torch.nn.functional.scaled_dot_product_attention(
        q[1:2, :, None].float(), ctx_k.transpose(0, 1)[None], ctx_v.transpose(0, 1)[None], scale=16 ** -0.5,
        enable_gqa=True)[0, :, 0]
    torch.testing.assert_close(out[1].float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("times", [[100.0, 200.0], [100.0, 110.0, 300.0], [100.0, 101.0, 102.0, 103.0, 400.0], [7.0]])
def test_the_deciles_lie_within_the_measured_times(times):
    """A CPU run times one call per repeat: with a few, the 'exclusive' deciles extrapolated
    below the fastest call and above the slowest."""
    from pasta_engine.tools.bench_kernels import _summary

    s = _summary(times)
    assert s["min_us"] <= s["p10_us"] <= s["median_us"] <= s["p90_us"] <= s["max_us"]
    assert (s["min_us"], s["max_us"], s["calls"]) == (min(times), max(times), len(times))
    if len(times) == 2:
        assert (s["p10_us"], s["p90_us"]) == pytest.approx((110.0, 190.0))  # interpolated between the two


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("prefix, suffix", [(32, 20), (20, 20), (8, 20), (5, 1), (40, 9), (0, 20), (20, 0), (16, 0)])
def test_the_flashinfer_cascade_plan_describes_each_threads_true_tokens(threads, prefix, suffix):
    """FlashInfer's cascade (GPU only, not installed here) is planned from the views' true page
    lengths: for every thread, its levels' pages (full but each request's last) are exactly
    its KV, the prefix's partial last page included (a prefix that is not a multiple of the
    page size was planned as full pages: 12 tokens too many at prefix 20)."""
    from pasta_engine.tools.bench_kernels import KernelShape, _forest, cascade_levels

    shape = KernelShape(threads=threads, prefix=prefix, suffix=suffix, heads=2, kv_heads=1, head_dim=16,
                        page_size=16, dtype="float32")
    _, _, views, _ = _forest(shape, torch.device("cpu"))
    levels = cascade_levels(views, shape)
    assert 1 <= len(levels) <= 2
    if threads > 1:  # the shared prefix's level, then the threads' own pages': each only when it has tokens
        assert len(levels) == (prefix > 0) + (suffix > 0)
    for lv in levels:
        requests = len(lv["qo_indptr"]) - 1
        assert lv["qo_indptr"][0] == 0 and lv["qo_indptr"][-1] == threads
        assert len(lv["kv_indptr"]) == requests + 1 and len(lv["kv_last_page_len"]) == requests
        assert lv["kv_indptr"][-1] == len(lv["kv_indices"])
        assert all(1 <= n <= shape.page_size for n in lv["kv_last_page_len"])
    for i, vw in enumerate(views):
        described = []
        for lv in levels:
            r = next(j for j in range(len(lv["qo_indptr"]) - 1) if lv["qo_indptr"][j] <= i < lv["qo_indptr"][j + 1])
            pages = lv["kv_indices"][lv["kv_indptr"][r]:lv["kv_indptr"][r + 1]]
            described += [(p, shape.page_size if k < len(pages) - 1 else lv["kv_last_page_len"][r])
                          for k, p in enumerate(pages)]
        assert described == list(zip(vw.pages, vw.lens))  # the thread's pages, with their true lengths
        assert sum(n for _, n in described) == prefix + suffix
