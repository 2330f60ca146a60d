"""GPU checks of the engine (run on the GPU machine: ``pytest -m gpu``): the Triton backend
against the torch reference, CUDA graphs against eager, the CUDA extension against Triton."""

from __future__ import annotations

import pytest
import torch

from pasta_engine import Engine, SamplingParams

pytestmark = pytest.mark.gpu

from sample_traces import ANNOTATED  # noqa: E402  (tests/sample_traces.py)


@pytest.fixture(scope="module")
def tiny_cuda(tmp_path_factory):
    from pasta_engine.tools.presets import build_checkpoint

    return build_checkpoint("tiny-llama", tmp_path_factory.mktemp("tiny-cuda"), overrides={"head_dim": 64,
                            "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2})


def _replay(path, **kw):
    engine = Engine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, kv_cache_bytes=64 * 2**20, **kw)
    [r] = engine.replay([[5 + i for i in range(40)]], [ANNOTATED], params=SamplingParams(return_logprobs=True))
    return engine, r


def test_triton_backend_matches_torch_on_cuda(tiny_cuda):
    _, ref = _replay(tiny_cuda, attention_backend="torch")
    _, got = _replay(tiny_cuda, attention_backend="triton", cuda_graphs=False)
    assert got.token_ids == ref.token_ids
    assert got.stats.decode_steps == got.stats.critical_path
    diffs = [abs(a - b) for a, b in zip(ref.logprobs, got.logprobs) if a is not None]
    assert max(diffs) < 0.05


def test_cuda_graphs_match_eager(tiny_cuda):
    _, eager = _replay(tiny_cuda, attention_backend="triton", cuda_graphs=False)
    engine, graphed = _replay(tiny_cuda, attention_backend="triton", cuda_graphs=True)
    assert engine.model_runner.cuda_graphs.replays > 0
    assert graphed.token_ids == eager.token_ids
    for a, b in zip(eager.logprobs, graphed.logprobs):
        if a is not None:
            assert abs(a - b) < 1e-2
    params = SamplingParams(max_new_tokens=48, temperature=0.0)
    e2 = Engine.from_pretrained(tiny_cuda, device="cuda", dtype=torch.bfloat16, attention_backend="triton",
                                cuda_graphs=False, kv_cache_bytes=64 * 2**20)
    prompts = [[7, 8, 9], [10, 11, 12, 13], [14]]
    assert [r.token_ids for r in engine.generate(prompts, params)] == [r.token_ids for r in e2.generate(prompts, params)]


def test_csrc_merge_and_kv_write_match_triton(tiny_cuda):
    from pasta_engine.layers import csrc_ops
    from pasta_engine.layers.triton_attention import TritonAttention

    if not csrc_ops.available():
        pytest.skip(f"CUDA extension not built: {csrc_ops.unavailable_reason()} ({csrc_ops.BUILD_COMMAND})")
    _, tri = _replay(tiny_cuda, attention_backend="triton", cuda_graphs=False)
    _, ext = _replay(tiny_cuda, attention_backend=TritonAttention(merge="csrc", kv_write="csrc"), cuda_graphs=False)
    assert ext.token_ids == tri.token_ids
    assert max(abs(a - b) for a, b in zip(tri.logprobs, ext.logprobs) if a is not None) < 1e-2
