"""Offline generation on the tiny random-weight model: the engine path, its results, its errors."""

import numpy as np
import pytest

from jaxcb.host.errors import InvalidRequest
from jaxcb.host.request import SamplingParams


def test_batched_greedy_equals_one_at_a_time(make_llm):
    llm = make_llm()
    rng = np.random.default_rng(0)
    vocab = llm.model_config.vocab_size
    prompts = [rng.integers(3, vocab, size=n).tolist() for n in (1, 5, 16, 17, 33, 70, 2, 40)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    batched = llm.generate(prompts, params)
    for prompt, out in zip(prompts, batched):
        alone = llm.generate([prompt], params)[0]
        assert out.token_ids == alone.token_ids
        assert len(out.token_ids) == 12 and out.finish_reason == "length"
        assert out.prompt_token_ids == prompt


def test_text_prompts_and_eos(make_llm):
    llm = make_llm()
    outs = llm.generate(["the weather", "hi"], SamplingParams(max_tokens=30), chat=True)
    for out in outs:
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":
            assert out.token_ids[-1] == 2
        assert out.text == llm.tokenizer.decode(out.token_ids)


def test_eos_ends_a_request_unless_ignored(make_llm):
    llm = make_llm()
    prompt = [5, 6, 7]
    free_run = llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
    # Make the 4th generated token a stop token: the request must end right there.
    stopped = llm.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=(free_run[3],)))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free_run[: free_run.index(free_run[3]) + 1]


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), r"max_tokens: must be >= 1, got 0"),
    (dict(max_tokens=-3), r"max_tokens: must be >= 1"),
    (dict(temperature=-1.0), r"temperature: must be >= 0"),
    (dict(temperature=float("nan")), r"temperature: must be a finite number"),
    (dict(top_p=0.0), r"top_p: must be in \(0, 1\]"),
    (dict(top_k=-2), r"top_k: must be >= -1"),
    (dict(seed=-2**63 - 1), r"seed: must be >= -9223372036854775808"),
    (dict(seed=2**63), r"seed: must be <= 9223372036854775807"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_vllms_spellings_of_off_and_negative_seeds_are_taken():
    """top_k -1 is vLLM's "off" (0 here); seed -1 is vLLM's "no seed"; another negative seed, which vLLM takes,
    is a seed modulo 2**63; min_p 1 (vLLM's upper bound) is taken."""
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == 2**63 - 2 and SamplingParams(seed=5).seed == 5
    assert SamplingParams(min_p=1.0).min_p == 1.0


def test_bad_prompts_name_the_field_and_limit(make_llm):
    llm = make_llm(max_context=128)
    vocab = llm.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"prompt_token_ids: token id {vocab} is outside the vocabulary \[0, {vocab}\)"):
        llm.generate([[1, vocab]])
    with pytest.raises(ValueError, match=r"token id -1 is outside the vocabulary"):
        llm.generate([[1, -1]])
    with pytest.raises(ValueError, match=r"prompt: 200 tokens; the limit is 127"):
        llm.generate([[5] * 200])
    with pytest.raises(ValueError, match=r"max_tokens: prompt \(100\) \+ max_tokens \(50\) exceeds the context limit of 128"):
        llm.generate([[5] * 100], SamplingParams(max_tokens=50))
    with pytest.raises(ValueError, match=r"prompt: must not be empty"):
        llm.generate([[]])
    with pytest.raises(InvalidRequest, match=r"^prompt: holds a lone surrogate"):  # (a TypeError from the tokenizer before)
        llm.generate(["ok \ud800"])
    with pytest.raises(InvalidRequest, match=r"^conversations\[0\]\[0\]\.content: holds a lone surrogate"):
        llm.chat([[{"role": "user", "content": "\udfff"}]])
    # A bad request in a list fails the call before anything runs; the engine is untouched.
    with pytest.raises(ValueError, match=r"request 1: "):
        llm.generate([[5, 6], [vocab + 7]])
    assert not llm.engine.has_work()


def test_request_larger_than_the_whole_cache_is_rejected(make_llm):
    llm = make_llm(num_pages=4, max_context=256)  # 3 usable pages of 16 tokens
    with pytest.raises(ValueError, match=r"max_tokens: prompt \+ max_tokens needs 4 KV pages but the cache holds only 3"):
        llm.generate([[5] * 40], SamplingParams(max_tokens=10))
