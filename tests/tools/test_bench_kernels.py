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
