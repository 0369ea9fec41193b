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
