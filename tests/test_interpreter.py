"""Interpreter + scheduler + KV cache driven by a scripted model (no weights).

The scripted model returns logits whose argmax is a token drawn at random from a vocabulary of
tag fragments, so greedy decoding writes random PASTA-LANG, well-formed or not. Every step it
checks that each view ends with the row's own new slots and only holds slots that were written
before or are written in this very step."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_engine.attention import AttentionBackend
from pasta_engine.interpreter import Interpreter, Limits, PositionPolicy, plan_replay
from pasta_engine.kv_cache import KVCache, kv_bytes_per_token
from pasta_engine.metrics import critical_path, simulate_steps
from pasta_engine.sampling import SamplingParams
from pasta_engine.scheduler import Request, Scheduler

PIECES = [
    "a", "b", " ", "\n", "<", ">", "/", "é"[:1], "<promise", ' topic="x"', ' tokens="', "1", "0", '"/>',
    '<promise topic="t" tokens="20"/>', '<promise topic="u" tokens="0"/>', "<sync/>", "</async>", "<async>",
    "async", "sync", "</", "<EOS>",
]
EOS = PIECES.index("<EOS>")
VOCAB = len(PIECES)
WEIGHTS = [0.1 if i == EOS else 1.0 for i in range(VOCAB)]  # responses of ~200 tokens


def decode(ids):
    return "".join(PIECES[i] for i in ids if i != EOS)


def encode_pieces(text):
    """Greedy longest-match encoding over PIECES (only used for the fixed '<async>' tag)."""
    out, i = [], 0
    while i < len(text):
        best = max((j for j, p in enumerate(PIECES) if p and j != EOS and text.startswith(p, i)), key=lambda j: len(PIECES[j]))
        out.append(best)
        i += len(PIECES[best])
    return out


OPEN = encode_pieces("<async>")
CLOSE_LEN = len(encode_pieces("</async>"))


class ScriptedModel:
    def __init__(self, rng: random.Random, kv: KVCache):
        self.device = torch.device("cpu")
        self.rng = rng
        self.kv = kv
        self.written: set[int] = set()
        alloc = kv.pool.alloc
        page_size = kv.page_size

        def tracking_alloc():
            p = alloc()
            self.written.difference_update(range(p * page_size, (p + 1) * page_size))
            return p

        kv.pool.alloc = tracking_alloc

    def forward(self, input_ids, meta, kv_cache, backend, logits_indices):
        slots = meta.slot_mapping.tolist()
        assert len(set(slots)) == len(slots), "two new tokens share a slot"
        now = self.written | set(slots)
        at = 0
        for b, q_len in enumerate(meta.q_lens):
            pages, lens = meta.pages(b), meta.page_lens(b)
            flat = [p * meta.page_size + o for p, n in zip(pages, lens) for o in range(n)]
            assert flat[-q_len:] == slots[at : at + q_len], "new tokens are not the end of the view"
            missing = set(flat) - now
            assert not missing, f"view reads unwritten slots {sorted(missing)[:5]}"
            at += q_len
        self.written |= set(slots)
        n = len(logits_indices)
        logits = torch.zeros(n, VOCAB)
        for i in range(n):
            logits[i, self.rng.choices(range(VOCAB), WEIGHTS)[0]] = 1.0
        return logits


class NoAttention(AttentionBackend):
    def plan(self, meta, device):
        pass


def run_scripted(seed: int, limits: Limits, n_requests: int = 1, pages: int = 256, page_size: int = 4):
    rng = random.Random(seed)
    per_page = page_size * kv_bytes_per_token(1, 1, 2, torch.float32)
    kv = KVCache(1, 1, 2, dtype=torch.float32, device="cpu", budget_bytes=pages * per_page, page_size=page_size)
    model = ScriptedModel(rng, kv)
    sched = Scheduler(model, kv, NoAttention(), max_running_requests=n_requests)
    reqs = []
    for i in range(n_requests):
        prompt = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 9))]

        def make(prompt=prompt):
            return Interpreter(prompt, decode=decode, eos_ids=[EOS], open_ids=OPEN, close_len=CLOSE_LEN, limits=limits)

        r = Request(index=i, params=SamplingParams(max_new_tokens=limits.max_new_tokens), make_interpreter=make)
        sched.add(r)
        reqs.append(r)
    finished = []
    for _ in range(10_000):
        if sched.idle:
            break
        finished += sched.step()
    assert sched.idle, "scheduler did not finish"
    assert len(finished) == n_requests
    assert all(rc == 0 for rc in kv.pool.refcount), "KV pages leaked"
    assert kv.pool.num_free == kv.num_pages
    return reqs


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    max_new=st.integers(1, 150),
    width=st.sampled_from([None, 1, 2, 3]),
    min_cap=st.integers(1, 12),
    max_forks=st.integers(0, 6),
    n_requests=st.integers(1, 3),
)
def test_fuzzed_tag_streams_never_break_the_engine(seed, max_new, width, min_cap, max_forks, n_requests):
    limits = Limits(max_new_tokens=max_new, max_threads=width, async_min_cap=min_cap, cap_factor=0.1, max_forks=max_forks)
    for r in run_scripted(seed, limits, n_requests):
        it = r.interp
        st_ = it.structure()
        assert it.total_sampled == st_.tokens <= max_new
        assert r.steps == simulate_steps(st_, width)
        if width is None:
            assert r.steps == critical_path(st_)
        sp = it.spliced()
        assert len(sp.ids) == len(sp.positions) == len(sp.threads)
        # every forked child ran at most its cap
        for t in it.threads[1:]:
            assert t.n_sampled <= t.cap


def test_preemption_under_a_small_cache_frees_everything():
    limits = Limits(max_new_tokens=80, max_threads=None, async_min_cap=4, cap_factor=0.5)
    reqs = run_scripted(7, limits, n_requests=3, pages=40, page_size=4)
    assert sum(r.preemptions for r in reqs) > 0
    assert all(r.interp.done for r in reqs)


def make_interp(**kw):
    kw.setdefault("decode", decode)
    return Interpreter([0, 1], eos_ids=[EOS], open_ids=OPEN, close_len=CLOSE_LEN, **kw)


def feed_main(it: Interpreter, pieces: list[str]):
    for p in pieces:
        it.rows()
        it.take_events()
        it.on_token(it.main, PIECES.index(p))


@pytest.mark.parametrize(
    "policy, main_next",
    [("predicted", 3 + len(OPEN) + 20 + CLOSE_LEN), ("constant:7", 3 + len(OPEN) + 7 + CLOSE_LEN), ("none", 3)],
)
def test_positions_after_a_promise(policy, main_next):
    it = make_interp(policy=policy)
    feed_main(it, ["a", '<promise topic="t" tokens="20"/>'])
    # prompt at 0,1; "a" at 2; the promise token at 3 (forwarded next step)
    child = it.threads[1]
    assert child.promise.topic == "t"
    assert child.pending_pos == list(range(4, 4 + len(OPEN)))  # right after the promise
    assert it.main.pending_pos == [3]
    feed_main(it, ["b"])
    assert it.main.pending_pos == [main_next + 1]


def test_oracle_needs_replay_and_bad_settings_are_named():
    with pytest.raises(ValueError, match="oracle"):
        make_interp(policy="oracle")
    with pytest.raises(ValueError, match="position policy 'constant:x'"):
        PositionPolicy.parse("constant:x")
    with pytest.raises(ValueError, match="max_threads=0"):
        Limits(max_threads=0)
    with pytest.raises(ValueError, match="cap_factor"):
        Limits(cap_factor=float("nan"))
    with pytest.raises(ValueError, match="unknown mode"):
        make_interp(mode="fast")
    with pytest.raises(ValueError, match="empty prompt"):
        Interpreter([], decode=decode, eos_ids=[EOS], open_ids=OPEN, close_len=CLOSE_LEN)


def test_fork_cap_turns_promises_into_text():
    it = make_interp(limits=Limits(max_forks=1))
    feed_main(it, ['<promise topic="t" tokens="20"/>', '<promise topic="u" tokens="0"/>'])
    assert len(it.threads) == 2
    assert any("fork cap 1 reached" in d for d in it.diagnostics)


def test_sync_waits_then_joins():
    it = make_interp(limits=Limits(max_threads=None))
    feed_main(it, ['<promise topic="t" tokens="20"/>', "<sync/>"])
    assert it.main.status.value == "stalled"
    rows = it.rows()
    assert [r.thread.tid for r in rows] == [1]  # only the child runs
    it.take_events()
    it.on_token(it.threads[1], PIECES.index("</async>"))
    ev = it.take_events()
    assert [type(e).__name__ for e in ev] == ["Append", "Join"]  # flush slot, then the join
    rows = it.rows()
    assert [(r.thread.tid, r.sample) for r in rows] == [(1, False), (0, True)]


def test_plan_replay_matches_the_closed_form():
    ann = "b" + '<promise topic="t" tokens="20"/>' + "<async>ab</async>" + "a<sync/>b"
    plan = plan_replay(ann, encode_pieces, decode, EOS)
    assert plan.steps == critical_path(plan.structure)
    assert plan.structure.forks == [(2, len(encode_pieces("ab</async>")))]
    assert plan.spliced_ids == encode_pieces('b<promise topic="t" tokens="20"/>') + OPEN + encode_pieces(
        "ab</async>"
    ) + encode_pieces("a<sync/>b") + [EOS]
    assert decode(plan.spliced_ids) == ann
