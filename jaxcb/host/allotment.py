"""What a request holds while it runs, beside its place in the queue: its KV pages (the full-attention
group's and, for models with sliding-window layers, the window group's: jaxcb.host.window) and its
LoRA slot (jaxcb.host.lora). The scheduler decides who runs; this module gives and takes back what
running needs. Plain Python, no JAX."""

from __future__ import annotations

from jaxcb.host.errors import InvalidRequest
from jaxcb.host.page_pool import PagePool
from jaxcb.host.request import Request


class Allotment:
    """Grows, trims and releases each request's pages in both groups, and its adapter slot."""

    def __init__(self, pool: PagePool, window=None, adapters=None):
        self.pool = pool
        self.window = window  # jaxcb.host.window.WindowGroup, or None
        self.adapters = adapters  # jaxcb.host.lora.Adapters, or None

    def check_fits(self, request: Request, max_chunk: int) -> None:
        """Reject at once what could never run, instead of queueing it forever: a request whose whole
        context needs more pages than the cache holds (`max_chunk`: the most prompt tokens one step
        takes, the window group's need)."""
        pages = self.pool.pages_for(request.max_total_tokens)
        if pages > self.pool.num_usable:
            raise InvalidRequest(
                f"max_tokens: prompt + max_tokens needs {pages} KV pages but the cache holds only "
                f"{self.pool.num_usable}"
            )
        if self.window is not None:
            chunk = min(max_chunk, request.max_total_tokens)
            pages = min(self.window.pages_per_chunk(chunk), self.pool.pages_for(request.max_total_tokens))
            if pages > self.window.pool.num_usable:
                raise InvalidRequest(f"max_tokens: the sliding-window layers need {pages} KV pages for this request "
                                     f"but their cache holds only {self.window.pool.num_usable}")

    def grow(self, r: Request, num_tokens: int) -> bool:
        """Give `r` the pages to hold its first num_tokens tokens; False (holding nothing more) when a
        group is short."""
        need = self.pool.pages_for(num_tokens) - len(r.page_ids)
        pages = []
        if need > 0:
            pages = self.pool.allocate(need, after=r.page_ids[-1] if r.page_ids else None)
            if pages is None:
                return False
            r.page_ids.extend(pages)
        if self.window is None or self.window.grow(r, r.num_computed, num_tokens):
            return True
        if pages:  # the sliding layers are short: give back what was just taken, not hold it while waiting
            del r.page_ids[-len(pages):]
            self.pool.free(pages)
        return False

    def trim(self, r: Request, num_tokens: int) -> None:
        """r's pages (both groups) past those its first num_tokens tokens need go back: proposals
        dropped or rejected, a prompt chunk cut short."""
        keep = self.pool.pages_for(num_tokens)
        if len(r.page_ids) > keep:
            self.pool.free(r.page_ids[keep:])
            del r.page_ids[keep:]
        if self.window is not None:
            self.window.trim(r, keep)

    def release(self, r: Request) -> None:
        """r stops running (finished, aborted, preempted): its pages and its adapter slot go back."""
        if r.page_ids:
            self.pool.free(r.page_ids)
            r.page_ids = []
        if self.window is not None:
            self.window.release(r)
        r.num_registered = 0
        self.release_slot(r)

    def release_slot(self, r: Request) -> None:
        if r.lora_slot >= 0:
            self.adapters.release(r.lora)
            r.lora_slot = -1
