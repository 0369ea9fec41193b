"""Prompt logprobs (SamplingParams.prompt_logprobs, OpenAI's echo with logprobs) on the tiny model: each
prompt token's logprob given the tokens before it, scored in the step's spare sample rows."""

import numpy as np
import pytest

from jaxcb.host.errors import InvalidRequest
from jaxcb.host.request import SamplingParams


def random_prompts(llm, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, llm.model_config.vocab_size, size=n).tolist() for n in lengths]


def check_against(scored, generated, offset):
    """`scored`'s prompt entries from `offset` on are the logprobs `generated` had as it decoded them."""
    for j, (token, (lp, top)) in enumerate(zip(generated.token_ids, generated.logprobs)):
        got_lp, rank, got_top = scored.prompt_logprobs[offset + j]
        assert got_lp == pytest.approx(lp, abs=2e-4), j
        assert rank == 1  # greedy: the decoded token was the most likely one
        assert [t for t, _ in got_top] == [t for t, _ in top], j
        assert [v for _, v in got_top] == pytest.approx([v for _, v in top], abs=2e-4)


def test_prompt_logprobs_are_what_decoding_the_same_tokens_gave(make_llm):
    """A prompt and its greedy continuation, scored as one prompt beside decoding requests (in the rows
    they leave spare, over several steps): the continuation's entries are the logprobs decoding gave."""
    llm = make_llm()  # 8 sample rows a step: a 40-token prompt takes several steps
    prompt = random_prompts(llm, (9,))[0]
    gen = llm.generate([prompt], SamplingParams(max_tokens=31, logprobs=3, ignore_eos=True))[0]
    text = prompt + gen.token_ids
    others = random_prompts(llm, (5, 12, 30), seed=1)
    params = [SamplingParams(max_tokens=0, prompt_logprobs=3)] + [SamplingParams(max_tokens=20, ignore_eos=True)] * 3
    scored, *rest = llm.generate([text] + others, params)
    assert scored.token_ids == [] and scored.finish_reason == "length"
    assert len(scored.prompt_logprobs) == len(text) and scored.prompt_logprobs[0] is None
    check_against(scored, gen, len(prompt))
    for (lp, rank, top), token in zip(scored.prompt_logprobs[1:], text[1:]):
        assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1] and lp <= top[0][1] + 1e-6
        assert rank >= 1 and (rank == 1) == (token == top[0][0] or lp == pytest.approx(top[0][1]))
        if rank <= 3:
            assert dict(top)[token] == pytest.approx(lp)
    alone = llm.generate(others, SamplingParams(max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in rest] == [o.token_ids for o in alone]  # the scored rows left them unchanged


def test_generation_goes_on_after_the_scored_prompt(make_llm):
    llm = make_llm()
    prompt = random_prompts(llm, (23,), seed=3)[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=0, n=2))
    for o in out:
        assert o.token_ids == plain.token_ids
        assert len(o.prompt_logprobs) == len(prompt) and all(top == () for _, _, top in o.prompt_logprobs[1:])
    assert out[0].prompt_logprobs == out[1].prompt_logprobs
    assert plain.prompt_logprobs is None


def test_a_scored_prompt_takes_cached_pages_only_with_their_scores_and_keeps_them_through_preemption(make_llm):
    """A cached prefix is taken only as far as its pages keep their tokens' logprobs (a scoring request
    registered them, with as many alternatives), less its last page (the next page's first token's logprob
    needs that page's last position); a tiny pool preempts the scoring requests mid-prompt: the logprobs
    are those of an ample pool."""
    ample = make_llm(num_pages=256)
    tiny = make_llm(num_pages=14)
    prompts = random_prompts(ample, (60, 33, 45, 20, 52, 9), seed=4)
    params = [SamplingParams(max_tokens=20, ignore_eos=True, prompt_logprobs=2 if i % 2 == 0 else None)
              for i in range(len(prompts))]
    ample.generate(prompts[1:2], SamplingParams(max_tokens=1))  # caches prompts[1]'s pages, without scores
    scored = ample.generate(prompts[1:2], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert scored.num_cached_tokens == 0 and len(scored.prompt_logprobs) == len(prompts[1])
    want = ample.generate(prompts, params)
    again = ample.generate(prompts[:1], params[:1])[0]  # its pages are cached now, with their scores
    assert again.num_cached_tokens == 32 and len(again.prompt_logprobs) == len(prompts[0])
    wider = ample.generate(prompts[:1], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    assert wider.num_cached_tokens == 0  # three alternatives asked, two kept
    assert [e[0] for e in wider.prompt_logprobs[1:]] == pytest.approx([e[0] for e in again.prompt_logprobs[1:]],
                                                                      abs=2e-4)
    got = tiny.generate(prompts, params)
    assert tiny.engine.stats().preemptions > 0
    for a, b, p in zip(got, want, params):
        assert a.token_ids == b.token_ids
        if p.prompt_logprobs is None:
            assert a.prompt_logprobs is None
            continue
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs[1:] + again.prompt_logprobs[1:] * (a is got[0]),
                        b.prompt_logprobs[1:] + b.prompt_logprobs[1:] * (a is got[0])):
            assert x[0] == pytest.approx(y[0], abs=2e-4) and [t for t, _ in x[2]] == [t for t, _ in y[2]]


def test_prompt_logprobs_limits():
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        SamplingParams(max_tokens=0)
    SamplingParams(max_tokens=0, prompt_logprobs=0)


def test_continuations_of_one_context_score_it_once(make_llm):
    """lm-eval's multiple choice: one context, several continuations, each scored. With prefix caching the
    later ones take the context's pages with their scores (all but the last full page's K/V) and give the
    logprobs of the engine without the cache."""
    rng = np.random.default_rng(9)
    context = rng.integers(3, 250, size=70).tolist()  # four full pages and a part
    prompts = [context + rng.integers(3, 250, size=int(k)).tolist() for k in (5, 9, 3, 12)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    outs = {}
    for on in (True, False):
        llm = make_llm(prefix_caching=on)
        outs[on] = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)
        computed = llm.engine.stats().prompt_tokens_computed
        outs[on, "computed"] = computed
    assert [o.num_cached_tokens for o in outs[True]] == [0, 48, 48, 48]
    assert outs[False, "computed"] - outs[True, "computed"] == 3 * 48
    together = make_llm(prefix_caching=True)  # all at once: the others wait for the first's context pages
    at_once = together.generate(prompts, params)
    assert sorted(o.num_cached_tokens for o in at_once) == [0, 48, 48, 48]
    for a, b in zip(at_once, outs[False]):
        assert [e[0] for e in a.prompt_logprobs[1:]] == pytest.approx([e[0] for e in b.prompt_logprobs[1:]], abs=2e-4)
    for a, b in zip(outs[True], outs[False]):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        assert [e[0] for e in a.prompt_logprobs[1:]] == pytest.approx([e[0] for e in b.prompt_logprobs[1:]], abs=2e-4)
        assert sum(x[1] != y[1] for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])) <= 1  # (a near-tie)
