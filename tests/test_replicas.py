"""Data parallelism's router (jaxcb.host.replicas): prefix preference, fewest pending tokens, accounting.

The router does not care where its engines run, so these tests put two engines of the tiny model
on the one CPU device; the same on disjoint forced host devices is in test_parallel.py."""

import threading

import numpy as np
import pytest

from jaxcb.device.factory import make_runner
from jaxcb.host.engine import Engine
from jaxcb.host.engine_config import make_config
from jaxcb.host.replicas import Replicas, split_devices
from jaxcb.host.request import SamplingParams


@pytest.fixture
def replicas(tiny_model):
    cfg, params, tok, eos = tiny_model
    config = make_config(num_pages=128, max_context=256, decode_batch=(1, 2, 4, 8), prefill_tokens=(16, 32, 64),
                         attention="xla", compile="fast")
    engines = [Engine(make_runner(cfg, params, config)[0], tok, config, eos_ids=eos) for _ in range(2)]
    reps = Replicas(engines).start()
    yield reps
    reps.stop()
    for e in engines:
        e.pool.check_all_free()


def _run(reps, prompts, params):
    """Submit all, wait for all; returns ({request id: tokens}, {request id: replica})."""
    done, tokens, where = threading.Event(), {}, {}
    left = [len(prompts)]
    lock = threading.Lock()

    def on_event(ev):
        with lock:
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finished:
                left[0] -= 1
                if not left[0]:
                    done.set()

    for p in prompts:
        rid = reps.submit(p, params, on_event)
        where[rid] = reps._routes[rid].replica if rid in reps._routes else None
    assert done.wait(120)
    return tokens, where


def test_requests_sharing_a_cached_prefix_go_to_the_replica_that_holds_it(replicas):
    rng = np.random.default_rng(1)
    system = rng.integers(3, 128, 64).tolist()  # four full pages
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    _, first = _run(replicas, [system + [5, 6, 7]], greedy)
    holder = next(iter(first.values()))
    assert replicas.load == [0, 0]  # every routed token accounted for
    # Without the prefix the idle replicas tie and the other one would be as good; with it, the holder.
    _, where = _run(replicas, [system + rng.integers(3, 128, 9).tolist() for _ in range(3)], greedy)
    assert set(where.values()) == {holder}
    assert replicas.prefix_routed == 3
    # Unrelated prompts spread by pending tokens: both replicas get work.
    _, where = _run(replicas, [rng.integers(3, 128, 40).tolist() for _ in range(4)], greedy)
    assert set(where.values()) == {0, 1}
    assert replicas.load == [0, 0]


def test_fewest_pending_tokens_wins_and_aborts_reach_the_right_replica(replicas):
    rng = np.random.default_rng(2)
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    events = []
    rid = replicas.submit(rng.integers(3, 128, 20).tolist(), long, events.append)
    busy = replicas._routes[rid].replica
    assert replicas.load[busy] == 220 and replicas.is_live(rid)
    short = replicas.submit(rng.integers(3, 128, 20).tolist(), SamplingParams(max_tokens=2), events.append)
    assert replicas._routes[short].replica == 1 - busy
    with pytest.raises(ValueError, match="request_id: .* already in use"):
        replicas.submit([1, 2, 3], long, events.append, request_id=rid)
    replicas.abort(rid)
    for _ in range(600):
        if not replicas.is_live(rid) and not replicas.is_live(short):
            break
        threading.Event().wait(0.05)
    assert [e.finish_reason.value for e in events if e.finished and e.request_id == rid] == ["abort"]
    assert replicas.load == [0, 0]


def test_replica_stats_add_up(replicas):
    _run(replicas, [[3, 4, 5, 6]] * 3, SamplingParams(max_tokens=3, ignore_eos=True))
    per, total = replicas.replica_stats(), replicas.stats()
    assert total.output_tokens == sum(s.output_tokens for s in per) == 9
    assert total.pages_total == 2 * per[0].pages_total


def test_devices_split_into_disjoint_groups():
    assert split_devices(list(range(8)), 2, 3) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match=r"parallel: 3 replicas x 2 devices = 6 devices asked for, 4 present"):
        split_devices(list(range(4)), 2, 3)
