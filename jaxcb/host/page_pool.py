"""The host-side page pool: which pages of the device's KV array are free, and who holds the rest.

Plain Python and numpy, no JAX. A free list gives O(1) allocate and free; reference counts let
several requests hold one page (prefix sharing). Page 0 is the null page that padding points at: it
is never allocated and never freed. Running out of pages is an ordinary answer (`None`), which the
scheduler handles by waiting or preempting.

Cached pages (prefix caching). A full page can be registered under the hash of the tokens it holds
(chained from the start of the sequence, see jaxcb.host.prefix_cache). When its last holder frees it, a
registered page does not go back to the free list but to an LRU list of free-but-cached pages: it
still counts as free, a later request with the same prefix can take it back (`acquire`), and it is
evicted (its hash forgotten) only when `allocate` runs out of plain free pages.
"""

from __future__ import annotations

import collections

import numpy as np

from jaxcb.host.errors import InvalidConfig

NULL_PAGE = 0


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise InvalidConfig(f"num_pages: {num_pages} is too small; the pool needs at least 2 (page 0 is reserved)")
        if page_size < 1:
            raise InvalidConfig(f"page_size: must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._is_free = np.ones(num_pages, dtype=bool)  # plain free pages (not cached)
        self._is_free[NULL_PAGE] = False
        self._num_plain_free = num_pages - 1
        self.ref_counts = np.zeros(num_pages, dtype=np.int32)
        self._page_of: dict[bytes, int] = {}  # hash -> registered page
        self._hash_of: dict[int, bytes] = {}  # registered page -> hash
        self._cached_free: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.num_evictions = 0
        self.events = None  # jaxcb.host.kv_events.KVEvents: told of each eviction and clearing
        # What a registered page knows beyond its K/V: its tokens' prompt logprobs, when a request that
        # asked for them computed it (jaxcb.host.prefix_cache.PageScores), kept as long as the hash is.
        self.scores: dict[bytes, object] = {}

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages an allocation can have: plain free ones and free-but-cached ones."""
        return self._num_plain_free + len(self._cached_free)

    @property
    def num_cached(self) -> int:
        """Registered pages, in use or free-but-cached."""
        return len(self._hash_of)

    @property
    def num_in_use(self) -> int:
        return self.num_usable - self.num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int, after: int | None = None) -> list[int] | None:
        """n fresh pages with one reference each, or None (nothing taken) when too few are free.

        Where they lie matters to the attention, which streams each sequence's pages in order: pages
        whose ids run on are one stretch of memory, which the CPU's prefetchers follow (the native
        attention read K/V from runs of consecutive pages 1.2-1.4x faster than from scattered ones;
        README). So:
        - `after` (the sequence's last page): a growing sequence continues its run, taking the plain
          free pages right after it first.
        - The rest come from the longest run of plain free pages. When a page in use comes right
          before that run, its holder may grow into it: the new pages go to the middle of the room
          left, so both have half of it to grow into (requests that arrive together each get an
          equal stretch).
        - When no run is long enough, the longest runs are taken whole, longest first; then the least
          recently used cached pages are evicted (a sequence's tail before its head, see `free`).
        Each part comes in ascending order."""
        if n > self.num_free:
            return None
        pages: list[int] = []
        if after is not None:
            p = after + 1
            while len(pages) < n and p < self.num_pages and self._is_free[p]:
                pages.append(p)
                p += 1
            self._take(pages)
        if len(pages) < n and self._num_plain_free:
            placed = self._place(n - len(pages))
            self._take(placed)
            pages.extend(placed)
        evicted = []
        while len(pages) + len(evicted) < n:
            page, _ = self._cached_free.popitem(last=False)
            page_hash = self._hash_of.pop(page)
            del self._page_of[page_hash]
            self.scores.pop(page_hash, None)
            self.num_evictions += 1
            if self.events is not None:
                self.events.removed(page_hash)
            evicted.append(page)
        pages.extend(sorted(evicted))
        self.ref_counts[pages] = 1
        return pages

    def _place(self, m: int) -> list[int]:
        """Up to m plain free pages, where `allocate` says, not yet taken."""
        edges = np.flatnonzero(np.diff(self._is_free.view(np.int8), prepend=0, append=0))
        starts, lengths = edges[0::2], edges[1::2] - edges[0::2]
        order = np.argsort(-lengths, kind="stable")  # longest first; the lowest among equals
        best = order[0]
        if lengths[best] >= m:
            start = int(starts[best])
            if self.ref_counts[start - 1] > 0:  # start - 1 >= NULL_PAGE: the null page holds no reference
                start += (int(lengths[best]) - m) // 2
            return list(range(start, start + m))
        pages: list[int] = []
        for i in order:
            take = min(int(lengths[i]), m - len(pages))
            pages.extend(range(int(starts[i]), int(starts[i]) + take))
            if len(pages) == m:
                break
        return sorted(pages)

    def _take(self, pages: list[int]) -> None:
        self._is_free[pages] = False
        self._num_plain_free -= len(pages)

    def share(self, pages: list[int]) -> None:
        """Take one more reference on pages someone already holds."""
        for p in pages:
            assert self.ref_counts[p] > 0, f"page {p} is not in use and cannot be shared"
            self.ref_counts[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference on each page; a page with none left becomes free: cached if registered.

        Pages are released last first, so a sequence's tail (the least shared part of a prefix) is
        the first to be evicted."""
        for p in reversed(pages):
            assert p != NULL_PAGE, "the null page is never freed"
            assert self.ref_counts[p] > 0, f"page {p} freed twice"
            self.ref_counts[p] -= 1
            if self.ref_counts[p] == 0:
                if p in self._hash_of:
                    self._cached_free[p] = None
                else:
                    self._is_free[p] = True
                    self._num_plain_free += 1

    # ---- cached pages ----
    def register(self, page: int, page_hash: bytes) -> bool:
        """Offer a full page in use under its prefix hash; False if another page already holds it."""
        assert self.ref_counts[page] > 0, f"page {page} is not in use and cannot be registered"
        if page_hash in self._page_of or page in self._hash_of:
            return False
        self._page_of[page_hash] = page
        self._hash_of[page] = page_hash
        return True

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The pages of the longest run of `hashes`, from the first, that are registered."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, pages: list[int]) -> None:
        """Take one reference on registered pages, bringing free-but-cached ones back into use."""
        for p in pages:
            assert p in self._hash_of, f"page {p} is not registered"
            if self.ref_counts[p] == 0:
                del self._cached_free[p]
            self.ref_counts[p] += 1

    def forget_cached(self) -> None:
        """Drop every registration (the device's pages were lost): cached free pages become plain free."""
        if self.events is not None and self._hash_of:
            self.events.cleared()
        cached = list(self._cached_free)
        self._is_free[cached] = True
        self._num_plain_free += len(cached)
        self._cached_free.clear()
        self._page_of.clear()
        self._hash_of.clear()
        self.scores.clear()

    def check(self) -> None:
        """Invariants: free + cached free + in use == usable; free pages hold no reference; no page
        listed twice; the hash table is a bijection and every cached free page is registered."""
        free = {int(p) for p in np.flatnonzero(self._is_free)}
        cached_free = set(self._cached_free)
        assert len(free) == self._num_plain_free, "the count of free pages is out of step"
        assert NULL_PAGE not in free | cached_free, "the null page is on a free list"
        assert not (free & cached_free), "a page is both free and cached-free"
        in_use = {int(p) for p in np.nonzero(self.ref_counts)[0]}
        assert not ((free | cached_free) & in_use), f"pages both free and in use: {sorted(free & in_use)[:8]}"
        assert len(free) + len(cached_free) + len(in_use) == self.num_usable, (
            f"pages lost: {self.num_usable - len(free) - len(cached_free) - len(in_use)}"
        )
        assert all(self._page_of[h] == p for p, h in self._hash_of.items()), "hash table out of step"
        assert len(self._page_of) == len(self._hash_of), "hash table out of step"
        assert cached_free <= set(self._hash_of), "an unregistered page is on the cached list"
        assert not (free & set(self._hash_of)), "a registered page is on the plain free list"

    def check_all_free(self) -> None:
        """No page held by anyone (cached free pages count as free)."""
        self.check()
        assert self.num_free == self.num_usable, f"{self.num_in_use} pages still in use"
