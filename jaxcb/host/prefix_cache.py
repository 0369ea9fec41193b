"""Prefix caching: requests whose tokens begin with pages already computed reuse those pages.

Plain Python, no JAX. Every full page of a sequence is named by a hash chained over all its tokens
from the start of the sequence to the end of that page (and the request's cache salt, its tenant),
so equal hashes mean equal prefixes of the same tenant, not just equal pages. Once a page is full and its K/V computed, it is registered in the page pool under
that hash. A request being admitted looks up its longest run of registered pages, takes a reference
on each (they are read-only to it: it only ever writes at positions past them) and prefills only
the rest. Partial pages are never shared; at least one token is always left to compute, because the
step must produce the logits of the last one.

The pool keeps registered pages that nobody holds in an LRU list (jaxcb.host.page_pool), so a prefix
outlives its requests until the memory is needed.
"""

from __future__ import annotations

import hashlib

import numpy as np

from jaxcb.host.page_pool import PagePool
from jaxcb.host.request import Request


def salt_root(salt: str) -> bytes:
    """The hash the chain of a request with this cache salt starts from (b"" for none): requests of
    different salts (tenants) never match each other's pages, so the cache reveals nothing across them."""
    return hashlib.blake2b(salt.encode(), digest_size=16, person=b"jaxcb-salt").digest() if salt else b""


def chain_hash(previous: bytes, tokens: list[int]) -> bytes:
    """The hash of a page: its tokens and the hash of everything before it (128-bit BLAKE2b)."""
    h = hashlib.blake2b(previous, digest_size=16)
    h.update(np.asarray(tokens, np.int64).tobytes())
    return h.digest()


class PrefixCache:
    def __init__(self, pool: PagePool, window=None):
        self.pool = pool
        self.window = window  # jaxcb.host.window.WindowGroup of a model with sliding layers, else None
        self.page_size = pool.page_size
        self.num_queried_tokens = 0  # prompt tokens looked up (first admissions)
        self.num_hit_tokens = 0  # of those, found cached

    def _hashes(self, r: Request, num_pages: int) -> list[bytes]:
        """Hashes of r's first num_pages full pages, extending r.page_hashes (tokens never change)."""
        s, ids = self.page_size, None
        while len(r.page_hashes) < num_pages:
            ids = ids or r.all_ids
            i = len(r.page_hashes)
            # the chain starts from the tenant's salt and the adapter's load: neither shares pages
            prev = r.page_hashes[-1] if i else salt_root(r.cache_salt + (r.lora.key if r.lora is not None else ""))
            r.page_hashes.append(chain_hash(prev, ids[i * s:(i + 1) * s]))
        return r.page_hashes[:num_pages]

    def cached_pages(self, r: Request) -> list[int]:
        """The registered pages r could start from (leaving at least its last token to compute)."""
        return self.pool.lookup(self._hashes(r, (r.num_tokens - 1) // self.page_size))

    def upcoming(self, r: Request) -> list[bytes]:
        """Hashes of r's full prompt pages that it has yet to compute and register."""
        full = len(r.prompt_ids) // self.page_size
        return self._hashes(r, full)[r.num_registered:] if full > r.num_registered else []

    def next_hash(self, r: Request) -> bytes | None:
        """After attach: the hash of the first full page r would compute itself, if any."""
        k = len(r.page_ids)
        return self._hashes(r, k + 1)[k] if k < (r.num_tokens - 1) // self.page_size else None

    def attach(self, r: Request) -> int:
        """At admission of a request that holds no pages: take its cached prefix. Returns the tokens."""
        assert not r.page_ids and r.num_computed == 0, "attach needs a request with no pages"
        pages = self.cached_pages(r)
        if self.window is not None:  # only as far as the sliding layers' window is cached too
            k, window_pages = self.window.usable_prefix(r.page_hashes, len(pages))
            pages = pages[:k]
            self.window.attach(r, k, window_pages)
        self.pool.acquire(pages)
        r.page_ids = list(pages)
        r.num_computed = len(pages) * self.page_size
        r.num_registered = len(pages)
        if r.num_preemptions == 0:  # usage and counters: the prompt, at its first admission
            r.num_cached_tokens = min(r.num_computed, len(r.prompt_ids))
            self.num_queried_tokens += len(r.prompt_ids)
            self.num_hit_tokens += r.num_cached_tokens
        return r.num_computed

    def detach(self, r: Request) -> None:
        """Undo `attach` when the admission did not go through."""
        if r.num_preemptions == 0:
            self.num_queried_tokens -= len(r.prompt_ids)
            self.num_hit_tokens -= r.num_cached_tokens
            r.num_cached_tokens = 0
        self.pool.free(r.page_ids)
        if self.window is not None:
            self.window.release(r)
        r.page_ids, r.num_computed, r.num_registered = [], 0, 0

    def register(self, r: Request, upto: int | None = None) -> None:
        """After a step: register r's pages that are now full and computed (up to token `upto`, and
        never past the tokens whose ids are known)."""
        upto = min(r.num_computed if upto is None else upto, r.num_known)
        full = min(upto // self.page_size, len(r.page_ids))
        if full <= r.num_registered:
            return
        chain = self._hashes(r, full)
        hashes = chain[r.num_registered:]
        events, s = self.pool.events, self.page_size
        ids = r.all_ids if events is not None else None
        for k, page, page_hash in zip(range(r.num_registered, full), r.page_ids[r.num_registered:full], hashes):
            if self.pool.register(page, page_hash) and events is not None:  # newly cached: tell the routers
                events.stored(page_hash, chain[k - 1] if k else None, ids[k * s:(k + 1) * s],
                              r.lora.name if r.lora is not None else None)
        if self.window is not None:
            self.window.register(r, r.num_registered, hashes)
        r.num_registered = full
