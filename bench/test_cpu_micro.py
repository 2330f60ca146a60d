"""CPU microbenchmarks of the host-side work on the decode hot path (pytest-benchmark).

Run: ``pytest bench/test_cpu_micro.py --benchmark-json bench/results/cpu_micro.json``.
Not part of the test suite (which never asserts timings)."""

from __future__ import annotations

from pasta_engine.core.block_manager import BlockManager, KVView
from pasta_engine.lang.tags import TagParser, promise_tag
from pasta_engine.triton_kernels.tree_attention import plan_lists


def _forest(threads: int, prefix: int, suffix: int):
    bm = BlockManager((prefix + threads * (suffix + 32)) // 16 + 4, 16)
    main = KVView()
    bm.append(main, prefix)
    views = [main] + [bm.fork(main) for _ in range(threads - 1)]
    for v in views:
        bm.append(v, suffix)
    return [[(s.id, s.pages, s.lens) for s in v.segments] for v in views]


def test_tag_parser_per_token(benchmark):
    text = ("Intro text. " + promise_tag("a topic", 30) + "<async>chunk content here</async>\n") * 40 + "<sync/>"
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]

    def run():
        p = TagParser()
        for piece in pieces:
            p.feed(piece)

    benchmark.extra_info["pieces"] = len(pieces)
    benchmark(run)


def test_plan_tree_16_threads_16k_prefix(benchmark):
    views = _forest(16, 16384, 256)
    benchmark(lambda: plan_lists(views, group=4, num_kv_heads=8, device="cpu", mode="tree", target_work=66))


def test_plan_plain_16_threads_16k_prefix(benchmark):
    views = _forest(16, 16384, 256)
    benchmark(lambda: plan_lists(views, group=4, num_kv_heads=8, device="cpu", mode="plain", target_work=66))


def test_plan_tree_1_thread_4k(benchmark):
    views = _forest(1, 4096, 16)
    benchmark(lambda: plan_lists(views, group=4, num_kv_heads=8, device="cpu", mode="tree", target_work=66))
