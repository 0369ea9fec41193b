"""Scheduler tests with hand-written requests and no model: a fake step marks chunks computed."""

import pytest

from jaxcb.host.page_pool import PagePool
from jaxcb.host.policies import SchedulerConfig
from jaxcb.host.request import Request, SamplingParams, Status
from jaxcb.host.scheduler import Scheduler
from jaxcb.host.speculative import SpeculativeConfig


def req(prompt_len, max_tokens=4, priority=0, t=0.0):
    r = Request(list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority)
    r.arrival_time = t
    return r


def make(num_pages=64, **kw):
    kw.setdefault("page_size", 4)
    # req() gives every request the same tokens: with prefix caching they would share pages and wait
    # for each other's prefill. These tests are about policies; tests/test_prefix_cache.py covers that.
    kw.setdefault("prefix_caching", False)
    pool = PagePool(num_pages, kw["page_size"])
    return Scheduler(SchedulerConfig(**kw), pool), pool


def fake_step(sched, out):
    """What the engine does after a step: tokens computed, a token sampled, finished requests removed."""
    for c in out.decode + out.prefill:
        r = c.request
        r.num_computed = c.start + c.num_tokens
        if c.samples:
            r.output_ids.append(7)
            if len(r.output_ids) >= r.params.max_tokens:
                r.status = Status.FINISHED
                sched.remove(r)


def run_all(sched, now=0.0, max_steps=1000):
    steps = 0
    while sched.has_work:
        fake_step(sched, sched.schedule(now=now))
        steps += 1
        assert steps < max_steps
    return steps


def test_chunked_prefill_keeps_decoders_going():
    sched, pool = make(max_prefill_tokens=8, max_chunk=8, max_context=256)
    short, long = req(3, max_tokens=10), req(30, max_tokens=2)
    sched.add(short)
    fake_step(sched, sched.schedule(now=0))
    sched.add(long)
    chunks = []
    for _ in range(4):
        out = sched.schedule(now=0)
        assert [c.request for c in out.decode] == [short]  # the decoder never waits for the long prompt
        chunks += [c.num_tokens for c in out.prefill]
        fake_step(sched, out)
    assert chunks == [8, 8, 8, 6]
    assert long.output_ids == [7]  # sampled at the end of its last chunk
    run_all(sched)
    pool.check_all_free()


def test_a_prompt_chunk_cut_to_one_token_brings_no_proposals():
    """A prompt chunk cut to one token (the step's prefill budget spent but one token; or the rows a
    scoring prompt's positions take) is no decode step: proposals there stood for the prompt's next
    tokens and what was sampled at them became output (beside prompt_logprobs with 4 slots, its first
    tokens were the prompt's). Only a request whose newest token is its only one to compute proposes."""
    sched, pool = make(max_prefill_tokens=9, max_chunk=8, max_context=256,
                       speculative=SpeculativeConfig("ngram", adaptive=False))
    loop = [4, 5, 6, 7] * 8  # every suffix matched before (fake_step samples 7): the n-gram proposer always proposes
    first, cut = (Request(loop[:n], SamplingParams(max_tokens=8, ignore_eos=True)) for n in (32, 32))
    sched.add(first)
    sched.add(cut)
    fake_step(sched, sched.schedule(now=0))  # first: 8 tokens, the budget's last token: cut's first
    assert (first.num_computed, cut.num_computed) == (8, 1)
    out = sched.schedule(now=0, speculate=True)
    assert [(c.request is cut, c.start, c.num_tokens, c.draft) for c in out.chunks] == [(True, 1, 1, ()), (False, 8, 8, ())]
    while cut.num_tokens - cut.num_computed > 1:
        fake_step(sched, out)
        out = sched.schedule(now=0)
    out = sched.schedule(now=0, speculate=True)  # decoding: it proposes
    assert [bool(c.draft) for c in out.chunks if c.request is cut] == [True]


def test_pages_grow_one_page_at_a_time_and_return_at_the_end():
    sched, pool = make(num_pages=16, page_size=4, max_context=64)
    r = req(4, max_tokens=6)
    sched.add(r)
    sizes = []
    while sched.has_work:
        out = sched.schedule(now=0)
        sizes.append(len(r.page_ids))
        fake_step(sched, out)
    assert sizes == [1, 2, 2, 2, 2, 3]  # prompt 4 tokens, then each decode step holds num_tokens
    pool.check_all_free()


def test_out_of_pages_preempts_the_newest_and_recomputes_it():
    sched, pool = make(num_pages=7, page_size=4, max_context=64)  # 6 usable pages
    a, b = req(8, max_tokens=12, t=0), req(8, max_tokens=12, t=1)
    sched.add(a)
    sched.add(b)
    preempted = []
    while sched.has_work:
        out = sched.schedule(now=2)
        preempted += out.preempted
        assert pool.num_in_use <= 6
        fake_step(sched, out)
        pool.check()
    assert b in preempted and a not in preempted  # FCFS keeps the oldest
    assert b.num_preemptions >= 1 and len(b.output_ids) == 12
    pool.check_all_free()


def test_request_that_can_never_fit_is_rejected_at_once():
    # The context limit is checked with the other fields at the edge (Engine.validate, test_llm).
    sched, _ = make(num_pages=5, page_size=4, max_context=64)
    sched.check_fits(req(12, max_tokens=4))  # 4 pages: fits
    with pytest.raises(ValueError, match="needs 5 KV pages but the cache holds only 4"):
        sched.check_fits(req(12, max_tokens=8))


def test_running_limit_and_fcfs_order():
    sched, _ = make(max_running=2, max_context=64)
    rs = [req(4, t=i) for i in range(4)]
    for r in reversed(rs):
        sched.add(r)
    out = sched.schedule(now=10)
    assert [c.request for c in out.prefill] == rs[:2]
    run_all(sched, now=10)


def test_sjf_runs_the_shortest_first():
    sched, _ = make(max_running=1, policy="sjf", max_context=128, sjf_aging_tokens_per_s=0.0)
    long, short, mid = req(40, t=0), req(4, t=1), req(10, t=2)
    for r in (long, short, mid):
        sched.add(r)
    order = []
    while sched.has_work:
        out = sched.schedule(now=5)
        order += [c.request for c in out.prefill if c.request not in order]
        fake_step(sched, out)
    assert order == [short, mid, long]


@pytest.mark.parametrize("aging,starves", [(0.0, True), (1.0, False)])
def test_priority_aging_prevents_starvation(aging, starves):
    """One slot; a low-priority request waits while a new high-priority request arrives every second."""
    sched, pool = make(max_running=1, policy="priority", aging_per_s=aging, max_context=64)
    low = req(4, max_tokens=1, priority=0, t=0.0)
    sched.add(low)
    started_at = None
    for step in range(60):
        now = float(step)
        sched.add(req(4, max_tokens=1, priority=10, t=now))
        out = sched.schedule(now=now)
        if any(c.request is low for c in out.prefill):
            started_at = step
            break
        fake_step(sched, out)
    if starves:
        assert started_at is None
    else:
        assert started_at is not None and started_at <= 15
    for r in list(sched.waiting) + list(sched.running):
        sched.remove(r)
    pool.check_all_free()


def test_length_buckets_admit_a_full_group_together():
    """Two free slots: the short group (2 requests) is full and goes first, although the long request
    is older; FCFS would have taken the long one."""
    sched, _ = make(max_running=3, policy="length-buckets", length_bounds=(8,), max_wait_ms=1000,
                    max_context=128)
    blocker = req(3, max_tokens=50, t=0.0)
    sched.add(blocker)
    fake_step(sched, sched.schedule(now=0.0))
    long1, short1, short2 = req(20, t=0.0), req(3, t=0.1), req(4, t=0.2)
    for r in (long1, short1, short2):
        sched.add(r)
    out = sched.schedule(now=0.3)
    assert [c.request for c in out.prefill] == [short1, short2]
    for r in list(sched.waiting) + list(sched.running):
        sched.remove(r)


def test_length_buckets_wait_window_then_fallback():
    sched, _ = make(max_running=4, policy="length-buckets", length_bounds=(8,), max_wait_ms=100, max_context=128)
    blocker = req(3, max_tokens=50, t=0.0)
    sched.add(blocker)
    fake_step(sched, sched.schedule(now=0.0))
    long1 = req(20, t=1.0)
    sched.add(long1)
    assert sched.schedule(now=1.05).prefill == []  # group not full, window not over: wait
    out = sched.schedule(now=1.2)  # waited 200 ms > 100 ms: admitted
    assert [c.request for c in out.prefill] == [long1]
    for r in list(sched.waiting) + list(sched.running):
        sched.remove(r)


def test_dynamic_batching_window():
    sched, _ = make(max_running=8, min_batch=3, max_wait_ms=50, max_context=64)
    a, b = req(4, t=0.0), req(4, t=0.0)
    sched.add(a)
    sched.add(b)
    assert sched.schedule(now=0.01).empty  # 2 < min_batch and only 10 ms waited
    out = sched.schedule(now=0.06)  # the window closed
    assert {c.request for c in out.prefill} == {a, b}
    fake_step(sched, out)
    c, d, e = req(4, t=1.0), req(4, t=1.0), req(4, t=1.0)
    for r in (c, d, e):
        sched.add(r)
    out = sched.schedule(now=1.0)  # min_batch reached: no wait
    assert {ch.request for ch in out.prefill} == {c, d, e}
    assert {ch.request for ch in out.decode} == {a, b}
    for r in list(sched.waiting) + list(sched.running):
        sched.remove(r)


def test_latency_target_moves_the_running_limit_and_the_prefill_budget():
    sched, _ = make(max_running=16, target_p99_tpot_ms=100.0, max_context=64, max_prefill_tokens=256)
    ctl = sched.controller
    for _ in range(8):
        ctl.observe_step(0.150)  # mean 150 ms a token: over the target
    assert sched.running_limit < 16
    shrunk = sched.running_limit
    for _ in range(80):
        ctl.observe_step(0.020)  # far under: grows back, one slot at a time
    assert 16 >= sched.running_limit > shrunk
    grown = sched.running_limit
    for _ in range(16):
        ctl.observe_step(0.095)  # over 0.9 x target: shrinks again
    assert sched.running_limit < grown
    held = sched.running_limit
    for _ in range(32):
        ctl.observe_step(0.085)  # under 0.9 x target: not shrunk
    assert sched.running_limit >= held


def test_the_prefill_budget_keeps_the_window_of_decode_steps_under_the_target():
    """The budget is what the next step can carry: the room the last 7 decode steps leave under
    0.9 x target over 8 steps, less a decode step, at the measured cost of a prompt token."""
    sched, _ = make(max_running=16, target_p99_tpot_ms=100.0, max_context=64, max_prefill_tokens=256)
    ctl = sched.controller
    for _ in range(8):
        ctl.observe_step(0.050, decode_rows=4)
    assert ctl.prefill_budget == 256  # a prompt token's cost not yet known
    ctl.observe_step(0.050 + 0.100, decode_rows=4, prompt_tokens=50)  # 2 ms a prompt token
    assert ctl.prompt_token_ms == pytest.approx(2.0)
    # Window: 7 x 50 ms before + 150 ms now; room = 8 x 90 - (6 x 50 + 150) - 50 = 220 ms -> 110 tokens.
    assert ctl.prefill_budget == 110
    ctl.observe_step(0.050 + 0.400, decode_rows=4, prompt_tokens=200)  # a burst: little room left
    assert ctl.prefill_budget == ctl.min_budget
    for _ in range(8):
        ctl.observe_step(0.050, decode_rows=4)  # decode-only steps: the window has room again
    assert ctl.prefill_budget > 100
    ctl.observe_step(0.300, decode_rows=0, prompt_tokens=100)  # a prefill-only step: no row waited
    assert len(ctl._steps) == 18 and list(ctl._steps)[-1] == 50.0


def test_latency_target_uses_the_shrunk_prefill_budget_and_keeps_page_headroom():
    sched, pool = make(num_pages=11, max_running=8, target_p99_tpot_ms=100.0, max_context=64,
                       max_prefill_tokens=32, max_chunk=32)
    sched.controller.prefill_budget = 8
    a = req(30, max_tokens=6)
    sched.add(a)
    out = sched.schedule(now=0)
    assert [c.num_tokens for c in out.prefill] == [8]  # the controller's budget, not max_prefill_tokens
    fake_step(sched, out)
    for _ in range(3):
        fake_step(sched, sched.schedule(now=0))
    # 10 usable pages of 4 tokens: a holds 8; b's first chunk (8 tokens) needs the other 2, which would
    # leave a no page of headroom to grow into: b waits instead of forcing a preemption later.
    b = req(12, max_tokens=4)
    sched.add(b)
    out = sched.schedule(now=0)
    assert b.status is Status.WAITING and not out.preempted
    run_all(sched)
    assert sched.num_preemptions == 0


def test_a_ttft_target_alone_grows_the_limit_when_first_tokens_are_late():
    sched, _ = make(max_running=16, target_p99_ttft_ms=500.0, max_context=64)
    ctl = sched.controller
    ctl.running_limit = 4
    for _ in range(8):
        ctl.observe_first_token(2.0)
    for _ in range(16):
        ctl.observe_step(0.05)
    assert sched.running_limit > 4
    grown = sched.running_limit
    for _ in range(32):
        ctl.observe_first_token(0.1)
    for _ in range(16):
        ctl.observe_step(0.05)
    assert sched.running_limit == grown  # first tokens on time: nothing to gain


def test_a_completed_step_feeds_the_controller_one_way_for_the_engine_and_the_simulator():
    sched, _ = make(max_running=4, target_p99_tpot_ms=100.0, max_context=64)
    ctl = sched.controller
    a, b = req(5, max_tokens=3, t=1.0), req(5, max_tokens=3, t=2.0)
    for r in (a, b):
        sched.add(r)
    prefill = sched.schedule(now=2.0)
    chunks = prefill.decode + prefill.prefill
    for c in chunks:
        c.request.num_computed = c.start + c.num_tokens
        c.request.output_ids.append(7)
        c.request.first_token_time = 2.5
    ctl.observe_step_done(chunks, 0.5, [(a, False), (b, False)], now=2.5)
    assert sorted(ctl._ttft) == [500.0, 1500.0]  # first tokens: their waits since arrival
    assert not ctl._steps  # a prefill-only step says nothing about time per token
    decode = sched.schedule(now=2.5)
    for r in (a, b):
        r.output_ids += [7, 7]
    ctl.observe_step_done(decode.decode, 0.25, [(a, True), (b, False)], now=3.5)
    assert list(ctl._steps) == [250.0]
    assert list(ctl._tpot) == [500.0]  # a: two tokens after its first, 1 s later; b has not finished
    assert sorted(ctl._ttft) == [500.0, 1500.0]  # no request's first token twice
    ctl.observe_step_done(decode.decode, None, [], now=4.0)  # after an idle spell: no step time
    assert list(ctl._steps) == [250.0]


def engine_step(sched, out, step_id, tokens=7):
    """What the engine does with a step: launched, then its tokens back (through the prefix cache)."""
    chunks = out.decode + out.prefill
    epochs = [c.request.num_preemptions for c in chunks]
    sched.on_launched(chunks, step_id)
    for _, r, _, reason in sched.on_step_done(chunks, epochs, [tokens] * len(chunks)):
        if reason is not None:
            sched.finish(r, reason)


def test_round_robin_shares_the_slots_and_keeps_the_yielded_pages_cached():
    sched, pool = make(num_pages=64, max_running=2, policy="round-robin", quantum_tokens=4, max_context=64,
                       prefix_caching=True)
    reqs = []
    for i in range(4):
        r = Request([3 + i] + list(range(20, 27)), SamplingParams(max_tokens=12, ignore_eos=True))
        r.arrival_time = float(i)
        reqs.append(r)
        sched.add(r)
    order, step = [], 0
    while sched.has_work:
        out = sched.schedule(now=10.0 + step)
        order.append(tuple(sorted(reqs.index(c.request) for c in out.decode + out.prefill)))
        engine_step(sched, out, step)
        step += 1
        assert step < 200
    assert order[0] == (0, 1)
    first_turn_of_3 = next(i for i, o in enumerate(order) if 3 in o)
    assert first_turn_of_3 <= 2 * (1 + 4)  # waits two quanta at most, not for 0 and 1 to finish
    assert sched.num_switches >= 4 and sched.num_preemptions == 0
    # Each return recomputes at most the partial last page (4 tokens) plus its last token: the full
    # pages came back from the prefix cache.
    assert sched.num_switch_recomputed_tokens <= sched.num_switches * pool.page_size
    assert all(len(r.output_ids) == 12 for r in reqs)
    pool.check_all_free()


def test_round_robin_does_not_switch_when_nobody_waits():
    sched, _ = make(max_running=4, policy="round-robin", quantum_tokens=2, max_context=64)
    for i in range(3):
        sched.add(req(4, max_tokens=10, t=float(i)))
    run_all(sched)
    assert sched.num_switches == 0


def test_static_mode_admits_only_when_the_batch_is_done():
    sched, pool = make(max_running=4, static=True, max_context=64)
    first = [req(4, max_tokens=2 + i, t=0) for i in range(3)]
    for r in first:
        sched.add(r)
    out = sched.schedule(now=0)
    assert len(out.prefill) == 3 and out.num_static_rows == 3
    late = req(4, t=0.5)
    sched.add(late)
    while any(r.status is not Status.FINISHED for r in first):
        out = sched.schedule(now=1)
        assert all(c.request is not late for c in out.decode + out.prefill)
        assert out.num_static_rows == 3  # finished rows still occupy the batch
        fake_step(sched, out)
    out = sched.schedule(now=2)
    assert [c.request for c in out.prefill] == [late]
    run_all(sched, now=2)
    pool.check_all_free()


def test_sjf_ages_so_a_long_request_is_not_starved():
    """A long request that has waited (length difference / aging rate) seconds goes before a newer short one."""
    sched, _ = make(max_running=1, policy="sjf", max_context=128, sjf_aging_tokens_per_s=10.0)
    long, short = req(40, t=0), req(4, t=5)
    for r in (short, long):
        sched.add(r)
    # Lengths 44 and 8 (max_tokens 4): at t=5 long counts 44 - 50 = -6, short 8 - 0: long first.
    assert [c.request for c in sched.schedule(now=5).prefill] == [long]


def test_priority_is_clamped_so_aging_catches_up():
    sched, _ = make(max_running=1, policy="priority", max_context=128, max_priority=10, aging_per_s=1.0)
    old, vip = req(4, t=0), req(4, t=20)
    vip.priority = 2**31 - 1
    for r in (vip, old):
        sched.add(r)
    # Clamped to 10, the newcomer has 10; the old request has aged 20: it goes first.
    assert [c.request for c in sched.schedule(now=20).prefill] == [old]


def test_an_infinite_batching_window_is_refused():
    with pytest.raises(ValueError, match="max_wait_ms: must be a finite number >= 0"):
        make(max_wait_ms=float("inf"), min_batch=2)


def test_a_request_short_of_sliding_pages_holds_no_full_pages_while_it_waits():
    """Without prefix caching, a request that gets its full-attention pages but not its sliding-window
    pages gives the former back: it waits holding nothing (it kept them before: preemption churn)."""
    from jaxcb.host.window import WindowGroup

    pool = PagePool(64, 4)
    window = WindowGroup(num_pages=5, page_size=4, window=8)  # 4 usable sliding pages: one request's chunk
    sched = Scheduler(SchedulerConfig(page_size=4, prefix_caching=False, max_running=4, max_prefill_tokens=64,
                                      max_chunk=16), pool, window=window)
    a, b = req(16, max_tokens=8), req(16, max_tokens=8)
    sched.add(a)
    sched.add(b)
    out = sched.schedule(now=0.0)
    running = [c.request for c in out.prefill + out.decode]
    waiting = [r for r in (a, b) if r not in running]
    assert running and waiting
    for r in waiting:
        assert r.page_ids == [] and not any(p for p in r.window_page_ids)
    assert pool.num_in_use == sum(len(r.page_ids) for r in running)


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_fair_gives_a_late_client_its_share_while_another_holds_every_slot(policy):
    """One client's 12 long requests take all 4 slots and fill the queue; another client's request, later, waits for
    all of them under fcfs, but under fair gets a slot within a quantum (the heavy client yielding one) and keeps
    it; the heavy client's requests all finish (their pages come back from the prefix cache) and no page leaks."""
    sched, pool = make(num_pages=256, max_running=4, policy=policy, quantum_tokens=4, max_context=64,
                       prefix_caching=True)
    heavy = []
    for i in range(12):
        r = Request([3 + i] + list(range(20, 27)), SamplingParams(max_tokens=40, ignore_eos=True), client="heavy")
        r.arrival_time = float(i)
        heavy.append(r)
        sched.add(r)
    step, light = 0, None
    first_token_step = None
    while sched.has_work:
        if step == 3:  # the heavy client holds every slot by now
            light = Request([90, 91, 92, 93, 94], SamplingParams(max_tokens=8, ignore_eos=True), client="light")
            light.arrival_time = 20.0
            sched.add(light)
        out = sched.schedule(now=30.0 + step)
        if light is not None and first_token_step is None and any(
                c.request is light and c.samples for c in out.decode + out.prefill):
            first_token_step = step
        engine_step(sched, out, step)
        step += 1
        assert step < 2000
    waited = first_token_step - 3
    if policy == "fair":
        assert waited <= 4 + 2 and sched.num_switches >= 1  # a quantum, then its prefill
    else:
        assert waited > 40 and sched.num_switches == 0  # until a heavy request finished
    assert all(len(r.output_ids) == 40 for r in heavy) and len(light.output_ids) == 8
    pool.check_all_free()


def test_fair_order_interleaves_clients_fewest_running_first():
    from jaxcb.host.policies import fair_order

    def r(client, t):
        x = req(4, t=t)
        x.client = client
        return x

    running = [r("a", -3), r("a", -2), r("b", -1)]
    waiting = [r("a", 0), r("a", 1), r("b", 2), r("c", 3), r("a", 4), r("b", 5)]
    assert [(x.client, x.arrival_time) for x in fair_order(waiting, running)] == [
        ("c", 3), ("b", 2), ("a", 0), ("b", 5), ("a", 1), ("a", 4)]
