"""Prefix caching: requests whose tokens begin with pages already computed reuse those pages.

Plain Python, no JAX. Every full page of a sequence is named by a hash chained over all its tokens
from the start of the sequence to the end of that page (and the request's cache salt, its tenant),
so equal hashes mean equal prefixes of the same tenant, not just equal pages. Once a page is full and its K/V computed, it is registered in the page pool under
that hash. A request being admitted looks up its longest run of registered pages, takes a reference
on each (they are read-only to it: it only ever writes at positions past them) and prefills only
the rest (a mean-pooled embedding excepted: it needs every position's hidden state, jaxcb.host.embedding). Partial pages are never shared; at least one token is always left to compute, because the
step must produce the logits of the last one.

The pool keeps registered pages that nobody holds in an LRU list (jaxcb.host.page_pool), so a prefix
outlives its requests until the memory is needed.

A request that wants its prompt's logprobs (SamplingParams.prompt_logprobs) must have every prompt
position's logits, which a cached page's K/V do not give. So a page registered by such a request also
keeps its tokens' logprobs (PageScores: each token's, given the tokens before it, which the page's hash
fixes), and such a request takes a cached prefix only as far as its pages keep at least the alternatives
it asks for: scoring the same context under several continuations (lm-eval's multiple choice) computes
the context once.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class PageScores:
    """A page's tokens' prompt logprobs, compactly: token j's logprob given the tokens before it, its rank
    and its n best alternatives (all S entries; the first token of a sequence has none: rank 0)."""

    logprobs: np.ndarray  # f32 [S]
    ranks: np.ndarray  # i32 [S]
    top_ids: np.ndarray  # i32 [S, n]
    top_logprobs: np.ndarray  # f32 [S, n]

    @property
    def n(self) -> int:
        return self.top_ids.shape[1]

    @classmethod
    def of(cls, entries: list, n: int) -> "PageScores":
        """From Request.prompt_logprobs' entries (lp, rank, ((id, lp), ...)); None for a first token."""
        s = len(entries)
        out = cls(np.zeros(s, np.float32), np.zeros(s, np.int32), np.zeros((s, n), np.int32),
                  np.zeros((s, n), np.float32))
        for j, e in enumerate(entries):
            if e is not None:
                out.logprobs[j], out.ranks[j] = e[0], e[1]
                if n:
                    out.top_ids[j], out.top_logprobs[j] = zip(*e[2][:n])
        return out

    def entry(self, j: int, n: int) -> tuple:
        """Token j's entry as Request.prompt_logprobs holds it, with its n best alternatives."""
        return (float(self.logprobs[j]), int(self.ranks[j]),
                tuple(zip(self.top_ids[j, :n].tolist(), self.top_logprobs[j, :n].tolist())))


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
        """After attach: the hash of the first full page r would compute itself, if any (for a scoring
        request, the first whose tokens' logprobs it would compute: it recomputes the K/V of the page
        before, whose logprobs it has)."""
        k = len(r.page_ids)
        if r.scoring:
            k = self._scored(r, (r.num_tokens - 1) // self.page_size)
        return self._hashes(r, k + 1)[k] if k < (r.num_tokens - 1) // self.page_size else None

    def _scored(self, r: Request, num_pages: int) -> int:
        """How many of r's first num_pages pages keep their tokens' logprobs with the alternatives it wants."""
        scores, n = self.pool.scores, r.params.prompt_logprobs
        return next((k for k, h in enumerate(self._hashes(r, num_pages)) if h not in scores or scores[h].n < n),
                    num_pages)

    def attach(self, r: Request) -> int:
        """At admission of a request that holds no pages: take its cached prefix. Returns the tokens."""
        assert not r.page_ids and r.num_computed == 0, "attach needs a request with no pages"
        # (a mean-pooled embedding needs every prompt position's hidden state: it computes them all)
        pages = self.cached_pages(r) if r.params.pooling != "mean" else []
        n, scored = r.params.prompt_logprobs, 0
        if r.scoring:  # only as far as the pages keep their tokens' logprobs (and enough alternatives) ...
            scored = self._scored(r, len(pages))
            # ... and the K/V of all but the last of those: the logits of its last position (the next
            # page's first token's logprob, which no record of these pages holds) are computed with it
            pages = pages[:max(0, scored - 1)]
        if self.window is not None:  # only as far as the sliding layers' window is cached too
            k, window_pages = self.window.usable_prefix(r.page_hashes, len(pages))
            pages = pages[:k]
            self.window.attach(r, k, window_pages)
        self.pool.acquire(pages)
        r.page_ids = list(pages)
        r.num_computed = len(pages) * self.page_size
        r.num_registered = len(pages)
        s = self.page_size  # the cached pages' prompt logprobs: entry t - 1 is token t's
        for t in range(max(1, len(r.prompt_logprobs) + 1), min(scored * s, len(r.prompt_ids))):
            r.prompt_logprobs.append(self.pool.scores[r.page_hashes[t // s]].entry(t % s, n))
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
        n = r.params.prompt_logprobs
        if n is not None:  # each page whose tokens' logprobs are all known keeps them (PageScores)
            for k, page_hash in zip(range(r.num_registered, full), hashes):
                if len(r.prompt_logprobs) < (k + 1) * s - 1 or (k + 1) * s > len(r.prompt_ids):
                    break
                held = self.pool.scores.get(page_hash)
                if held is None or held.n < n:
                    self.pool.scores[page_hash] = PageScores.of(
                        [r.prompt_logprobs[t - 1] if t else None for t in range(k * s, (k + 1) * s)], n)
        r.num_registered = full
