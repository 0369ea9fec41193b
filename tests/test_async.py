"""Async scheduling: the host schedules and packs step N+1 while the device runs step N.

Decode tokens of the step in flight are read on the device, so the results must be exactly those of
the serial engine, whatever stops a request early (EOS, stop strings), takes its pages (preemption),
or looks at its history (penalties).
"""

import numpy as np

from jaxcb.host.request import SamplingParams


def _prompts(llm, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, llm.model_config.vocab_size, size=n).tolist() for n in lengths]


def _mixed_params(n):
    kinds = [
        dict(max_tokens=40, ignore_eos=True),
        dict(max_tokens=40, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        dict(max_tokens=40, repetition_penalty=1.8, frequency_penalty=0.7, ignore_eos=True),  # history matters
        dict(max_tokens=40, temperature=1.1, presence_penalty=1.5, seed=3, logprobs=2, ignore_eos=True),
        dict(max_tokens=40, n=2, temperature=0.8, seed=11, ignore_eos=True),
        dict(max_tokens=40),  # EOS may end it while its next step is already in flight
        dict(max_tokens=1, ignore_eos=True),
    ]
    return [SamplingParams(**kinds[i % len(kinds)]) for i in range(n)]


def _run(llm, prompts, params):
    outs = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        llm.engine.add_request(p, sp, request_id=f"r{i}")
    for ev in llm.engine.run_until_done():
        key = (ev.request_id, ev.index)
        tokens, text, lps, reason = outs.get(key, ((), "", (), None))
        outs[key] = (tokens + ev.token_ids, text + ev.text, lps + (ev.logprobs or ()), ev.finish_reason)
    return outs


def test_async_scheduling_gives_the_serial_results(make_llm):
    serial = make_llm(async_scheduling=False)
    prompts = _prompts(serial, (20, 33, 5, 17, 40, 9, 28, 12, 61, 3, 45, 30, 8, 26))
    params = _mixed_params(len(prompts))
    # A stop string that the serial run meets mid-output: async must cut it at the same place.
    text = serial.generate([prompts[0]], SamplingParams(max_tokens=40, ignore_eos=True))[0].text
    stop = next((text[i:i + 2] for i in range(6, len(text) - 2) if text[i:i + 2].strip()), None)
    if stop is not None:
        params[0] = SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,))
    want = _run(serial, prompts, params)
    for pages in (256, 16):  # 16 pages: tight enough to preempt requests with a token in flight
        llm = make_llm(num_pages=pages)
        assert llm.engine.scheduler.config.async_scheduling
        got = _run(llm, prompts, params)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key][:2] == want[key][:2], key
            assert got[key][3] == want[key][3], key
            np.testing.assert_allclose([lp for lp, _ in got[key][2]], [lp for lp, _ in want[key][2]], rtol=1e-5)
        if pages == 16:
            assert llm.engine.stats().preemptions > 0


def test_one_dispatch_per_step_and_the_next_step_queued_before_the_fetch(make_llm):
    llm = make_llm()
    runner, calls = llm.engine.runner, []
    run, fetch = runner.run, runner.fetch
    runner.run = lambda *a: (calls.append("run"), run(*a))[1]
    runner.fetch = lambda out: (calls.append("fetch"), fetch(out))[1]
    for p in _prompts(llm, (30, 12, 50)):
        llm.engine.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True))
    steps = 0
    while llm.engine.has_work():
        before = len(calls)
        llm.engine.step()
        steps += 1
        assert calls[before:].count("run") <= 1  # one jitted call per engine step
    assert calls.count("run") == calls.count("fetch") == llm.engine.stats().steps
    # Every fetch but the last has the next step dispatched before it.
    fetches = [i for i, c in enumerate(calls) if c == "fetch"]
    assert all(calls[:i].count("run") == k + 2 for k, i in enumerate(fetches[:-1]))
    assert calls.count("run") < steps  # the last call only fetched
    llm.engine.runner.run, llm.engine.runner.fetch = run, fetch
