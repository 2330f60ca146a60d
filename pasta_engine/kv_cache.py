"""Paged KV cache: a pool of fixed-size pages, reference counts, and per-thread page lists.

Storage: one tensor ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`` (K then
V; FlashInfer's "NHD" page layout). A token's *slot* is ``page * page_size + offset``.

A thread's view (:class:`KVView`) is a list of pages and, per page, how many of its first
slots the thread sees (``lens``). Pages are shared by reference count, never copied:

* fork: the child's view is the parent's view (every page's refcount + 1); the parent's last
  page is *sealed* for both (its visible length is frozen), and each thread's next token starts
  a fresh page. Chosen over copying the partial page so a fork moves no data and every page
  is either shared with a fixed length or private to one writer; the cost is at most one
  partly empty page per fork.
* join (sync): the children's own pages (those after the shared prefix they were forked with)
  are inserted into the parent's view just before its last page, so the parent's newest
  tokens stay at the end of its view (needed for causal masking of a multi-token chunk).
  Order elsewhere in a view does not matter to attention: only visibility and the positions
  baked into the keys do.
* release: a thread's references are dropped; a page returns to the free list at refcount 0.

Pages in the middle of a view can be partly filled (a sealed fork point, a spliced child's
last page), which is why a view carries per-page lengths rather than only a last-page length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["KVCacheExhausted", "PagePool", "KVView", "KVCache", "kv_bytes_per_token"]


class KVCacheExhausted(RuntimeError):
    """No free KV page is left for a request that cannot be preempted."""


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one token across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


@dataclass(eq=False)
class KVView:
    """One thread's view: ``pages[i]`` with its first ``lens[i]`` slots visible.

    ``open_tail``: the thread may append into its last page. ``n_shared``: leading pages it got
    at fork time (the rest are its own, handed to the parent at join)."""

    pages: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    open_tail: bool = False
    n_shared: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.lens)


class PagePool:
    """Free list and reference counts of ``num_pages`` pages of ``page_size`` slots."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        """Take a free page (refcount 1). Raises KVCacheExhausted when none is free."""
        if not self._free:
            raise KVCacheExhausted(f"all {self.num_pages} KV pages are in use")
        p = self._free.pop()
        self.refcount[p] = 1
        return p

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"KV page {p} referenced after it was freed")
            self.refcount[p] += 1

    def decref(self, pages: list[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"KV page {p} released more times than referenced")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)


class KVCache:
    """The KV tensor plus the page pool, and the fork/join/append/release operations.

    Args:
        num_layers, num_kv_heads, head_dim: model shape.
        dtype, device: storage of the cache tensor.
        budget_bytes: memory for the cache tensor; ``num_pages = budget_bytes //
            (page_size * bytes per token)``.
        page_size: slots per page (tokens).

    Raises ValueError when the budget holds less than one page."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        budget_bytes: int,
        page_size: int = 16,
    ):
        per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
        num_pages = int(budget_bytes) // (page_size * per_token)
        if num_pages < 1:
            raise ValueError(
                f"KV cache budget of {budget_bytes} bytes holds no page of {page_size} tokens "
                f"({page_size * per_token} bytes per page)"
            )
        self.budget_bytes = int(budget_bytes)
        self.page_size = page_size
        self.pool = PagePool(num_pages, page_size)
        self.kv = torch.zeros(
            (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    def describe(self) -> str:
        return (
            f"{self.num_pages} pages x {self.page_size} tokens = {self.num_pages * self.page_size} tokens "
            f"({self.budget_bytes / 2**20:.0f} MiB budget)"
        )

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer ``i``: each ``[num_pages, page_size, num_kv_heads, head_dim]``."""
        return self.kv[i, 0], self.kv[i, 1]

    def pages_needed(self, view: KVView, n: int) -> int:
        """New pages an append of ``n`` tokens to ``view`` would take."""
        room = self.page_size - view.lens[-1] if (view.pages and view.open_tail) else 0
        return max(0, -(-(n - room) // self.page_size))

    def append(self, view: KVView, n: int) -> list[int]:
        """Reserve ``n`` slots at the end of ``view`` (allocating pages as needed).

        Returns their slot indices. Raises KVCacheExhausted (naming the budget) when the pool
        runs dry; the view is left unchanged in that case."""
        if self.pages_needed(view, n) > self.pool.num_free:
            raise KVCacheExhausted(
                f"KV cache exhausted: {n} more tokens need {self.pages_needed(view, n)} pages but "
                f"{self.pool.num_free} of {self.describe()} are free; raise kv_cache_bytes or lower the load"
            )
        slots: list[int] = []
        while n > 0:
            if not (view.pages and view.open_tail and view.lens[-1] < self.page_size):
                view.pages.append(self.pool.alloc())
                view.lens.append(0)
                view.open_tail = True
            page, used = view.pages[-1], view.lens[-1]
            take = min(n, self.page_size - used)
            slots.extend(range(page * self.page_size + used, page * self.page_size + used + take))
            view.lens[-1] = used + take
            n -= take
        return slots

    def fork(self, parent: KVView) -> KVView:
        """A child view sharing every page of ``parent``; both tails are sealed."""
        self.pool.incref(parent.pages)
        parent.open_tail = False
        return KVView(pages=list(parent.pages), lens=list(parent.lens), open_tail=False, n_shared=len(parent.pages))

    def join(self, parent: KVView, children: list[KVView]) -> None:
        """Insert each child's own pages into ``parent`` before its last page (no copy)."""
        pages: list[int] = []
        lens: list[int] = []
        for c in children:
            pages += c.pages[c.n_shared :]
            lens += c.lens[c.n_shared :]
        self.pool.incref(pages)
        at = max(len(parent.pages) - 1, 0)
        parent.pages[at:at] = pages
        parent.lens[at:at] = lens

    def release(self, view: KVView) -> None:
        """Drop ``view``'s page references (pages at refcount 0 become free)."""
        self.pool.decref(view.pages)
        view.pages, view.lens, view.open_tail = [], [], False
