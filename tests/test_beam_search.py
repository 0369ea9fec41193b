"""Beam search (jaxcb.host.beam_search; LLM.beam_search; the OpenAI API's use_beam_search)."""

import math

import numpy as np
import pytest

from jaxcb.host.beam_search import BeamSearch
from jaxcb.host.errors import InvalidRequest
from jaxcb.host.request import SamplingParams


def _run(search: BeamSearch, logprobs_of):
    """Drive a search with a scorer: logprobs_of(tokens) -> {token: logprob}; each beam's 2W best."""
    while not search.done:
        tops = []
        for prompt in search.prompts():
            dist = logprobs_of(prompt)
            tops.append(sorted(dist.items(), key=lambda kv: -kv[1])[:search.candidates_per_beam])
        search.advance(tops)
    return search.best()


def test_the_best_beams_by_length_penalised_score_with_ends_and_the_length_limit():
    """A small world: after the prompt, "1" then EOS is likelier in sum than "2" and anything after it,
    though "2" is likelier first (greedy takes it); with the length penalty the longer beams win. Finished
    beams drop the end token (include_stop keeps it), stop tokens report themselves, max_tokens and the
    context limit end the live ones."""
    EOS, STOP = 9, 8
    table = {(): {1: math.log(0.4), 2: math.log(0.6)},
             (1,): {EOS: math.log(0.9), 3: math.log(0.1)},
             (2,): {3: math.log(0.5), 4: math.log(0.3), STOP: math.log(0.2)}}

    def dist(tokens):
        return table.get(tuple(tokens[1:]), {5: math.log(0.5), 6: math.log(0.5)})

    # By summed logprob / length (the prompt counted): 0.15 over 4 tokens beats 0.36 over 2.
    best = _run(BeamSearch([0], 2, 3, eos_ids=(EOS,), stop_token_ids=(STOP,)), dist)
    assert [b.tokens for b in best] == [[2, 3, 5], [2, 3, 6]] and {b.finish_reason for b in best} == {"length"}
    best = _run(BeamSearch([0], 2, 3, eos_ids=(EOS,), stop_token_ids=(STOP,), length_penalty=0.0), dist)
    assert [b.tokens for b in best] == [[1], [2, 3, 5]]  # by the sum alone: 0.36, then 0.15
    assert best[0].finish_reason == "stop" and best[0].stop_token is None and best[1].finish_reason == "length"
    assert best[0].logprob == pytest.approx(math.log(0.4 * 0.9))
    with_stop = _run(BeamSearch([0], 3, 2, eos_ids=(EOS,), stop_token_ids=(STOP,), include_stop=True,
                                length_penalty=0.0), dist)
    assert [b.tokens for b in with_stop] == [[1, EOS], [2, 3], [2, 4]]  # by summed logprob alone
    stopped = _run(BeamSearch([0], 4, 2, eos_ids=(EOS,), stop_token_ids=(STOP,), length_penalty=0.0), dist)
    assert any(b.stop_token == STOP and b.tokens == [2] for b in stopped)
    ignoring = _run(BeamSearch([0], 1, 3, eos_ids=(EOS,), ignore_eos=True), dist)
    assert ignoring[0].tokens == [2, 3, 5] and ignoring[0].finish_reason == "length"  # greedy, width 1
    limited = _run(BeamSearch([0, 0, 0], 1, 10, eos_ids=(EOS,), max_context=5), dist)
    assert len(limited[0].tokens) == 2 and limited[0].finish_reason == "length"  # 3 + 2 tokens fill it
    with pytest.raises(InvalidRequest, match="n: the beam width must be between 1 and 10"):
        BeamSearch([0], 11, 4)


def test_llm_beam_search_is_greedy_at_width_one_and_its_sums_are_the_models(make_llm):
    """Width 1 gives greedy decoding's tokens; every beam's cumulative logprob is the sum of its tokens'
    logprobs as the model scores the whole sequence (prompt logprobs), best first by the length-penalised
    score."""
    llm = make_llm()
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]]
    greedy = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    one = llm.beam_search(prompts, width=1, max_tokens=6, ignore_eos=True)
    assert [r[0].token_ids for r in one] == [g.token_ids for g in greedy]
    results = llm.beam_search(prompts, width=3, max_tokens=6, ignore_eos=True, length_penalty=0.0)
    assert [{b.request_id for b in r} for r in results] == [{"beam-0"}, {"beam-1"}]  # each prompt its own id
    for prompt, beams in zip(prompts, results):
        assert len(beams) == 3 and len({tuple(b.token_ids) for b in beams}) == 3
        sums = [b.cumulative_logprob for b in beams]
        assert sums == sorted(sums, reverse=True)
        for b in beams:
            scored = llm.generate([prompt + b.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
            own = sum(entry[0] for entry in scored.prompt_logprobs[len(prompt):])  # (entry j: token j's)
            assert own == pytest.approx(b.cumulative_logprob, abs=1e-3), (own, b.cumulative_logprob)
    assert not llm.engine.has_work()
    np.testing.assert_equal(llm.engine.pool.num_free, llm.engine.pool.num_usable)
