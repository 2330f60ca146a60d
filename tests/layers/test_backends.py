"""The backend seam: one registry by name (the engine and the CLI read it), the step's shape
classified once in the attention metadata, one incremental-plan rule (PlanHistory)."""

from __future__ import annotations

import pytest

from pasta_engine import Engine, SamplingParams
from pasta_engine.entrypoints.cli import build_parser
from pasta_engine.errors import ParameterError
from pasta_engine.layers import backends
from pasta_engine.layers.attention import AttentionMetadata, PlanHistory
from pasta_engine.layers.reference_attention import TorchAttention
from pasta_engine.layers.backends import backend_info, backend_names, get_backend, graph_backend_names, register_backend


def test_the_registry_names_every_backend():
    assert backend_names()[:3] == ["torch", "triton", "flex"]
    assert graph_backend_names() == ["triton"]
    assert get_backend("flex").name == "flex" and get_backend("torch").name == "torch"


def test_the_cli_offers_every_registered_backend():
    parser = build_parser()
    for name in backend_names():
        assert parser.parse_args(["generate", "--attention-backend", name]).attention_backend == name
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--attention-backend", "flash"])
    generate = next(a for a in parser._actions if a.dest == "command").choices["generate"]
    help_text = " ".join(generate.format_help().split())
    for name in backend_names():
        assert " ".join(backend_info(name).summary.split()) in help_text


def test_an_unknown_backend_is_named_with_the_known_ones():
    with pytest.raises(ParameterError, match=r"attention_backend='flash'.*'torch', 'triton', 'flex'"):
        get_backend("flash")
    inst = TorchAttention()
    assert get_backend(inst) is inst


def test_a_registered_backend_runs_in_the_engine(tiny_engine):
    class Mine(TorchAttention):
        name = "mine"

    register_backend("mine", Mine, "a test backend")
    try:
        assert "mine" in backend_names() and not backend_info("mine").cuda_graphs
        e = Engine(tiny_engine.model, tiny_engine.tokenizer, kv_cache_bytes=2**20, attention_backend="mine")
        assert isinstance(e.model_runner.backend, Mine)
        [res] = e.generate([[1, 40, 41]], SamplingParams(max_new_tokens=3), mode="sequential")
        [want] = tiny_engine.generate([[1, 40, 41]], SamplingParams(max_new_tokens=3), mode="sequential")
        assert res.token_ids == want.token_ids
        with pytest.raises(ParameterError, match=r"an attention backend that runs inside CUDA graphs \(triton, "
                                                 r"not 'mine'\)"):
            Engine(tiny_engine.model, tiny_engine.tokenizer, kv_cache_bytes=2**20, attention_backend="mine",
                   cuda_graphs=True)
    finally:
        backends._REGISTRY.pop("mine")


@pytest.mark.parametrize("q_lens,kind,decode,extend,rows", [
    ([1, 1, 1], "decode", [0, 1, 2], [], [0, 1, 2]),
    ([4, 2], "extend", [], [0, 1], []),
    ([3, 1, 2, 1], "mixed", [1, 3], [0, 2], [3, 6]),
])
def test_the_step_is_classified_once(q_lens, kind, decode, extend, rows):
    meta = AttentionMetadata.from_pages(4, q_lens, [[b] for b in range(len(q_lens))], [[n] for n in q_lens])
    assert (meta.kind, meta.decode_seqs, meta.extend_seqs, meta.decode_rows) == (kind, decode, extend, rows)
    assert meta.is_decode == (kind == "decode")


def test_plan_history_keeps_rows_only_across_consecutive_steps():
    h = PlanHistory()
    m = lambda step: AttentionMetadata(4, [1], [[(1, [0], [1])]], step=step)  # noqa: E731
    assert not h.advance(m(1), [(1, 1), (2, 1)])  # nothing recorded before
    assert h.advance(m(2), [(1, 1), (2, 1)])  # follows, same rows
    assert not h.advance(m(3), [(1, 1), (3, 2)])  # row 1 changed (a join)
    assert [h.kept(0), h.kept(1)] == [True, False]
    assert not h.advance(m(5), [(1, 1), (3, 2)])  # step 4 ran without a plan (a CUDA graph)
    assert not h.kept(0)
    h.forget(6)  # a step without rows to keep
    assert not h.advance(m(7), [(1, 1), (3, 2)]) and not h.kept(0)
    assert not h.advance(m(None), [(1, 1), (3, 2)])  # unnumbered
    assert not h.advance(m(1), [(1, 1), (3, 2)])


def test_cuda_graph_mode_refuses_the_reference_kv_write():
    """CUDA graphs pad their rows with slot -1, which the Triton and CUDA-extension KV writes
    skip and the reference write (``index_copy_``) cannot: graph mode refuses it by name, before
    it needs a device."""
    from pasta_engine.errors import ParameterError
    from pasta_engine.layers.triton_attention import TritonAttention

    with pytest.raises(ParameterError, match="kv_write"):
        TritonAttention(kv_write="torch").for_cuda_graph(4, 16)


def test_the_triton_backend_refuses_a_cache_of_another_page_size_than_its_plan():
    """Metadata with pages of 4 over a cache reshaped to pages of 2 was accepted: the kernel
    took its page size from the cache and dropped slots 2-3 of every page (off by 1.39 against
    the reference backend, which reads the metadata's). It is refused, naming both."""
    import torch

    from pasta_engine.layers.triton_attention import TritonAttention

    backend = TritonAttention()
    backend.configure(4, 2, "cpu", 16)
    meta = AttentionMetadata.from_pages(4, [1, 1], [[1, 0], [2]], [[4, 2], [1]])
    assert backend.plan(meta)
    q = torch.randn(2, 4, 16)
    cache = torch.randn(4, 4, 2, 16)
    assert backend.attend(q, cache, cache, 0.25).shape == (2, 4, 16)  # the planned page size runs
    with pytest.raises(ValueError, match=r"page_size=4.*\(8, 2, 2, 16\)|\(8, 2, 2, 16\).*page_size=4"):
        backend.attend(q, cache.view(8, 2, 2, 16), cache.view(8, 2, 2, 16), 0.25)
