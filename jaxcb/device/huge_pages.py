"""The weights and the KV pages on the CPU in 2 MiB pages (Linux transparent huge pages), collapsed in the
background.

A decode step reads every weight matrix; with 4 KiB pages its TLB misses cost a few percent of the step
(SmolLM2 float32 on a 2-core Xeon, measured while the layer matrices were still read in place, a row of a
block per page: 1-row step 25.9 -> 25.0 ms, 32-row step 71.4 -> 69.2 ms, interleaved runs). The attention
reads the KV pool a 4 KiB page of keys or values at a time, scattered over the pool after a while of
serving: each one a TLB miss (SmolLM2 float32, 32 rows, pages shuffled, 2-core Zen 4: attention at context
512 41.5 / 41.7 -> 33.0 / 32.5 ms, the step 104.6 / 103.5 -> 96.5 / 93.4 ms; `bench.step --layout
shuffled`, processes alternating). Where the kernel leaves huge pages to madvise (the usual default), XLA's
buffers never get them: this asks for them on the buffers (MADV_HUGEPAGE) and has the kernel collapse them
now (MADV_COLLAPSE, Linux 6.1+) on a thread of its own, while serving goes on (the kernel swaps the pages
under a running step safely; the KV pages are donated to each step, which writes them in place, so their
addresses hold): about a second for SmolLM2's 0.5 GB of weights, 7 s for its default 2.9 GB pool, which the
runner starts once the warm-up is done (beside the compiles it held them back: 15 -> 22 s). Anything
that refuses (another OS, an older kernel, huge pages off) leaves the memory as it was. JAXCB_HUGE_PAGES=0
turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time

import jax

log = logging.getLogger("jaxcb.device.huge_pages")

HUGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
# Collapsed this much at a time: the kernel holds the process's memory map while it collapses a range, and
# every other thread that maps memory waits for it (one call over the 2.9 GB pool held a server's first
# request, building its grammar, for 10-15 s after SERVING: a 400 at the compile time limit).
CHUNK = 32 << 20


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("JAXCB_HUGE_PAGES", "1") != "0"


def ranges(tree) -> list[tuple[int, int]]:
    """The whole 2 MiB ranges of the tree's CPU buffers, [start, end) addresses. Read at once: the KV
    pages are donated to every step, so a later reader could meet a deleted array (the buffer itself
    stays where it is, the step writing its output in place)."""
    out = []
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            if shard.device.platform != "cpu":
                continue
            data = shard.data
            start = (data.unsafe_buffer_pointer() + HUGE - 1) // HUGE * HUGE
            end = (data.unsafe_buffer_pointer() + data.nbytes) // HUGE * HUGE
            if end > start:
                out.append((start, end))
    return out


def collapse(tree) -> int:
    """Ask for huge pages on every whole 2 MiB range of the tree's CPU buffers and collapse them now;
    returns the bytes the kernel collapsed (0 where it cannot)."""
    return collapse_ranges(ranges(tree))


def collapse_ranges(spans: list[tuple[int, int]]) -> int:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for start, end in spans:
        if libc.madvise(start, end - start, MADV_HUGEPAGE) != 0:
            return done  # not on this kernel (or the buffer is gone): none will take
        for at in range(start, end, CHUNK):  # (a piece at a time: see CHUNK)
            if libc.madvise(at, min(CHUNK, end - at), MADV_COLLAPSE) == 0:
                done += min(CHUNK, end - at)
    return done


def collapse_in_background(tree, what: str) -> threading.Thread | None:
    """collapse(tree) on a daemon thread (None where turned off); logs what it did. The buffers'
    addresses are read before it returns."""
    if not enabled():
        return None
    spans = ranges(tree)

    def run():
        t = time.perf_counter()
        try:
            n = collapse_ranges(spans)
        except Exception:  # noqa: BLE001 - an optimisation: the memory stays as it was
            log.exception("huge pages for the %s failed", what)
            return
        log.info("huge pages: %d MB of the %s in 2 MiB pages (%.1f s)", n >> 20, what, time.perf_counter() - t)

    thread = threading.Thread(target=run, name="jaxcb-huge-pages", daemon=True)
    thread.start()
    return thread
