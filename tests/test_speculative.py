"""Speculative decoding (jaxcb.host.speculative): n-gram proposals scored inside the packed step give
exactly the tokens of decoding without them, greedy and sampled, in every situation the engine meets."""

import dataclasses
import math

import numpy as np
import pytest

from jaxcb.host.errors import InvalidConfig
from jaxcb.host.request import FinishReason, SamplingParams
from jaxcb.host.speculative import SpeculativeConfig, propose_ngram

# adaptive=False: keep every proposal (the tiny model's step times say nothing about what pays).
NGRAM = SpeculativeConfig("ngram", num_tokens=4, adaptive=False)
# A draft of the tiny model's first layer (of two): right often enough to be accepted, wrong often enough
# to be rejected.
DRAFT = SpeculativeConfig("draft", num_tokens=4, adaptive=False, draft_layers=1)
# The target as its own draft: every greedy proposal must be accepted, so any error in what the draft's
# KV holds shows as a rejection.
SELF_DRAFT = SpeculativeConfig("draft", num_tokens=3, adaptive=False)


def test_ngram_proposes_what_followed_the_latest_longest_match():
    t = np.array([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7], np.int32)
    # suffix [5, 6, 7] occurred at 0 (followed by 8, 9, 1); [6, 7] alone occurred later, but longer wins
    assert propose_ngram(t, 3, 2, 3).tolist() == [8, 9, 1]
    assert propose_ngram(t, 2, 2, 3).tolist() == [8, 9]
    # with at most 2-token suffixes, the latest occurrence of [6, 7] (position 6) is used
    assert propose_ngram(t, 3, 2, 2).tolist() == [2, 3, 5]
    assert propose_ngram(np.array([1, 2, 3, 4], np.int32), 3, 1, 3).size == 0  # nothing repeats
    # the continuation stops at the sequence's end
    assert propose_ngram(np.array([4, 4, 4], np.int32), 5, 1, 2).tolist() == [4]


def test_config_checks_name_the_field():
    with pytest.raises(InvalidConfig, match="speculative.method"):
        SpeculativeConfig("eagle")
    with pytest.raises(InvalidConfig, match="speculative.draft_layers"):
        SpeculativeConfig("draft", draft_layers=-1)
    with pytest.raises(InvalidConfig, match="speculative.draft_weights"):
        SpeculativeConfig("draft", draft_weights="int3")
    with pytest.raises(InvalidConfig, match="speculative.num_tokens"):
        SpeculativeConfig("ngram", num_tokens=0)
    with pytest.raises(InvalidConfig, match="speculative.max_n"):
        SpeculativeConfig("ngram", min_n=3, max_n=2)


def test_the_config_file_and_the_flags_set_it(tmp_path):
    import argparse

    from jaxcb.cli.args import add_model_args, engine_config
    from jaxcb.host.engine_config import DEFAULT_CONFIG, load_config

    path = tmp_path / "spec.toml"
    path.write_text(open(DEFAULT_CONFIG).read().replace('method = ""', 'method = "ngram"'))
    assert load_config(str(path)).scheduler.speculative.method == "ngram"
    assert load_config().scheduler.speculative.enabled is False
    path.write_text(open(DEFAULT_CONFIG).read() + "\n[speculative]\nbogus = 1\n")
    with pytest.raises(Exception, match="speculative"):
        load_config(str(path))
    p = argparse.ArgumentParser()
    add_model_args(p)
    spec = engine_config(p.parse_args(["--speculative", "ngram", "--num-speculative-tokens", "3"])).scheduler.speculative
    assert (spec.method, spec.num_tokens) == ("ngram", 3)


def repetitive_prompts(vocab, lengths, seed=0):
    """Prompts that repeat their own first part: the n-gram proposer finds matches in them."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        part = rng.integers(3, vocab, size=n).tolist()
        out.append(part + part[: max(2, n // 2)])
    return out


def both(make_llm, spec=NGRAM, **config):
    return make_llm(**config), make_llm(speculative=spec, **config)


def check_speculated(llm):
    st = llm.engine.stats()
    assert st.speculative_steps > 0 and st.speculative_accepted > 0, st
    assert 0 < st.acceptance_rate <= 1 and st.mean_accepted_length > 1


@pytest.mark.parametrize("async_scheduling,spec", [(True, NGRAM), (False, NGRAM), (True, DRAFT)],
                         ids=["ngram-async", "ngram-sync", "draft-async"])
def test_greedy_outputs_are_those_of_decoding_without_it(make_llm, async_scheduling, spec):
    base, spec = both(make_llm, spec, async_scheduling=async_scheduling)
    prompts = repetitive_prompts(base.model_config.vocab_size, (5, 20, 33, 8, 50, 12))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in base.generate(prompts, params)]
    if async_scheduling:
        spec.warmup()
    compiled = spec.engine.stats().compilations
    got = [o.token_ids for o in spec.generate(prompts, params)]
    assert got == want
    check_speculated(spec)
    if async_scheduling:
        assert spec.engine.stats().compilations == compiled  # no new shapes after warm-up


def test_every_policy_gives_the_tokens_of_decoding_without_it(make_llm):
    """Each scheduling policy orders and admits differently (round-robin also makes running requests
    yield): with proposals in its steps, every request still gets the non-speculative tokens."""
    from jaxcb.host.policies import POLICIES

    base = make_llm()
    prompts = repetitive_prompts(base.model_config.vocab_size, (5, 20, 33, 8, 50, 12, 27, 40, 9, 16), seed=4)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = [o.token_ids for o in base.generate(prompts, params)]
    for policy in POLICIES:
        spec = make_llm(speculative=NGRAM, policy=policy, quantum_tokens=8)
        assert [o.token_ids for o in spec.generate(prompts, params)] == want, policy
        check_speculated(spec)


CASES = ["preemption", "prefix_cache", "n", "stop", "penalties", "logprobs", "eos"]


@pytest.mark.parametrize("case,method", [(c, "ngram") for c in CASES]
                         + [("preemption", "self"), ("prefix_cache", "self"), ("n", "draft"), ("stop", "draft"),
                            ("penalties", "draft")])
def test_exact_in_every_situation(make_llm, case, method):
    config = {"num_pages": 14} if case == "preemption" else {}
    # Penalties keep the tiny model from repeating itself: one-token matches give it proposals.
    proposer = {"ngram": dataclasses.replace(NGRAM, min_n=1) if case == "penalties" else NGRAM,
                "draft": DRAFT, "self": SELF_DRAFT}[method]
    base, spec = both(make_llm, proposer, **config)
    vocab = base.model_config.vocab_size
    prompts = repetitive_prompts(vocab, (20, 33, 5, 17, 40, 12), seed=1)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    if case == "prefix_cache":
        prompts = [prompts[0] + p for p in prompts]  # one shared prefix; each engine generates twice
    elif case == "n":
        params = SamplingParams(max_tokens=24, ignore_eos=True, n=3, temperature=0.2, seed=7)
    elif case == "penalties":
        # mild: stronger penalties stop the tiny model from ever repeating itself (nothing to propose);
        # a logit_bias too (every verifying row must carry its request's bias)
        params = SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.05, frequency_penalty=0.05,
                                logit_bias={3: 1.5, 5: -1.0, vocab - 1: 0.5})
    elif case == "logprobs":
        params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=3)
    elif case == "eos":
        params = SamplingParams(max_tokens=24, stop_token_ids=(7, 11, 13, 29, 31, 57))
    want = base.generate(prompts, params)
    if case == "penalties":  # the bias moves the tokens (else the check below could not see it dropped)
        unbiased = base.generate(prompts, dataclasses.replace(params, logit_bias=()))
        assert [o.token_ids for o in want] != [o.token_ids for o in unbiased]
    if case == "stop":  # stop at the text of a token the plain run produces, mid-way
        texts = [o.text for o in want]
        stop = next(t[len(t) // 2: len(t) // 2 + 2] for t in texts if len(t) > 8)
        params = dataclasses.replace(params, stop=(stop,))
        want = base.generate(prompts, params)
    got = spec.generate(prompts, params)
    if case == "prefix_cache":
        want, got = base.generate(prompts, params), spec.generate(prompts, params)
        assert spec.engine.stats().prefix_cache_hits > 0
    if case == "preemption":
        assert spec.engine.stats().preemptions > 0
    for a, b in zip(want, got):
        assert b.token_ids == a.token_ids
        assert b.text == a.text and b.finish_reason == a.finish_reason
        if case == "logprobs":
            np.testing.assert_allclose([lp for lp, _ in b.logprobs], [lp for lp, _ in a.logprobs], rtol=1e-4, atol=1e-5)
    if case == "stop":
        assert any(o.finish_reason == FinishReason.STOP for o in got)
    check_speculated(spec)
    if method == "self":  # greedy, its own draft: a stale or misplaced draft KV would show as a rejection
        assert spec.engine.stats().acceptance_rate == 1.0


def test_a_stop_string_before_min_tokens_goes_by_and_counts_are_the_tokens_given(make_llm):
    """A speculating step appends several tokens at once. A stop string in an earlier one was weighed against
    the later ones' count, so it ended the request before its min_tokens; and a request a stop string ended
    at an earlier one reported the dropped ones in its final count (the API's usage) (a helper's fuzzing).
    Each request: the character an early token of its plain answer writes as the stop string, min_tokens just
    past that token: the plain engine's tokens, text and finish, and every final event's count the tokens it
    gave."""
    base, spec = both(make_llm)
    tok = base.tokenizer
    rng = np.random.default_rng(0)  # short cycles: the tiny model soon repeats itself, and proposals hold
    prompts = [(rng.integers(3, base.model_config.vocab_size, size=int(rng.integers(2, 8))).tolist() * 20)[:60]
               for _ in range(8)]
    params = []
    for o in base.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True)):
        # the first token (from the second on) that writes one printable character: that character the stop
        # string, and min_tokens just past that token, so that the plain engine goes on to a later one
        j = next((j for j in range(1, 30) if len(c := tok.decode(o.token_ids[j:j + 1])) == 1 and c.isprintable()
                  and c.strip()), 1)
        params.append(SamplingParams(max_tokens=40, ignore_eos=True, stop=(tok.decode(o.token_ids[j:j + 1]) or "x",),
                                     min_tokens=j + 2))

    def run(llm):
        ids = [llm.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        tokens, text, final = {i: [] for i in ids}, {i: "" for i in ids}, {}
        while llm.engine.has_work():
            for ev in llm.engine.step():
                tokens[ev.request_id] += ev.token_ids
                text[ev.request_id] += ev.text
                if ev.finished:
                    final[ev.request_id] = (ev.finish_reason, ev.num_output_tokens)
        for i in ids:
            assert final[i][1] == len(tokens[i]), (i, final[i], len(tokens[i]))
        return [(tokens[i], text[i], final[i][0]) for i in ids]

    want, got = run(base), run(spec)
    assert got == want
    assert sum(reason is FinishReason.STOP for _, _, reason in want) >= 3  # (stop strings past min_tokens)
    assert all(len(t) >= p.min_tokens for (t, _, _), p in zip(want, params))
    check_speculated(spec)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_sampling_gives_the_same_tokens_and_the_same_distribution(make_llm, method):
    """A proposal is accepted when the token sampled at its position (the request's key for that output
    position) equals it, so a seeded request samples what it samples without speculation; unseeded,
    the token frequencies at the speculated positions match decoding without it (two-sample chi-square).
    The draft: the target's own greedy tokens, which sampling at temperature 0.6 often but not always
    takes."""
    # sampled text repeats less: one-token matches give the n-gram proposer something to propose
    base, spec = both(make_llm, dataclasses.replace(NGRAM, min_n=1) if method == "ngram" else SELF_DRAFT)
    vocab = base.model_config.vocab_size
    prompts = repetitive_prompts(vocab, (12, 20, 9, 30), seed=3)
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.5, top_k=40, seed=i) for i in range(4)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in base.generate(prompts, params)]
    check_speculated(spec)

    # A low temperature on a repeating prompt: the proposal (what followed before) is often but not
    # always what the model samples, so a wrong acceptance rule would shift these frequencies.
    prompt = repetitive_prompts(vocab, (10,), seed=4)[0]
    p = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.6, n=16)
    counts = []
    for llm, first_seed in ((base, 0), (spec, 10_000)):  # different seeds: independent samples
        c = {}
        for s in range(first_seed, first_seed + 20):
            for o in llm.generate([prompt], dataclasses.replace(p, seed=s)):
                for pos, t in enumerate(o.token_ids[1:4]):
                    c[(pos, t)] = c.get((pos, t), 0) + 1
        counts.append(c)
    keys = sorted(set(counts[0]) | set(counts[1]))
    a = np.array([counts[0].get(k, 0) for k in keys], float)
    b = np.array([counts[1].get(k, 0) for k in keys], float)
    big = (a + b) >= 10  # pool the rare cells
    a = np.append(a[big], a[~big].sum())
    b = np.append(b[big], b[~big].sum())
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    chi2 = float((((a - b) ** 2) / (a + b)).sum())  # equal totals: the two-sample statistic
    dof = len(a) - 1
    # p < 0.001 rejects: the 0.999 quantile of chi-square, Wilson-Hilferty
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, dof, limit)
    assert spec.engine.stats().speculative_steps > 0


def test_opting_out_and_constraints_do_not_speculate(make_llm):
    spec = make_llm(speculative=NGRAM)
    prompts = repetitive_prompts(spec.model_config.vocab_size, (20, 30), seed=5)
    spec.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True, speculative=False))
    assert spec.engine.stats().speculative_steps == 0
    spec.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert spec.engine.stats().speculative_steps > 0


def test_a_request_scoring_its_prompt_keeps_the_plain_tokens_and_logprobs(make_llm):
    """prompt_logprobs beside speculation, with few batch slots (a helper's probe: SmolLM2, 4 slots, ngram and draft;
    its first tokens were the prompt's and its prompt_logprobs cut short: a prompt chunk cut to one token by the
    rows its scored positions take brought proposals, tests/test_scheduler.py): the plain engine's tokens and
    every prompt position scored as it scores them."""
    base, spec = make_llm(decode_batch=(1, 2, 4)), make_llm(decode_batch=(1, 2, 4), speculative=NGRAM)
    prompts = repetitive_prompts(spec.model_config.vocab_size, (20, 30, 25, 40), seed=5)
    scoring = SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=2)
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    params = [scoring, plain, scoring, plain]
    want, got = base.generate(prompts, params), spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [len(o.prompt_logprobs or ()) for o in got] == [len(prompts[0]), 0, len(prompts[2]), 0]
    for g, w in zip(got[::2], want[::2]):
        assert g.prompt_logprobs[0] is None
        np.testing.assert_allclose([lp for lp, _, _ in g.prompt_logprobs[1:]], [lp for lp, _, _ in w.prompt_logprobs[1:]], atol=1e-4)
    assert spec.engine.stats().speculative_steps > 0


def test_speculation_backs_off_where_it_does_not_pay(make_llm):
    """With the step times known, a proposal is kept only while it raises the expected tokens per
    second: where a bigger bucket costs far more than a proposal can win, none is kept."""
    spec = make_llm(speculative=dataclasses.replace(NGRAM, adaptive=True))
    proposer = spec.engine.scheduler.proposer
    proposer.observe_step = lambda tokens, seconds: None  # the tiny model's own times would say little
    prompts = repetitive_prompts(spec.model_config.vocab_size, (30,), seed=6)  # alone: no bucket padding to fill
    for tokens in spec.engine.config.buckets.tokens:
        proposer.bucket_s[tokens] = 0.01 * tokens  # cost grows with every token: never pays
    spec.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert spec.engine.stats().speculative_steps == 0
    spec.engine.reset_counters()
    for tokens in spec.engine.config.buckets.tokens:
        proposer.bucket_s[tokens] = 0.01  # every bucket costs the same: every proposal pays
    spec.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert spec.engine.stats().speculative_steps > 0


def test_the_host_wait_a_speculating_step_costs_counts_against_it():
    """A speculating step needs the step before it finished, so the host's work before its dispatch is
    no longer overlapped: with that wait measured, proposals that would have paid in the step alone are
    dropped, and kept again once the wait is short."""
    from types import SimpleNamespace

    from jaxcb.host.speculative import Proposer

    proposer = Proposer(SpeculativeConfig("ngram", num_tokens=3), buckets=(1, 2, 4, 8))
    proposer.bucket_s.update({1: 0.030, 4: 0.036, 8: 0.050})
    r = SimpleNamespace(spec=None)
    proposer.state(r).rate = 0.6
    assert proposer.keep([(r, 3)], 1, 1) == [3]  # 1 + .6 + .36 + .22 tokens in 36 ms beat 1 in 30 ms
    for _ in range(20):
        proposer.observe_sync(0.030)
    assert abs(proposer.sync_s - 0.030) < 1e-3
    assert proposer.keep([(r, 3)], 1, 1) == [0]  # 2.2 tokens in 66 ms do not
    for _ in range(20):
        proposer.observe_sync(0.001)
    assert proposer.keep([(r, 3)], 1, 1) == [3]
    proposer.max_step_tokens = 3  # the largest verifying program: no more proposals than it holds
    assert proposer.keep([(r, 3)], 1, 1) == [2]
    assert proposer.keep([(r, 3)], 3, 3) == [0]


def test_the_draft_learns_a_tokens_cost_from_proposing_not_from_catching_up(make_llm):
    """The first fill for a request runs the draft over its whole prompt: that is not what each later
    proposed token costs, and counting it so would stop the draft after its first step."""
    spec = make_llm(speculative=SpeculativeConfig("draft", num_tokens=3, draft_layers=1, adaptive=False))
    proposer = spec.engine.scheduler.proposer
    prompts = repetitive_prompts(spec.model_config.vocab_size, (60,), seed=3)
    spec.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))  # warm: every shape compiled
    fills = []
    real_fill = proposer._fill

    def timed(chunks):
        before = proposer.token_s
        real_fill(chunks)
        fills.append((before, proposer.token_s))

    proposer._fill = timed
    proposer.token_s = None
    spec.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(fills) >= 2
    assert fills[0] == (None, None)  # the catch-up over the prompt taught nothing about a proposal ...
    assert proposer.catch_up_s is not None and proposer.catch_up_s > 0  # ... but what a catch-up costs
    assert any(after is not None for _, after in fills[1:])


def test_a_draft_catches_up_only_for_a_request_with_enough_tokens_left_to_win_it_back():
    """A request's first proposal makes the draft run over its prompt and output: worth it for a
    request with many tokens to go, not for one about to end (by its max_tokens, or when it does not
    ignore end-of-sequence, by how far the finished requests that outlived it went). A request whose
    draft is up to date pays no catch-up."""
    from types import SimpleNamespace

    from jaxcb.host.draft import DraftProposer

    runner = SimpleNamespace(model_config=SimpleNamespace(vocab_size=100))
    proposer = DraftProposer(SpeculativeConfig("draft", num_tokens=3), runner, None, page_size=16, max_context=4096)
    proposer.buckets = (1, 2, 4, 8)
    proposer.bucket_s.update({1: 0.030, 4: 0.034, 8: 0.050})
    proposer.token_s, proposer.catch_up_s = 0.002, 0.001  # a 200-token catch-up: 0.2 s

    def request(max_tokens, ignore_eos=True, done=100):
        r = SimpleNamespace(spec=None, num_computed=200, num_preemptions=0, output_ids=[7] * done,
                            params=SimpleNamespace(max_tokens=max_tokens, ignore_eos=ignore_eos), window_page_ids=[])
        proposer.state(r).rate = 0.9
        return r

    # Per step 0.9 + 0.81 + 0.73 = 2.44 tokens at 30 ms each for 10 ms more: 63 ms won per step, in
    # about remaining / 3.44 steps.
    assert proposer.keep([(request(max_tokens=105), 3)], 1, 1) == [0]  # 5 tokens to go: 92 ms < 0.2 s
    assert proposer.keep([(request(max_tokens=300), 3)], 1, 1) == [3]  # 200 to go: 3.7 s
    # Four such requests share the draft's steps: each one's share of what the step saves pays its
    # catch-up (per step 4 x 2.44 tokens for 32 ms more: 51 ms saved, 13 ms each), though one alone
    # would not be worth a bigger bucket (16 - 4 tokens) and three draft steps.
    proposer.buckets = (1, 2, 4, 8, 16)
    proposer.bucket_s[16] = 0.060
    assert proposer.keep([(request(max_tokens=300), 3) for _ in range(4)], 4, 4) == [3] * 4
    assert proposer.keep([(request(max_tokens=300), 3) for _ in range(4)] + [(request(max_tokens=105), 3)], 5, 5)[4] == 0
    # Before a catch-up was measured, a draft token costs what one costs the target in its largest step.
    proposer.catch_up_s = None
    assert proposer.entry_cost(request(max_tokens=300)) == pytest.approx(201 * 0.060 / 16)
    proposer.catch_up_s = 0.001
    caught_up = request(max_tokens=105)
    caught_up.spec.draft_valid, caught_up.spec.draft_epoch = 200, (0, proposer.generation)
    assert proposer.keep([(caught_up, 3)], 1, 1) == [3]
    # Ending by end-of-sequence: what the finished requests that went past 100 tokens produced beyond it.
    for n in [50] * 40 + [106] * 10:
        proposer.observe_finish(SimpleNamespace(output_ids=[7] * n))
    assert proposer.remaining(request(max_tokens=1000, ignore_eos=False)) == 6
    assert proposer.keep([(request(max_tokens=1000, ignore_eos=False), 3)], 1, 1) == [0]
    for n in [400] * 40:
        proposer.observe_finish(SimpleNamespace(output_ids=[7] * n))
    assert proposer.keep([(request(max_tokens=1000, ignore_eos=False), 3)], 1, 1) == [3]


def test_both_apis_serve_it_exactly_and_report_it(tiny_gguf_path, config_path, tiny_model, tmp_path):
    """`jaxcb serve` with n-gram speculation: the OpenAI API (plain and streamed) and gRPC give the tokens
    of the engine without it, greedy and seeded, for a request that opts out too; GetServerInfo and the
    metrics show the method and what was accepted; the pool is whole after."""
    import json as json_

    import httpx

    from jaxcb.host.engine_config import load_config
    from jaxcb.llm import LLM
    from serve.client import Client
    from tests.server_util import SMALL_CONFIG, ServerProcess, free_port, wait_pool_whole

    path = tmp_path / "spec.toml"
    path.write_text(SMALL_CONFIG + '[speculative]\nmethod = "ngram"\nnum_tokens = 3\nadaptive = false\n')
    cfg, params, tok, eos = tiny_model
    offline = LLM.from_params(cfg, params, tok, config=load_config(config_path), eos_ids=eos)
    prompt = repetitive_prompts(cfg.vocab_size, (24,), seed=9)[0]
    http_port = free_port()
    s = ServerProcess(tiny_gguf_path, str(path), "--http-port", str(http_port))
    url = f"http://127.0.0.1:{http_port}/v1/completions"
    try:
        s.wait_serving()
        name = httpx.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=30).json()["data"][0]["id"]
        for sampling in (dict(temperature=0.0), dict(temperature=0.9, seed=11)):
            want = offline.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, **sampling))[0].text
            body = dict(model=name, prompt=prompt, max_tokens=24, ignore_eos=True, **sampling)
            for opt_out in (False, True):
                extra = {"speculative": False} if opt_out else {}
                plain = httpx.post(url, json=body | extra, timeout=60).json()["choices"][0]["text"]
                with httpx.stream("POST", url, json=body | extra | {"stream": True}, timeout=60) as resp:
                    events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
                streamed = "".join(json_.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]")
                with Client(s.target) as c:
                    grpc_text = c.complete(token_ids=prompt, max_tokens=24, ignore_eos=True,
                                           speculative=False if opt_out else None, **sampling).text
                assert plain == streamed == grpc_text == want, (sampling, opt_out)
        with Client(s.target) as c:
            info = wait_pool_whole(c)
        assert info.speculative_method == "ngram" and info.num_speculative_tokens == 3
        assert 0 < info.speculative_acceptance_rate <= 1 and info.speculative_mean_accepted_length > 1
        metrics = httpx.get(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=10).text
        accepted = [float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("jaxcb:spec_decode_num_accepted_tokens_total")]
        assert accepted and accepted[0] > 0, metrics
    finally:
        assert s.stop() == 0, s.output()


def test_rejected_tokens_give_their_pages_back(make_llm):
    """Rolled back: a request's pages never outgrow its tokens after a step, and all come back."""
    spec = make_llm(speculative=NGRAM, page_size=4, num_pages=200)
    engine = spec.engine
    prompts = repetitive_prompts(spec.model_config.vocab_size, (9, 14, 30), seed=8)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True))
    while engine.has_work():
        engine.step()
        for r in engine.scheduler.running:
            assert len(r.page_ids) <= engine.pool.pages_for(r.num_tokens + 1)
    check_speculated(spec)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sliding_window_layers_roll_back_too(make_llm, method):
    """A tiny Gemma 3 (sliding window of 8 tokens: a second page group, trimmed with the first; a
    draft model writes both groups of the request's pages)."""
    import os

    from jaxcb.llm import load_model

    model = load_model(os.path.join(os.path.dirname(__file__), "golden", "tiny_hf", "gemma3"))
    base, spec = both(make_llm, NGRAM if method == "ngram" else SELF_DRAFT, model=model, page_size=4)
    prompts = repetitive_prompts(base.model_config.vocab_size, (9, 30), seed=9)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in base.generate(prompts, params)]
    check_speculated(spec)


def test_the_draft_flags_and_what_a_draft_must_share(make_llm, tiny_model):
    import argparse
    import types

    from jaxcb.cli.args import add_model_args, engine_config
    from jaxcb.host.engine import Engine
    from jaxcb.llm import draft_model_config

    p = argparse.ArgumentParser()
    add_model_args(p)
    spec = engine_config(p.parse_args(["--draft-layers", "1", "--draft-weights", "int8"])).scheduler.speculative
    assert (spec.method, spec.draft_layers, spec.draft_weights, spec.draft_model) == ("draft", 1, "int8", "")
    cfg = tiny_model[0]
    assert draft_model_config(spec, cfg).num_layers == 1
    with pytest.raises(InvalidConfig, match="speculative.draft_layers: 3 is more than .* 2 layers"):
        draft_model_config(dataclasses.replace(spec, draft_layers=3), cfg)
    # A draft must share the vocabulary (checked before anything runs).
    llm = make_llm()
    wrong = types.SimpleNamespace(model_config=dataclasses.replace(cfg, vocab_size=cfg.vocab_size + 1))
    with pytest.raises(InvalidConfig, match="speculative.draft_model: its vocabulary"):
        Engine(llm.engine.runner, None, llm.engine.config.replace(speculative=DRAFT), draft_runner=wrong)
    with pytest.raises(InvalidConfig, match="speculative.method: 'draft' needs a draft model"):
        Engine(llm.engine.runner, None, llm.engine.config.replace(speculative=DRAFT))


def test_the_memory_plan_counts_the_drafts_weights_and_kv(tiny_gguf_path, capsys):
    from jaxcb.cli import main as cli
    from jaxcb.host import memory_plan
    from jaxcb.host.engine_config import make_config
    from jaxcb.llm import draft_model_config, read_model_config

    model = read_model_config()  # SmolLM2: 30 layers
    config = make_config(num_pages=0, max_context=2048)
    spec = SpeculativeConfig("draft", draft_layers=8)
    base = memory_plan.plan_for_model(model, config, budget_bytes=4 << 30, dtype_bytes=4)
    with_draft = memory_plan.plan_for_model(model, config.replace(speculative=spec), budget_bytes=4 << 30,
                                            dtype_bytes=4, draft=draft_model_config(spec, model))
    assert with_draft.kv_bytes_per_token == base.kv_bytes_per_token * 38 // 30
    assert with_draft.draft_kv_bytes_per_token == base.kv_bytes_per_token * 8 // 30
    # The first 8 layers' matrices and norms, float32; the embedding is shared with the target.
    shapes = model.weight_shapes()
    layer = sum(int(np.prod(shapes[n][1:])) for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down",
                                                       "attn_norm", "mlp_norm"))
    assert with_draft.weight_bytes - base.weight_bytes == with_draft.draft_weight_bytes == 8 * layer * 4
    assert with_draft.num_pages < base.num_pages
    # The int8 draft of another file counts all of its own weights.
    other = memory_plan.plan_for_model(
        model, config.replace(speculative=dataclasses.replace(spec, draft_model="x.gguf", draft_weights="int8")),
        budget_bytes=4 << 30, dtype_bytes=4, draft=draft_model_config(spec, model))
    assert other.draft_weight_bytes == memory_plan.weight_bytes(draft_model_config(spec, model), "int8", 4)
    assert cli(["plan", "--model", tiny_gguf_path, "--memory", "1GiB", "--max-context", "256", "--dtype", "float32",
                "--draft-layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "draft model" in out and "1 of its layers" in out and "of which the draft model's" in out


@pytest.mark.parametrize("draft_weights", ["int8", "int4", "bfloat16"])
def test_a_quantized_draft_of_the_target_proposes_well(make_llm, draft_weights):
    """The target's own layers in int8, int4 or bfloat16 as its draft: most greedy proposals hold (a
    bfloat16 draft computes in float32 on the CPU, as a bfloat16 target does)."""
    spec_config = SpeculativeConfig("draft", num_tokens=4, adaptive=False, draft_weights=draft_weights)
    base, spec = both(make_llm, spec_config)
    prompts = repetitive_prompts(base.model_config.vocab_size, (7, 25, 40), seed=11)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in base.generate(prompts, params)]
    assert spec.engine.draft_runner.describe()["weights"] == draft_weights
    assert spec.engine.draft_runner.describe()["compute_dtype"] == "float32"
    # the tiny random model's near-ties make its int4 copy a weaker draft than real models' (0.96 for
    # SmolLM2 in int8); the first layer alone is accepted a few percent of the time
    assert spec.engine.stats().acceptance_rate > {"int8": 0.7, "int4": 0.3, "bfloat16": 0.7}[draft_weights]
    assert draft_weights in spec.engine.describe_speculation()


def test_a_failed_draft_step_decodes_without_proposals(make_llm):
    """The draft's step fails once: those rows decode one token that step (outputs unchanged, nothing
    leaks), the draft's KV counts as lost, and speculation goes on after it."""
    base, spec = both(make_llm, SELF_DRAFT)
    prompts = repetitive_prompts(base.model_config.vocab_size, (9, 21), seed=12)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in base.generate(prompts, params)]
    proposer = spec.engine.scheduler.proposer
    run, failures = proposer.runner.run, []

    def failing_once(*args):
        if not failures:
            failures.append(1)
            raise RuntimeError("injected draft failure")
        return run(*args)

    proposer.runner.run = failing_once
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    assert failures and proposer.generation == 1
    check_speculated(spec)
    assert spec.engine.stats().acceptance_rate == 1.0  # the catch-up after the failure rebuilt the draft's KV
