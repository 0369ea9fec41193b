"""The sliding-window layers' KV pages: a page group of their own (Gemma 2/3).

A sliding layer's query at position t sees only keys t - window + 1 .. t. Keeping those layers' keys
for the whole sequence, as the full-attention layers must, wastes most of the cache on a long
sequence (Gemma 3: 5 of every 6 layers slide over 512 tokens). So the sliding layers have their own
page array, their own pool (`WindowGroup.pool`) and their own page table per request
(`Request.window_page_ids`, indexed like `page_ids`: logical page i holds positions i*S .. i*S+S-1).

As a request advances, the pages wholly before the window of its next chunk's first query go back to
the pool and their entries become the null page, so a decoding sequence holds at most
ceil(window / S) + 1 sliding pages (a prefill chunk of c tokens: (window - 1 + c) / S + 2).

Prefix caching: a full page is registered in both pools under the same chained hash. A cached prefix
of k pages is reusable only if the sliding pages that the next query's window reaches back into are
still held or cached (logical pages first_needed(k*S) .. k-1); otherwise the match is shortened until
they are. The sliding pages before that window are never needed again and are not looked up.
Preemption frees both groups' pages, like a finish.

Plain Python, no JAX; owned by the scheduler (jaxcb.host.scheduler), which calls `grow` where it grows a
request's full pages and `release` where it frees them.
"""

from __future__ import annotations

from jaxcb.host.errors import InvalidConfig
from jaxcb.host.page_pool import NULL_PAGE, PagePool


class WindowGroup:
    def __init__(self, num_pages: int, page_size: int, window: int):
        if window < 1:
            raise InvalidConfig(f"sliding_window: must be >= 1, got {window}")
        self.pool = PagePool(num_pages, page_size)
        self.page_size = page_size
        self.window = window

    def first_needed(self, position: int) -> int:
        """The first logical page a query at `position` (or any later one) can see."""
        return max(0, position - self.window + 1) // self.page_size

    def pages_per_chunk(self, num_tokens: int) -> int:
        """The most sliding pages a request holds while it computes a chunk of `num_tokens` tokens."""
        return sliding_pages_per_chunk(self.window, self.page_size, num_tokens)

    def grow(self, r, start: int, num_tokens: int) -> bool:
        """Before r computes its tokens start .. num_tokens-1: free its pages before the window of the
        query at `start`, then give it pages up to token num_tokens. False when the pool is short (what
        was freed stays freed: no later query of r can see it)."""
        ids, lo = r.window_page_ids, self.first_needed(start)
        dropped = [p for p in ids[:lo] if p != NULL_PAGE]
        if dropped:
            self.pool.free(dropped)
            ids[:lo] = [NULL_PAGE] * min(lo, len(ids))
        need = self.pool.pages_for(num_tokens)
        missing = need - max(len(ids), lo)
        if missing <= 0:
            return True
        pages = self.pool.allocate(missing, after=ids[-1] if ids and ids[-1] != NULL_PAGE else None)
        if pages is None:
            return False
        ids.extend([NULL_PAGE] * (max(len(ids), lo) - len(ids)) + pages)
        return True

    def trim(self, r, num_pages: int) -> None:
        """r's tokens now end within its first num_pages pages (rejected speculative tokens rolled
        back): the sliding pages past them go back."""
        tail = [p for p in r.window_page_ids[num_pages:] if p != NULL_PAGE]
        if tail:
            self.pool.free(tail)
        del r.window_page_ids[num_pages:]

    def release(self, r) -> None:
        """r ends or is preempted: every sliding page it holds goes back."""
        held = [p for p in r.window_page_ids if p != NULL_PAGE]
        if held:
            self.pool.free(held)
        r.window_page_ids = []

    def held(self, r) -> int:
        return sum(p != NULL_PAGE for p in r.window_page_ids)

    # ---- prefix caching ----
    def usable_prefix(self, hashes: list[bytes], k: int) -> tuple[int, list[int]]:
        """(k', pages): the longest k' <= k cached full pages whose next query's window is cached in
        this group too, and the sliding pages of that window (logical first_needed(k' * S) .. k'-1)."""
        while k > 0:
            lo = self.first_needed(k * self.page_size)
            pages = self.pool.lookup(hashes[lo:k])
            if len(pages) == k - lo:
                return k, pages
            k -= 1
        return 0, []

    def attach(self, r, k: int, pages: list[int]) -> None:
        """r starts from k cached full pages: take the sliding pages of their window (usable_prefix)."""
        assert not r.window_page_ids
        self.pool.acquire(pages)
        r.window_page_ids = [NULL_PAGE] * (k - len(pages)) + list(pages)

    def register(self, r, first: int, hashes: list[bytes]) -> None:
        """Offer r's sliding pages first .. first+len(hashes)-1 under their pages' hashes (those still held)."""
        for i, h in enumerate(hashes, start=first):
            if i < len(r.window_page_ids) and r.window_page_ids[i] != NULL_PAGE:
                self.pool.register(r.window_page_ids[i], h)


def sliding_pages_per_chunk(window: int, page_size: int, num_tokens: int) -> int:
    """The most sliding pages a sequence holds while it computes a chunk of `num_tokens` tokens: the
    window behind the chunk's first query, the chunk, and a partial page at each end."""
    return (window - 1 + num_tokens) // page_size + 2
