import pytest

from jaxcb.host.page_pool import NULL_PAGE, PagePool


def test_allocate_free_and_invariants():
    pool = PagePool(8, 16)
    assert pool.num_usable == 7 and pool.num_free == 7
    a = pool.allocate(3)
    b = pool.allocate(4)
    assert NULL_PAGE not in a + b and len(set(a + b)) == 7
    assert pool.allocate(1) is None  # out of pages is an answer, not an error
    assert pool.num_free == 0
    pool.check()
    pool.free(a)
    assert pool.num_free == 3 and pool.can_allocate(3) and not pool.can_allocate(4)
    pool.free(b)
    pool.check_all_free()


def test_shared_pages_return_when_the_last_holder_frees():
    pool = PagePool(4, 16)
    pages = pool.allocate(2)
    pool.share(pages)
    pool.free(pages)
    assert pool.num_free == 1
    pool.check()
    pool.free(pages)
    pool.check_all_free()


def test_misuse_is_caught():
    pool = PagePool(4, 16)
    pages = pool.allocate(1)
    pool.free(pages)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(pages)
    with pytest.raises(AssertionError, match="null page"):
        pool.free([NULL_PAGE])
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(1, 16)


def test_pages_for():
    pool = PagePool(4, 16)
    assert [pool.pages_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_cached_pages_stay_free_but_findable_until_evicted():
    pool = PagePool(6, 4)  # 5 usable pages
    a = pool.allocate(3)
    assert pool.register(a[0], b"h0") and pool.register(a[1], b"h1")
    assert not pool.register(a[2], b"h0")  # that prefix is already held by another page
    pool.free(a)
    assert pool.num_free == 5 and pool.num_cached == 2  # cached pages count as free
    pool.check_all_free()
    assert pool.lookup([b"h0", b"h1", b"h2"]) == a[:2]
    assert pool.lookup([b"hx", b"h1"]) == []  # only a run from the first page counts
    pool.acquire(a[:2])  # back in use, off the LRU list
    assert pool.ref_counts[a[0]] == 1 and pool.num_free == 3
    pool.check()
    pool.free(a[:2])
    # Plain free pages go first; then the least recently freed cached page. free() releases a
    # sequence's pages last first, so its tail page is evicted before its head.
    fresh = pool.allocate(3)
    assert set(fresh).isdisjoint(a[:2]) and pool.num_evictions == 0
    more = pool.allocate(1)
    assert more == [a[1]] and pool.num_evictions == 1
    assert pool.lookup([b"h0", b"h1"]) == [a[0]]
    pool.check()
    pool.free(fresh + more)
    pool.forget_cached()
    assert pool.num_cached == 0 and pool.lookup([b"h0"]) == []
    pool.check_all_free()


def test_shared_cached_page_is_freed_only_by_its_last_holder():
    pool = PagePool(4, 4)
    (p,) = pool.allocate(1)
    pool.register(p, b"h")
    pool.acquire([p])  # a second request takes the cached page
    pool.free([p])
    assert pool.num_free == 2  # still held by one
    pool.free([p])
    assert pool.num_free == 3 and pool.lookup([b"h"]) == [p]
    pool.check_all_free()


def test_pages_come_in_ascending_runs_from_the_free_list_and_from_eviction():
    """A sequence's pages in ascending order lie in runs through memory (the attention's prefetchers
    stream them): fresh, freed and reused, and evicted from the cache (least recent first, a
    sequence's tail before its head)."""
    pool = PagePool(17, 4)
    a = pool.allocate(8)
    assert a == sorted(a) and a == list(range(a[0], a[0] + 8))
    pool.free(a)
    again = pool.allocate(8)
    assert again == a
    for i, p in enumerate(again):
        pool.register(p, bytes([i]))
    b = pool.allocate(8)  # the other eight plain free pages
    pool.free(again)  # cached, their tail first on the LRU list
    c = pool.allocate(6)  # evicts a's last six pages
    assert pool.num_evictions == 6 and c == a[2:]
    pool.free(b + c)
    pool.forget_cached()
    pool.check_all_free()


def runs(pages: list[int]) -> int:
    """Stretches of consecutive page ids in a sequence's page list."""
    return 1 + sum(b != a + 1 for a, b in zip(pages, pages[1:]))


def test_sequences_that_arrive_together_and_grow_in_turn_each_keep_one_run():
    """Four prompts of two pages each, then decode growth a page at a time in turn until the pool is
    full: each new prompt goes to the middle of the largest room, and growth continues a sequence's
    run, so every sequence ends as one stretch of memory (handing out the lowest free page would
    interleave them: a run of one page each)."""
    pool = PagePool(65, 16)
    seqs = [pool.allocate(2) for _ in range(4)]
    while pool.num_free:
        for pages in seqs:
            pages.extend(pool.allocate(1, after=pages[-1]))
    assert [runs(p) for p in seqs] == [1, 1, 1, 1] and sorted(len(p) for p in seqs) == [16] * 4
    pool.check()
    for pages in seqs:
        pool.free(pages)
    pool.check_all_free()


def test_growth_past_a_taken_page_goes_to_the_largest_room_and_a_full_pool_still_gives_every_page():
    pool = PagePool(33, 16)
    a = pool.allocate(4)
    b = pool.allocate(4)  # the middle of the room after a
    assert a == [1, 2, 3, 4] and b[0] == 5 + (28 - 4) // 2
    grown = pool.allocate(2, after=b[-1])
    assert grown == [b[-1] + 1, b[-1] + 2]
    c = pool.allocate(3, after=a[-1])  # a continues into its half of the room
    assert c == [5, 6, 7]
    # Fragmented: fewer free pages in one run than asked for; the longest runs are taken whole.
    rest = pool.allocate(pool.num_free)
    assert sorted(rest) == rest and len(set(rest) | set(a + b + grown + c)) == 32
    assert pool.allocate(1, after=rest[-1]) is None
    pool.check()
    pool.free(a + b + grown + c + rest)
    pool.check_all_free()


def test_random_traffic_keeps_the_invariants():
    import random

    rng = random.Random(0)
    pool = PagePool(200, 4)
    held: list[list[int]] = []
    for step in range(3000):
        op = rng.random()
        if op < 0.45:
            pages = pool.allocate(rng.randint(1, 6))
            if pages is not None:
                held.append(pages)
        elif op < 0.75 and held:
            seq = rng.choice(held)
            more = pool.allocate(rng.randint(1, 2), after=seq[-1])
            if more is not None:
                seq.extend(more)
        elif held:
            seq = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.5:
                pool.register(seq[0], step.to_bytes(4, "little"))
            pool.free(seq)
        if step % 100 == 0:
            pool.check()
            assert pool.num_in_use == sum(len(s) for s in held)
    for seq in held:
        pool.free(seq)
    pool.check_all_free()
