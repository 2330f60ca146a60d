"""Block manager: the KV cache's pages, their reference counts, and each thread's page view.

Pages only: the KV tensor itself (``[num_layers, 2, num_pages, page_size, num_kv_heads,
head_dim]``, owned by the model runner) is never touched here, and nothing here imports torch.
A token's *slot* is ``page * page_size + offset``.

A thread's view (:class:`KVView`) is a list of *segments*: runs of pages one thread wrote
between forks and joins, each page with how many of its first slots are used. Segments (and
their pages, by reference count) are shared, never copied:

* fork: the child's view holds the parent's segments (every page's refcount + 1); the parent's
  open segment is *sealed* (its last page's length is frozen for both), and each thread's next
  token starts a segment and page of its own. Chosen over copying the partly filled page so a
  fork moves no data and every page is either shared with a fixed length or private to one
  writer; the cost is at most one partly empty page per fork.
* join (sync): the children's own segments (those after the ones they were forked with) are
  inserted into the parent's view just before its open segment, so the parent's newest tokens
  stay at the end of its view (needed for causal masking of a multi-token chunk). Order
  elsewhere in a view does not matter to attention: only visibility and the positions baked
  into the keys do. Which threads see a segment changes only at forks and joins, which is what
  the tree-attention backend groups its work by.
* release: a thread's references are dropped; a page returns to the free list at refcount 0.

Pages in the middle of a view can be partly filled (a sealed fork point, a spliced child's
last page), which is why a view carries per-page lengths rather than only a last-page length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import KVCacheExhausted

__all__ = ["PagePool", "Segment", "KVView", "BlockManager", "Run"]

#: A view's segment as attention metadata: (segment id, pages, used slots of each page).
Run = tuple[int, list[int], list[int]]


@dataclass(eq=False, slots=True)
class Segment:
    """A run of pages one thread wrote between two forks/joins (``lens[i]`` slots of
    ``pages[i]`` are used). Views share segments by reference: once sealed (after a fork) a
    segment never changes, so every view sees a page with the same length."""

    id: int
    pages: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class KVView:
    """One thread's view: a list of segments (shared ones first), the last of which may be
    ``open`` for this thread's appends. ``n_shared``: leading segments received at fork (the rest
    are its own, handed to the parent at join)."""

    segments: list[Segment] = field(default_factory=list)
    open: Segment | None = None
    n_shared: int = 0
    runs_cache: list[Run] | None = field(default=None, repr=False)  # BlockManager.runs, until segments change

    @property
    def pages(self) -> list[int]:
        """Every page of the view, in view order."""
        return [p for s in self.segments for p in s.pages]

    @property
    def lens(self) -> list[int]:
        """Visible slots of each page of :attr:`pages`."""
        return [n for s in self.segments for n in s.lens]

    @property
    def num_tokens(self) -> int:
        return sum(sum(s.lens) for s in self.segments)


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
        """One more view holds each of ``pages``. Raises RuntimeError for a freed page."""
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"KV page {p} referenced after it was freed")
            self.refcount[p] += 1

    def decref(self, pages: list[int]) -> None:
        """One view fewer holds each of ``pages``; a page at zero is freed. Raises RuntimeError
        when a page is released more times than it was held."""
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"KV page {p} released more times than referenced")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)


class BlockManager:
    """The page pool plus the fork/join/append/release operations on views.

    Args:
        num_pages: pages in the KV cache (the model runner sizes its tensor to match).
        page_size: slots per page (tokens).
        budget_bytes: the memory behind the pages (only for messages).

    Raises ValueError when there is no page."""

    def __init__(self, num_pages: int, page_size: int, budget_bytes: int | None = None):
        self.page_size = page_size
        self.pool = PagePool(num_pages, page_size)
        self.budget_bytes = budget_bytes
        self._next_segment = 0

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def describe(self) -> str:
        """The cache's size in pages, tokens and MiB (for error messages)."""
        mib = f" ({self.budget_bytes / 2**20:.0f} MiB budget)" if self.budget_bytes else ""
        return f"{self.num_pages} pages x {self.page_size} tokens = {self.num_pages * self.page_size} tokens{mib}"
    def pages_needed(self, view: KVView, n: int) -> int:
        """New pages an append of ``n`` tokens to ``view`` would take."""
        seg = view.open
        room = self.page_size - seg.lens[-1] if (seg is not None and seg.pages) else 0
        return max(0, -(-(n - room) // self.page_size))

    def append(self, view: KVView, n: int) -> list[int]:
        """Reserve ``n`` slots at the end of ``view`` (allocating pages as needed).

        Returns their slot indices. Raises KVCacheExhausted (naming the budget) when the pool
        runs dry; the view is left unchanged in that case."""
        seg = view.open
        if n == 1 and seg is not None and seg.pages and seg.lens[-1] < self.page_size:  # a decode step's slot
            used = seg.lens[-1]
            seg.lens[-1] = used + 1
            return [seg.pages[-1] * self.page_size + used]
        need = self.pages_needed(view, n)
        if need > self.pool.num_free:
            raise KVCacheExhausted(
                f"KV cache exhausted: {n} more tokens need {need} pages but "
                f"{self.pool.num_free} of {self.describe()} are free; raise kv_cache_bytes or lower the load"
            )
        if view.open is None:
            view.open = Segment(self._new_id())
            view.segments.append(view.open)
            view.runs_cache = None
        seg = view.open
        slots: list[int] = []
        while n > 0:
            if not seg.pages or seg.lens[-1] == self.page_size:
                seg.pages.append(self.pool.alloc())
                seg.lens.append(0)
            page, used = seg.pages[-1], seg.lens[-1]
            take = min(n, self.page_size - used)
            slots.extend(range(page * self.page_size + used, page * self.page_size + used + take))
            seg.lens[-1] = used + take
            n -= take
        return slots

    def _new_id(self) -> int:
        self._next_segment += 1
        return self._next_segment

    def fork(self, parent: KVView) -> KVView:
        """A child view sharing every segment of ``parent``; the parent's open segment is
        sealed, so each thread's next token starts a segment (and page) of its own."""
        self.pool.incref(parent.pages)
        parent.open = None
        return KVView(segments=list(parent.segments), open=None, n_shared=len(parent.segments))

    def join(self, parent: KVView, children: list[KVView]) -> None:
        """Insert each child's own segments into ``parent`` (no copy): before the parent's open
        segment, which holds its newest tokens, else at the end."""
        own = [seg for c in children for seg in c.segments[c.n_shared :]]
        self.pool.incref([p for seg in own for p in seg.pages])
        at = len(parent.segments) - 1 if parent.open is not None else len(parent.segments)
        parent.segments[at:at] = own
        parent.runs_cache = None

    def release(self, view: KVView) -> None:
        """Drop ``view``'s page references (pages at refcount 0 become free). Releasing a view
        twice is harmless: the view is empty afterwards."""
        self.pool.decref(view.pages)
        view.segments, view.open, view.runs_cache = [], None, None

    @staticmethod
    def runs(view: KVView) -> list[Run]:
        """``view`` as attention metadata: its segments as :data:`Run` tuples, in view order
        (the lists are shared, not copied; the list itself is kept until the view's segments
        change, so read it, never modify it)."""
        if view.runs_cache is None:
            view.runs_cache = [(seg.id, seg.pages, seg.lens) for seg in view.segments]
        return view.runs_cache
