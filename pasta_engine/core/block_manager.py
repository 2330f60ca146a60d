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

Automatic prefix caching (vLLM's APC, SGLang's radix cache, over pages): once a prompt's KV is
written, each of its *full* pages is entered in a table under the key ``(entry id of the page
before it, its tokens)`` (:meth:`BlockManager.cache_prefix`); the entry id (a counter, never
reused) names the whole prefix before a page, so the key is exact (no hash collision can hand a
request another prompt's KV) and is the same wherever that prefix was computed. A later prompt
starts its view with the cached pages of its longest matching run of whole pages
(:meth:`BlockManager.reuse_prefix`) and prefills only the rest; the page holding the prompt's
last token is never reused (its logits are sampled, so it must be computed). A cached page is
*full* and sits in a sealed segment, so nothing is ever written to it again: appends go only
to a view's open segment, after its last full page. At refcount 0 a cached page stays in the
table, free but reusable (:attr:`PagePool.num_cached_free`); :meth:`PagePool.alloc` takes
never-cached free pages first, then evicts the least recently released cached page. Every page
is at all times exactly one of: free, cached and free, or held (:meth:`PagePool.audit`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from ..errors import KVCacheExhausted

__all__ = ["PagePool", "Segment", "KVView", "BlockManager", "Run", "PrefixKey"]

#: A view's segment as attention metadata: (segment id, pages, used slots of each page).
Run = tuple[int, list[int], list[int]]

#: A cached page's key: (entry id of the cached page before it, 0 for a prompt's first page;
#: the page's tokens).
PrefixKey = tuple[int, tuple[int, ...]]


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
    """Free list, reference counts and prefix-cache table of ``num_pages`` pages of
    ``page_size`` slots.

    Every page is exactly one of: *free* (refcount 0, in no table), *cached free* (refcount 0,
    still in the prefix-cache table: reusable until evicted, least recently released first)
    or *held* (refcount > 0, cached or not)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self.cached: dict[PrefixKey, int] = {}  # the prefix-cache table: key -> page
        self.key_of: list[PrefixKey | None] = [None] * num_pages
        self.entry_of = [0] * num_pages  # a cached page's entry id (0: not cached)
        self._next_entry = 0
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Pages an :meth:`alloc` can take: free ones and cached ones no view holds."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached(self) -> int:
        """Pages in the prefix-cache table (held or not)."""
        return len(self.cached)

    @property
    def num_cached_free(self) -> int:
        """Cached pages no view holds (counted in :attr:`num_free`; evicted when needed)."""
        return len(self._cached_free)

    def alloc(self) -> int:
        """Take a free page (refcount 1): a never-cached one first, else the least recently
        released cached page, which leaves the table. Raises KVCacheExhausted when none is free."""
        if self._free:
            p = self._free.pop()
        elif self._cached_free:
            p = self._cached_free.popitem(last=False)[0]
            del self.cached[self.key_of[p]]
            self.key_of[p] = None
            self.entry_of[p] = 0
            self.evictions += 1
        else:
            raise KVCacheExhausted(f"all {self.num_pages} KV pages are in use")
        self.refcount[p] = 1
        return p

    def incref(self, pages: list[int]) -> None:
        """One more view holds each of ``pages``. Raises RuntimeError for a freed page."""
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"KV page {p} referenced after it was freed")
            self.refcount[p] += 1

    def decref(self, pages: list[int]) -> None:
        """One view fewer holds each of ``pages``; a page at zero is freed (a cached one stays
        in the table, cached free). Raises RuntimeError when a page is released more times than
        it was held.

        Cached pages this call frees join the eviction order last in first, so a prefix's
        deeper pages (listed after the ones before them in a view) are evicted before the ones
        they extend."""
        cached_free: list[int] = []
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"KV page {p} released more times than referenced")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                if self.key_of[p] is None:
                    self._free.append(p)
                else:
                    cached_free.append(p)
        for p in reversed(cached_free):
            self._cached_free[p] = None

    # ------------------------------------------------------------------ prefix cache

    def lookup(self, key: PrefixKey) -> int | None:
        """The cached page under ``key``, or None."""
        return self.cached.get(key)

    def hold_cached(self, page: int) -> None:
        """One more view holds the cached ``page`` (taken back from cached free at refcount 0)."""
        if self.key_of[page] is None:
            raise RuntimeError(f"KV page {page} is not in the prefix cache")
        if self.refcount[page] == 0:
            del self._cached_free[page]
        self.refcount[page] += 1

    def cache(self, page: int, key: PrefixKey) -> int:
        """Enter the held, full ``page`` in the table under ``key`` (not there yet); returns its
        entry id."""
        if self.refcount[page] <= 0 or self.key_of[page] is not None or key in self.cached:
            raise RuntimeError(f"KV page {page} cannot be cached (refcount {self.refcount[page]}, "
                               f"cached already: {self.key_of[page] is not None or key in self.cached})")
        self._next_entry += 1
        self.cached[key] = page
        self.key_of[page] = key
        self.entry_of[page] = self._next_entry
        return self._next_entry

    def audit(self) -> dict[str, int]:
        """Check that every page is exactly one of free, cached free, held, and that the table
        and the pages agree; returns the four counts (``free``, ``cached_free``, ``held``,
        ``cached``). Raises RuntimeError naming the first inconsistency (tests, debugging)."""
        free, cached_free = set(self._free), set(self._cached_free)
        held = {p for p, r in enumerate(self.refcount) if r > 0}
        if len(free) != len(self._free) or free & cached_free or (free | cached_free) & held:
            raise RuntimeError("a KV page is on two lists")
        if len(free) + len(cached_free) + len(held) != self.num_pages:
            lost = set(range(self.num_pages)) - free - cached_free - held
            raise RuntimeError(f"KV pages unaccounted for: {sorted(lost)[:10]}")
        if any(self.refcount[p] != 0 or self.key_of[p] is not None for p in free):
            raise RuntimeError("a free KV page has a reference or a cache key")
        if any(self.key_of[p] is None for p in cached_free):
            raise RuntimeError("a cached-free KV page has no cache key")
        if {p: k for k, p in self.cached.items()} != {p: k for p, k in enumerate(self.key_of) if k is not None}:
            raise RuntimeError("the prefix-cache table and the pages' keys disagree")
        return {"free": len(free), "cached_free": len(cached_free), "held": len(held), "cached": len(self.cached)}


class BlockManager:
    """The page pool plus the fork/join/append/release operations on views.

    Args:
        num_pages: pages in the KV cache (the model runner sizes its tensor to match).
        page_size: slots per page (tokens).
        budget_bytes: the memory behind the pages (only for messages).
        prefix_caching: reuse the cached pages of prompt prefixes (:meth:`reuse_prefix`,
            :meth:`cache_prefix`); off, both do nothing.

    Counters: ``prefix_queries`` (prompts looked up), ``prefix_query_tokens`` (their tokens),
    ``prefix_hit_tokens`` (tokens reused from the cache instead of prefilled).

    Raises ValueError when there is no page."""

    def __init__(self, num_pages: int, page_size: int, budget_bytes: int | None = None,
                 prefix_caching: bool = False):
        self.page_size = page_size
        self.pool = PagePool(num_pages, page_size)
        self.budget_bytes = budget_bytes
        self.prefix_caching = prefix_caching
        self.prefix_queries = self.prefix_query_tokens = self.prefix_hit_tokens = 0
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

    # ------------------------------------------------------------------ prefix cache

    def reuse_prefix(self, view: KVView, tokens: Sequence[int]) -> int:
        """Start the empty ``view`` of a prompt ``tokens`` (at positions 0, 1, ...) with the
        cached pages of its longest prefix made of whole pages, short of the prompt's last
        token (whose logits are sampled, so it is always computed). The pages form one sealed
        segment of the view (held by reference; never written). Counts the query.

        Returns the number of tokens reused (a multiple of ``page_size``; 0 with caching off)."""
        if view.segments or view.open is not None:
            raise RuntimeError("reuse_prefix needs an empty view")
        self.prefix_queries += 1
        self.prefix_query_tokens += len(tokens)
        if not self.prefix_caching:
            return 0
        ps, pool = self.page_size, self.pool
        pages: list[int] = []
        parent = 0
        for i in range((len(tokens) - 1) // ps):
            p = pool.lookup((parent, tuple(tokens[i * ps : (i + 1) * ps])))
            if p is None:
                break
            pages.append(p)
            parent = pool.entry_of[p]
        if not pages:
            return 0
        seg = Segment(self._new_id(), [], [])
        view.segments.append(seg)
        view.runs_cache = None
        for p in pages:  # each page joins the view as it is held: an interruption leaves none unaccounted
            pool.hold_cached(p)
            seg.pages.append(p)
            seg.lens.append(ps)
        n = len(pages) * ps
        self.prefix_hit_tokens += n
        return n

    def cache_prefix(self, view: KVView, tokens: Sequence[int], n: int) -> int:
        """Enter the whole pages among the first ``n`` tokens of ``view`` in the prefix cache.

        ``view`` must begin with ``tokens[:n]`` at positions 0..n-1 with their KV written (a
        prompt's main thread right after its prefill forward). A page already cached, or whose
        prefix another page holds in the cache, is skipped (the chain goes on through the
        cached one). Returns the pages entered (0 with caching off)."""
        if not self.prefix_caching:
            return 0
        ps, pool = self.page_size, self.pool
        whole = min(n, len(tokens)) // ps
        added = i = parent = 0
        for seg in view.segments:
            for p, used in zip(seg.pages, seg.lens):
                if i >= whole or used != ps:
                    return added
                key = (parent, tuple(tokens[i * ps : (i + 1) * ps]))
                have = pool.lookup(key)
                if have is None:
                    if pool.key_of[p] is not None:  # cached under another prefix: cannot be (defensive)
                        return added
                    parent = pool.cache(p, key)
                    added += 1
                else:
                    parent = pool.entry_of[have]
                i += 1
        return added

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
