"""The weights' huge pages on the CPU (jaxcb.device.huge_pages): where the kernel offers transparent huge
pages to madvise, a runner's weights end up in them; anywhere else nothing changes."""

import os
import pathlib
import re

import numpy as np


def _thp_mode() -> str:
    path = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.exists() else ""
    return text[text.index("[") + 1:text.index("]")] if "[" in text else "never"


def _huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    found = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            found = lo <= address < hi
        elif found and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def test_the_weights_are_collapsed_into_huge_pages_where_the_kernel_allows(monkeypatch):
    import jax.numpy as jnp

    from jaxcb.device import huge_pages

    monkeypatch.setenv("JAXCB_HUGE_PAGES", "1")
    weights = {"w": jnp.asarray(np.ones((3, 1024, 1024), np.float32)), "small": jnp.ones(10)}  # 12 MiB, 40 B
    thread = huge_pages.collapse_in_background(weights, "test weights")
    assert thread is not None
    thread.join(timeout=60)
    done = huge_pages.collapse(weights)  # again: what is already huge is collapsed at once
    start = weights["w"].unsafe_buffer_pointer()
    kernel = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    if _thp_mode() in ("madvise", "always") and kernel >= (6, 1):  # MADV_COLLAPSE came in Linux 6.1
        assert done >= 4 * huge_pages.HUGE  # the whole 2 MiB ranges inside 12 MiB: at least 5, maybe 6
        assert _huge_bytes(start + 3 * huge_pages.HUGE) >= huge_pages.HUGE
    np.testing.assert_array_equal(np.asarray(weights["w"]), 1.0)  # the contents are untouched


def test_turned_off_it_starts_nothing(monkeypatch):
    import jax.numpy as jnp

    from jaxcb.device import huge_pages

    monkeypatch.setenv("JAXCB_HUGE_PAGES", "0")
    assert huge_pages.collapse_in_background({"w": jnp.ones((1024, 1024))}, "weights") is None


def test_a_runner_collapses_its_weights_and_kv_pages_while_it_serves_the_same_tokens(make_llm, monkeypatch):
    """A runner on the CPU puts its weights (from its start) and its KV pool (once the engine has warmed up)
    in huge pages on a thread of its own: steps run while the pages are collapsed under them and give the
    tokens of a runner that never collapses."""
    from jaxcb.device import huge_pages
    from jaxcb.host.request import SamplingParams

    prompts = ["the quick brown fox", "a b c d e f g", "hello"]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    monkeypatch.setenv("JAXCB_HUGE_PAGES", "0")
    plain = make_llm(num_pages=4096)
    assert plain.engine.runner.huge_pages == []
    want = [o.token_ids for o in plain.generate(prompts, greedy)]

    monkeypatch.setenv("JAXCB_HUGE_PAGES", "1")
    llm = make_llm(num_pages=4096)
    runner = llm.engine.runner
    kv = runner.kv_arrays[0]
    start, nbytes = kv.unsafe_buffer_pointer(), kv.nbytes
    assert nbytes >= 8 * huge_pages.HUGE  # whole 2 MiB ranges inside the pool
    assert len(runner.huge_pages) == 1  # the weights'
    runner.wait_for_huge_pages(timeout=120)
    llm.engine.warmup()  # then the pool's, once every shape is compiled
    assert len(runner.huge_pages) == 2
    during = [o.token_ids for o in llm.generate(prompts, greedy)]  # as the thread collapses (or has collapsed)
    runner.wait_for_huge_pages(timeout=120)
    after = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert during == want and after == want
    assert runner.kv_arrays[0].unsafe_buffer_pointer() == start  # the steps write the pool in place
    kernel = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    if _thp_mode() in ("madvise", "always") and kernel >= (6, 1):
        assert _huge_bytes(start + nbytes // 2) >= huge_pages.HUGE
