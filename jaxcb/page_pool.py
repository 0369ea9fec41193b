"""The host-side page pool: which pages of the device's KV array are free, and who holds the rest.

Plain Python and numpy, no JAX. A free list gives O(1) allocate and free; reference counts let
several requests hold one page (prefix sharing). Page 0 is the null page that padding points at: it
is never allocated and never freed. Running out of pages is an ordinary answer (`None`), which the
scheduler handles by waiting or preempting.
"""

from __future__ import annotations

import numpy as np

NULL_PAGE = 0


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages: {num_pages} is too small; the pool needs at least 2 (page 0 is reserved)")
        if page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Popped from the end: low page ids are handed out first, which keeps tests readable.
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self.ref_counts = np.zeros(num_pages, dtype=np.int32)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return self.num_usable - self.num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages with one reference each, or None (nothing taken) when too few are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self.ref_counts[pages] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Take one more reference on pages someone already holds."""
        for p in pages:
            assert self.ref_counts[p] > 0, f"page {p} is not in use and cannot be shared"
            self.ref_counts[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference on each page; a page with none left returns to the free list."""
        for p in pages:
            assert p != NULL_PAGE, "the null page is never freed"
            assert self.ref_counts[p] > 0, f"page {p} freed twice"
            self.ref_counts[p] -= 1
            if self.ref_counts[p] == 0:
                self._free.append(p)

    def check(self) -> None:
        """Invariants: free + in use == usable; free pages hold no reference; no page listed twice."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert NULL_PAGE not in free, "the null page is on the free list"
        in_use = {int(p) for p in np.nonzero(self.ref_counts)[0]}
        assert not (free & in_use), f"pages both free and in use: {sorted(free & in_use)[:8]}"
        assert len(free) + len(in_use) == self.num_usable, (
            f"pages lost: {self.num_usable - len(free) - len(in_use)}"
        )

    def check_all_free(self) -> None:
        self.check()
        assert self.num_free == self.num_usable, f"{self.num_in_use} pages still in use"
