"""Attention cases shared by the backend tests: threads on a real block manager (prompts,
decode rows, forks, joins, chunks), each slot's logical position, and the float32 torch
reference."""

from __future__ import annotations

import random

import torch

from pasta_engine.core.block_manager import BlockManager, KVView
from pasta_engine.layers.attention import AttentionMetadata
from pasta_engine.layers.reference_attention import TorchAttention

HQ, HKV, D = 4, 2, 16
NUM_PAGES = 192


class Forest:
    """Threads on a real block manager, and the logical position of every cache slot (a thread's
    positions follow its view with random gaps, as reserved ranges leave them, so a window cuts
    different rows' views at different places)."""

    def __init__(self, page_size: int, seed: int):
        self.bm = BlockManager(NUM_PAGES, page_size)
        self.page_size = page_size
        self.rng = random.Random(seed)
        self.pos = torch.zeros(NUM_PAGES, page_size, dtype=torch.int32)
        self.next: dict[int, int] = {}  # id(view) -> its next logical position

    def thread(self, tokens: int) -> KVView:
        v = KVView()
        self.next[id(v)] = 0
        self.append(v, tokens)
        return v

    def append(self, v: KVView, n: int) -> list[int]:
        slots = self.bm.append(v, n)
        for s in slots:
            self.pos.view(-1)[s] = self.next[id(v)]
            self.next[id(v)] += 1 + (self.rng.random() < 0.2) * self.rng.randint(1, 4)
        return slots

    def fork(self, parent: KVView, tokens: int) -> KVView:
        child = self.bm.fork(parent)
        self.next[id(child)] = self.next[id(parent)] + self.rng.randint(0, 6)
        self.append(child, tokens)
        return child

    def join(self, parent: KVView, kids: list[KVView]) -> None:
        self.bm.join(parent, kids)
        self.next[id(parent)] = max(self.next[id(v)] for v in [parent, *kids])

    def step(self, views: list[KVView], q_lens: list[int], step: int | None = None
             ) -> tuple[AttentionMetadata, torch.Tensor]:
        """Append ``q_lens[b]`` new tokens to each view: the step's metadata and row positions."""
        slots = [s for v, n in zip(views, q_lens) for s in self.append(v, n)]
        meta = AttentionMetadata(self.page_size, list(q_lens), [BlockManager.runs(v) for v in views], slots=slots,
                                 step=step)
        return meta, self.pos.view(-1)[torch.tensor(slots)].long()


def scenario(name: str, page_size: int, seed: int) -> tuple[Forest, AttentionMetadata, torch.Tensor]:
    f = Forest(page_size, seed)
    rng = f.rng
    if name == "prefill":  # two prompts, each one chunk
        views, q = [KVView(), KVView()], [rng.randint(5, 14), rng.randint(2, 9)]
        for v in views:
            f.next[id(v)] = 0
    elif name == "decode":  # unrelated sequences, one token each
        views = [f.thread(rng.randint(2, 30)) for _ in range(4)]
        q = [1] * 4
    elif name == "forks":  # one prompt shared by a main thread and three children
        main = f.thread(rng.randint(10, 25))
        kids = [f.fork(main, rng.randint(1, 9)) for _ in range(3)]
        views, q = [main, *kids], [1] * 4
    elif name == "joins":  # children joined back: the main view holds their pages before its own
        main = f.thread(rng.randint(6, 20))
        kids = [f.fork(main, rng.randint(2, 9)) for _ in range(3)]
        f.append(main, 2)
        f.join(main, kids[:2])
        views, q = [main, kids[2], f.thread(7)], [1, 1, 1]
    else:  # "mixed": decode rows and multi-token chunks (inserted tags, a prompt) in one step
        main = f.thread(rng.randint(6, 20))
        kids = [f.fork(main, rng.randint(1, 5)) for _ in range(3)]
        f.append(main, 1)
        f.join(main, kids[:1])
        views, q = [main, kids[1], kids[2], KVView()], [3, 1, 2, 6]
        f.next[id(views[-1])] = 0
    meta, positions = f.step(views, q)
    return f, meta, positions


def reference(meta, q, kc, vc, scale, **opts) -> torch.Tensor:
    ref = TorchAttention()
    ref.configure(HQ, HKV, "cpu", D)
    ref.plan(meta)
    return ref.attend(q.float(), kc.float(), vc.float(), scale, **opts)


def tolerance(dtype: torch.dtype) -> dict:
    return dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1e-4, atol=1e-4)


SCENARIOS = ["prefill", "decode", "forks", "joins", "mixed"]
