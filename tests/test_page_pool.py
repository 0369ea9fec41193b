import pytest

from jaxcb.page_pool import NULL_PAGE, PagePool


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
