"""Prefix caching on the tiny model: shared pages, identical outputs, pages always returned."""

import numpy as np

from jaxcb.host.page_pool import PagePool
from jaxcb.host.policies import SchedulerConfig
from jaxcb.host.prefix_cache import PrefixCache, chain_hash
from jaxcb.host.request import Request, SamplingParams, Status
from jaxcb.host.scheduler import Scheduler

PAGE = 16
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def tokens(n, seed):
    return np.random.default_rng(seed).integers(3, 120, size=n).tolist()


def run_both(make_llm, prompts, params=GREEDY, **config):
    """Outputs and stats with caching on and off; prompts may be a list of waves run one after another."""
    results = {}
    for on in (True, False):
        llm = make_llm(prefix_caching=on, **config)
        outs = []
        for wave in prompts:
            outs += llm.generate(wave, params)
        results[on] = (outs, llm.engine.stats())
    return results


def test_chain_hash_names_the_whole_prefix():
    a = chain_hash(b"", [1, 2, 3, 4])
    assert chain_hash(b"", [1, 2, 3, 4]) == a
    assert chain_hash(a, [5, 6]) != chain_hash(chain_hash(b"", [9, 2, 3, 4]), [5, 6])  # same page, other prefix


def test_shared_system_prompt_is_computed_once(make_llm):
    system = tokens(40, 0)  # two full pages and a partial one
    prompts = [system + tokens(5 + i, 10 + i) for i in range(6)]
    r = run_both(make_llm, [prompts[:1], prompts[1:]])
    (on, on_stats), (off, off_stats) = r[True], r[False]
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert on[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 2 * PAGE for o in on[1:])  # full pages only
    assert off_stats.prompt_tokens_computed - on_stats.prompt_tokens_computed == 5 * 2 * PAGE
    assert on_stats.prefix_cache_hits == 5 * 2 * PAGE and on_stats.prefix_cache_queries == sum(map(len, prompts))
    assert off_stats.prefix_cache_hits == 0


def test_multi_turn_conversation_reuses_the_previous_turn(make_llm):
    turn1 = tokens(30, 1)
    llm = make_llm()
    first = llm.generate([turn1], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    turn2 = turn1 + first.token_ids + tokens(9, 2)  # the reply's pages were computed by turn 1 too
    second = llm.generate([turn2], GREEDY)[0]
    assert second.num_cached_tokens == (len(turn1) + 20 - 1) // PAGE * PAGE
    fresh = make_llm(prefix_caching=False).generate([turn2], GREEDY)[0]
    assert second.token_ids == fresh.token_ids


def test_prompts_diverging_mid_page_share_only_whole_pages(make_llm):
    common = tokens(24, 3)  # page 0 shared, page 1 diverges at slot 8
    prompts = [common + tokens(20, 4), common + tokens(20, 5), common[:16]]
    r = run_both(make_llm, [prompts[:1], prompts[1:]])
    assert [o.token_ids for o in r[True][0]] == [o.token_ids for o in r[False][0]]
    assert [o.num_cached_tokens for o in r[True][0]] == [0, PAGE, 0]  # a 16-token prompt keeps its last token


def test_eviction_under_a_small_pool_keeps_outputs_identical(make_llm):
    system = tokens(48, 6)
    prompts = [[system + tokens(10, 20 + i)] for i in range(3)] + [[tokens(60, 30 + i)] for i in range(4)]
    prompts += [[system + tokens(12, 40)]]
    r = run_both(make_llm, prompts, num_pages=12)  # 11 pages: the cached system prompt gets evicted
    assert [o.token_ids for o in r[True][0]] == [o.token_ids for o in r[False][0]]
    llm = make_llm(num_pages=12)
    for wave in prompts:
        llm.generate(wave, GREEDY)
    assert llm.engine.pool.num_evictions > 0


def test_parallel_samples_prefill_the_prompt_once_and_share_its_pages(make_llm):
    prompt = tokens(37, 7)
    n = 4
    llm = make_llm()
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=n, ignore_eos=True)
    rid = llm.engine.add_request(prompt, params)
    first_pages = set()
    while llm.engine.has_work():
        llm.engine.step()
        running = [r for r in llm.engine.scheduler.running if r.request_id == rid]
        if len(running) == n:
            first_pages |= {tuple(r.page_ids[:2]) for r in running}
    assert len(first_pages) == 1  # all samples read the same two prompt pages
    stats = llm.engine.stats()
    tail = len(prompt) - 2 * PAGE  # each later sample computes only the partial last page
    assert stats.prompt_tokens_computed == len(prompt) + (n - 1) * tail

    outs = llm.generate([prompt], params)
    assert [o.index for o in outs] == list(range(n))
    assert len({tuple(o.token_ids) for o in outs}) > 1  # different seeds per sample
    assert [o.token_ids for o in llm.generate([prompt], params)] == [o.token_ids for o in outs]  # seeded
    greedy = llm.generate([prompt], SamplingParams(max_tokens=6, n=3, ignore_eos=True))
    alone = make_llm(prefix_caching=False).generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert all(o.token_ids == alone.token_ids for o in greedy)


def test_abort_ends_every_sample(make_llm):
    llm = make_llm()
    rid = llm.engine.add_request(tokens(20, 8), SamplingParams(max_tokens=50, n=3, ignore_eos=True))
    llm.engine.step()
    llm.engine.abort(rid)
    events = llm.engine.run_until_done()
    finished = [e for e in events if e.finished]
    assert sorted(e.index for e in finished) == [0, 1, 2]
    assert all(e.finish_reason.value == "abort" for e in finished)
    assert not llm.engine.is_live(rid)


def _cached_scheduler(**kw):
    pool = PagePool(64, 4)
    sched = Scheduler(SchedulerConfig(page_size=4, max_running=1, **kw), pool)
    # A finished request left the pages of prompt 0..7 cached.
    done = Request(list(range(3, 11)), SamplingParams(max_tokens=1))
    done.page_ids = pool.allocate(2)
    done.num_computed = 8
    PrefixCache(pool).register(done)
    pool.free(done.page_ids)
    return sched, pool


def test_prefix_aware_order_prefers_cached_prefixes_without_starving_others():
    for prefix_aware, wait, first in [(False, 0.0, "old"), (True, 0.0, "cached"), (True, 1.0, "old")]:
        sched, pool = _cached_scheduler(prefix_aware=prefix_aware, prefix_max_wait_ms=500)
        old = Request(list(range(50, 60)), SamplingParams(max_tokens=1))
        cached = Request(list(range(3, 11)) + [99, 98], SamplingParams(max_tokens=1))
        old.arrival_time, cached.arrival_time = 0.0, 0.1
        sched.add(old)
        sched.add(cached)
        out = sched.schedule(now=0.1 + wait)
        admitted = out.prefill[0].request
        assert admitted is {"old": old, "cached": cached}[first], (prefix_aware, wait)
        if admitted is cached:
            assert out.prefill[0].start == 8 and cached.num_cached_tokens == 8
        for r in (old, cached):
            sched.remove(r)
            r.status = Status.FINISHED
        pool.check_all_free()


def test_caching_off_computes_everything(make_llm):
    prompt = tokens(40, 9)
    llm = make_llm(prefix_caching=False)
    llm.generate([prompt], GREEDY)
    out = llm.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 0 and llm.engine.stats().pages_cached == 0


def test_a_burst_sharing_a_system_prompt_computes_it_once(make_llm):
    """Requests submitted together wait for the pages a running prefill is computing, instead of
    computing them again, even though none were cached when they arrived."""
    system = tokens(48, 11)  # three full pages
    prompts = [system + tokens(5 + i, 50 + i) for i in range(6)]
    r = run_both(make_llm, [prompts], max_prefill_tokens=32)  # the system prompt takes two steps
    (on, on_stats), (off, off_stats) = r[True], r[False]
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert on_stats.prompt_tokens_computed == len(system) + sum(len(p) - len(system) for p in prompts)
    assert off_stats.prompt_tokens_computed == sum(map(len, prompts))


def test_sample_ids_cannot_collide_with_client_ids(make_llm):
    """A client id that looks like another request's sample ('a/1') is just another id."""
    llm = make_llm()
    engine = llm.engine
    engine.add_request(tokens(9, 12), SamplingParams(max_tokens=4, ignore_eos=True), request_id="a/1")
    engine.add_request(tokens(9, 13), SamplingParams(max_tokens=6, n=2, ignore_eos=True), request_id="a")
    events = engine.run_until_done()
    done = sorted((e.request_id, e.index, e.finish_reason.value) for e in events if e.finished)
    assert done == [("a", 0, "length"), ("a", 1, "length"), ("a/1", 0, "length")]
    assert engine.num_failed_steps == 0


def test_preemption_of_requests_that_share_pages_keeps_outputs_identical(make_llm):
    """Shared pages free nothing when one holder is preempted: the scheduler must keep preempting
    until the pages fit, and the recomputed requests must still give the same tokens."""
    system = tokens(40, 14)
    prompts = [system + tokens(6 + i, 60 + i) for i in range(4)]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, n=2 if i == 0 else 1, temperature=0.8 if i == 0 else 0.0,
                             seed=9) for i in range(4)]
    ample = make_llm(num_pages=256).generate(prompts, params)
    tight = make_llm(num_pages=16)
    got = tight.generate(prompts, params)
    assert tight.engine.stats().preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ample]
