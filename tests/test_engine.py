"""The continuous-batching engine on the tiny random-weight model."""

import numpy as np
import pytest

from jaxcb.host.errors import InvalidRequest
from jaxcb.host.request import FinishReason, SamplingParams, banned_tokens, repeats, resolve_bad_words
from jaxcb.host.structured import Constraint


def random_prompts(llm, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, llm.model_config.vocab_size, size=n).tolist() for n in lengths]


def test_chunked_prefill_gives_the_same_tokens(make_llm):
    small_chunks = make_llm(max_prefill_tokens=16)
    whole = make_llm()
    prompts = random_prompts(whole, (100, 37, 3, 64))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    a = small_chunks.generate(prompts, params)
    b = whole.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


@pytest.mark.parametrize("sampled", [False, True])
def test_preemption_under_a_tiny_pool_gives_identical_outputs(make_llm, sampled):
    ample = make_llm(num_pages=256)
    tiny = make_llm(num_pages=14)  # 13 pages of 16 tokens for 8 requests of up to 70 tokens
    prompts = random_prompts(ample, (20, 33, 5, 17, 40, 9, 28, 12), seed=1)
    params = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.9 if sampled else 0.0, top_p=0.9,
                             seed=100 + i) for i in range(len(prompts))]
    want = ample.generate(prompts, params)
    got = tiny.generate(prompts, params)
    assert tiny.engine.stats().preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_seeded_sampling_ignores_batch_composition(make_llm):
    llm = make_llm()
    prompts = random_prompts(llm, (7, 30, 12, 50, 3), seed=2)
    p = SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[0]], p)[0].token_ids
    others = [SamplingParams(max_tokens=5 + i, temperature=0.7, seed=i, ignore_eos=True) for i in range(4)]
    together = llm.generate(prompts, [p] + others)[0].token_ids
    assert alone == together
    unseeded = llm.generate([prompts[0]] * 2, SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True))
    assert unseeded[0].token_ids != unseeded[1].token_ids  # fresh seeds when none is given


def test_no_compilation_after_warmup_for_200_random_requests(make_llm):
    llm = make_llm(num_pages=40, decode_batch=(1, 2, 4, 8), prefill_tokens=(16, 32, 64), max_prefill_tokens=64)
    seen = []
    n = llm.warmup(progress=lambda i, total, shape: seen.append((i, total)))
    assert seen[-1] == (n, n)
    engine = llm.engine
    # One forward pass per step shape; one sampler per row count, shared by the shapes with those rows.
    compiled = engine.runner._compiled
    rows = {(shape.seqs, shape.extra_rows, shape.history) for shape in compiled}
    assert len(compiled) == n and len({id(sampler) for _, sampler in compiled.values()}) == len(rows) < n
    before = engine.stats().compilations
    rng = np.random.default_rng(3)
    submitted = 0
    finished = 0
    while finished < 200:
        for _ in range(rng.integers(0, 4)):
            if submitted < 200:
                plen = int(rng.integers(1, 150))
                params = SamplingParams(
                    max_tokens=int(rng.integers(1, 256 - plen)) if rng.random() < 0.1 else int(rng.integers(1, 40)),
                    temperature=float(rng.choice([0.0, 0.7, 1.3])), top_k=int(rng.choice([0, 5])),
                    top_p=float(rng.choice([1.0, 0.8])), repetition_penalty=float(rng.choice([1.0, 1.2])),
                    ignore_eos=bool(rng.random() < 0.5), logprobs=int(rng.choice([0, 3])),
                    prompt_logprobs=[None, None, None, 0, 2][int(rng.integers(0, 5))])
                engine.add_request(rng.integers(3, 280, size=plen).tolist(), params)
                submitted += 1
        finished += sum(ev.finished for ev in engine.step())
    # With async scheduling a step may be in flight past the last final event (one launched before its rows'
    # sampled EOS was seen: the sampling is unseeded, so whether the last request ends by EOS varies): drained.
    while engine.has_work():
        engine.step()
    assert engine.stats().compilations == before
    assert engine.stats().preemptions > 0  # the pool was tight enough to exercise preemption too


def test_abort_frees_pages_within_one_step(make_llm):
    llm = make_llm()
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True))
           for p in random_prompts(llm, (20, 30, 40))]
    for _ in range(3):
        engine.step()
    in_use = engine.stats().pages_in_use
    engine.abort(ids[1])
    events = engine.step()
    ends = [e for e in events if e.finished]
    assert [(e.request_id, e.finish_reason) for e in ends] == [(ids[1], FinishReason.ABORT)]
    assert engine.stats().pages_in_use < in_use
    engine.abort("no-such-request")  # unknown ids are ignored
    rest = engine.run_until_done()
    assert {e.request_id for e in rest if e.finished} == {ids[0], ids[2]}


def test_stop_strings_cut_the_text_and_never_stream_it(make_llm):
    llm = make_llm()
    prompt = llm.tokenizer.encode("the weather is")
    free = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0].text
    clean = free.replace("\ufffd", "")
    stop = next(clean[i:i + 2] for i in range(5, len(clean) - 2) if clean[i:i + 2].strip() and clean[i:i + 2] in free)
    cut = free.index(stop)
    streamed = []
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,)), callback=streamed.append)
    engine.run_until_done()
    text = "".join(e.text for e in streamed)
    assert text == free[:cut]
    assert streamed[-1].finished and streamed[-1].finish_reason == FinishReason.STOP
    assert all(stop not in e.text for e in streamed)
    # include_stop_str_in_output (vLLM's): the same end, the stop string kept (the shorter of two that match).
    kept = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop + "\u0001", stop, stop[0]),
                                                 include_stop_str_in_output=True))[0]
    first = min(free.index(stop), free.index(stop[0]))
    assert kept.text == free[:first + 1] and kept.finish_reason == FinishReason.STOP


def test_min_tokens_holds_back_stop_tokens_and_stop_strings_until_then(make_llm):
    """vLLM's min_tokens: before a sample has that many tokens it cannot sample a stop (or end-of-sequence)
    token, and a stop string does not end it; from then on they end it as before. A row beside it in the
    same steps keeps its tokens; a grammar that can only end still ends its request."""
    llm = make_llm()
    prompts = random_prompts(llm, (7, 5))
    free = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    ids = free[0].token_ids
    stop_id = ids[2]
    k = ids.index(stop_id)
    stopped = llm.generate([prompts[0]], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stop_id,)))[0]
    assert stopped.token_ids == ids[:k + 1] and stopped.finish_reason == FinishReason.STOP
    held, beside = llm.generate(prompts, [
        SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stop_id,), min_tokens=k + 4),
        SamplingParams(max_tokens=24, ignore_eos=True)])
    assert held.token_ids[:k] == ids[:k] and held.token_ids[k] != stop_id  # held back where it came
    assert stop_id not in held.token_ids[:k + 4] and len(held.token_ids) >= k + 4
    assert (held.finish_reason == FinishReason.STOP) == (held.token_ids[-1] == stop_id)
    assert beside.token_ids == free[1].token_ids
    # A stop string before min_tokens goes by: with min_tokens = max_tokens the free text comes out whole.
    text = free[0].text
    stop = next(text[i:i + 2] for i in range(len(text) - 2) if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    assert llm.generate([prompts[0]], SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,)))[0].text != text
    whole = llm.generate([prompts[0]], SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,), min_tokens=24))[0]
    assert whole.text == text and whole.finish_reason == FinishReason.LENGTH
    # End-of-sequence tokens: held back unless ignore_eos (then they do not end anything).
    p = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(5,))
    assert p.held_ends((2,), 0) == p.held_ends((2,), 2) == (5, 2) and p.held_ends((2,), 3) == ()
    assert SamplingParams(max_tokens=8, min_tokens=3, ignore_eos=True).held_ends((2,), 0) == ()
    # In the step's mask (bit t of word t // 32); one that would allow nothing is left as it was.
    from jaxcb.host.batch import SamplingRow, narrow_row

    allowed = np.full((2, 2), -1, np.int32)
    allowed[1] = [1 << 2, 0]  # a grammar that allows only the end-of-sequence token 2
    row = SamplingRow(SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(31, 33)), 0, [1], [7])
    for i in (0, 1):
        narrow_row(allowed, i, row, (2,))
    assert allowed.view(np.uint32).tolist() == [[0xFFFFFFFF & ~(1 << 31) & ~(1 << 2), 0xFFFFFFFF & ~(1 << 1)],
                                                [1 << 2, 0]]
    with pytest.raises(InvalidRequest, match="min_tokens: must be <= 8, got 9"):
        SamplingParams(max_tokens=8, min_tokens=9)
    # A grammar that can only end ends the request, min_tokens or not.
    choice = llm.generate([prompts[1]], SamplingParams(max_tokens=20, min_tokens=20,
                                                       structured=Constraint.choice(["ab", "cd"])))[0]
    assert choice.text in ("ab", "cd") and choice.finish_reason == FinishReason.STOP


def test_allowed_token_ids_are_the_only_tokens_sampled(make_llm):
    """vLLM's allowed_token_ids: greedy and random samples come from the list only (greedy: the best of
    them); a row beside it keeps its tokens; with a grammar that allows none of them, the grammar decides."""
    llm = make_llm()
    prompts = random_prompts(llm, (6, 5))
    free = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    pool = sorted(set(free[0].token_ids[1:4]) | {3, 17})
    logits_order = llm.generate([prompts[0]], SamplingParams(max_tokens=1, ignore_eos=True, logprobs=20))[0]
    greedy, beside = llm.generate(prompts, [SamplingParams(max_tokens=12, ignore_eos=True, allowed_token_ids=pool),
                                            SamplingParams(max_tokens=12, ignore_eos=True)])
    assert set(greedy.token_ids) <= set(pool) and beside.token_ids == free[1].token_ids
    ranked = [t for t, _ in logits_order.logprobs[0][1] if t in pool]  # the first token: the best allowed one
    assert not ranked or greedy.token_ids[0] == ranked[0]
    drawn = llm.generate([prompts[0]] * 2, [SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=s,
                                                           allowed_token_ids=pool) for s in (1, 2)])
    assert all(set(o.token_ids) <= set(pool) for o in drawn) and len({t for o in drawn for t in o.token_ids}) > 1
    choice = llm.generate([prompts[1]], SamplingParams(max_tokens=20, allowed_token_ids=(3,),
                                                       structured=Constraint.choice(["ab", "cd"])))[0]
    assert choice.text in ("ab", "cd") and choice.finish_reason == FinishReason.STOP
    with pytest.raises(InvalidRequest, match=r"allowed_token_ids: token id 100000 is outside the vocabulary"):
        llm.generate([prompts[0]], SamplingParams(max_tokens=2, allowed_token_ids=(5, 100000)))


def _completes(tokens, word) -> bool:
    return any(tuple(tokens[i:i + len(word)]) == word for i in range(len(tokens) - len(word) + 1))


def test_bad_words_are_never_completed_and_match_a_token_by_token_ban(make_llm):
    """vLLM's bad_words, as token sequences: a one-token word is never sampled, a longer one never completed
    (its last token is banned only after the rest of it). Each output equals a one-token-at-a-time greedy
    reference that bans, at every step, what banned_tokens names (with logit_bias -100), under async
    scheduling (a word of several tokens waits for the newest one); a row beside keeps its tokens."""
    llm = make_llm()
    prompts = random_prompts(llm, (7, 5))
    free = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    path = free[0].token_ids
    for words in (((path[3],),), ((path[5], path[6]),), ((path[8], path[9], path[10]), (path[2],))):
        got, beside = llm.generate(prompts, [SamplingParams(max_tokens=24, ignore_eos=True, bad_word_ids=words),
                                             SamplingParams(max_tokens=24, ignore_eos=True)])
        reference = []
        for _ in range(24):
            ban = {t: -100.0 for t in banned_tokens(words, reference)}
            step = llm.generate([prompts[0] + reference], SamplingParams(max_tokens=1, ignore_eos=True, logit_bias=ban))
            reference.append(step[0].token_ids[0])
        assert got.token_ids == reference and got.token_ids != path, words
        assert not any(_completes(got.token_ids, w) for w in words)
        assert beside.token_ids == free[1].token_ids
    drawn = llm.generate([prompts[0]] * 4, [SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=s,
                                                           bad_word_ids=((path[5], path[6]), (path[1],)))
                                            for s in range(4)])
    assert not any(_completes(o.token_ids, w) for o in drawn for w in ((path[5], path[6]), (path[1],)))
    with pytest.raises(InvalidRequest, match=r"bad_words: token id 100000 is outside the vocabulary"):
        llm.generate([prompts[0]], SamplingParams(max_tokens=2, bad_word_ids=((5, 100000),)))
    with pytest.raises(InvalidRequest, match=r"bad_words: at most 128 words"):
        SamplingParams(bad_words=("x",) * 129)
    with pytest.raises(InvalidRequest, match=r"bad_words: each word must be a string of 1..256 characters"):
        SamplingParams(bad_words=(" ",))


def test_bad_words_are_spelt_as_vllm_spells_them(tiny_model):
    """A word's tokens as it starts a text, and after a space where that gives other tokens of the same
    count; more than 128 sequences in all, or a word of more than 64 tokens (each step compares the output's
    end with it), is refused, naming the field."""
    tok = tiny_model[2]
    for word in ("hello", " world", "ab"):
        plain = tuple(tok.encode(word.lstrip(), add_bos=False))
        spaced = tuple(tok.encode(" " + word.lstrip(), add_bos=False))
        want = [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        assert list(resolve_bad_words(SamplingParams(bad_words=(word,)), tok).bad_word_ids) == want
    many = tuple(f"w{i} x" for i in range(128))
    with pytest.raises(InvalidRequest, match=r"bad_words: \d+ token sequences .*the limit is 128"):
        resolve_bad_words(SamplingParams(bad_words=many), tok)
    with pytest.raises(InvalidRequest, match=r"bad_words: a word of \d+ tokens; the limit is 64 a word"):
        resolve_bad_words(SamplingParams(bad_words=("xq" * 100,)), tok)


def test_the_python_api_spells_each_requests_bad_words_once(make_llm):
    """LLM.generate spells a request's bad words once (checked and run on the same spelling; it had spelt them
    twice, once to check and once to run)."""
    llm = make_llm()
    tok = llm.engine.tokenizer
    calls = []
    encode = tok.encode
    tok.encode = lambda text, *a, **kw: calls.append(text) or encode(text, *a, **kw)
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, bad_words=("hello",)))
    finally:
        del tok.encode
    assert calls == ["hello", " hello"]


def test_repetition_detection_ends_a_repeating_output_as_vllm_finds_it(make_llm):
    """vLLM's repetition_detection: the output ends (finish reason repetition) with the first token after
    which it ends with a pattern of min..max tokens repeated min_count times, not before min_tokens; the
    check itself is vLLM's check_sequence_repetition."""
    assert repeats([5, 1, 2, 3, 1, 2, 3], (3, 1, 2)) and not repeats([5, 1, 2, 3, 1, 2, 3], (2, 1, 2))
    assert not repeats([1, 2, 3, 1, 2, 3], (3, 1, 3)) and repeats([4, 4, 4], (3, 1, 3))
    assert not repeats([4, 4, 4], (3, 2, 2)) and repeats([4, 4, 4, 4], (3, 2, 2))
    assert not repeats([4, 4, 4, 4], (0, 0, 2)) and not repeats([9, 1, 2, 1, 2, 1, 2], (3, 3, 2))
    llm = make_llm()
    prompt = random_prompts(llm, (6,))[0]
    one = dict(max_tokens=20, ignore_eos=True, allowed_token_ids=(7,))
    out = llm.generate([prompt], SamplingParams(**one, repetition_detection=(2, 1, 3)))[0]
    assert out.token_ids == [7, 7, 7] and out.finish_reason == FinishReason.REPETITION
    assert out.stop_reason == "repetition_detected"
    late = llm.generate([prompt], SamplingParams(**one, min_tokens=5, repetition_detection=(2, 1, 3)))[0]
    assert late.token_ids == [7] * 5 and late.finish_reason == FinishReason.REPETITION
    free = llm.generate([prompt], SamplingParams(**one, repetition_detection=(0, 0, 0)))[0]
    assert len(free.token_ids) == 20 and free.finish_reason == FinishReason.LENGTH
    for bad, message in (((4, 5, 2), "repetition_detection.min_pattern_size: must be <= max_pattern_size"),
                         ((4, 1, 1), "repetition_detection.min_count: must be >= 2"),
                         ((300, 1, 2), "repetition_detection.max_pattern_size: must be <= 256")):
        with pytest.raises(InvalidRequest, match=message):
            SamplingParams(repetition_detection=bad)


def test_a_thinking_budget_forces_the_end_tag_once_the_thinking_has_spent_it(make_llm):
    """vLLM's thinking_token_budget: the thinking is the tokens after the last start tag (the prompt's count),
    with no end tag after it; once it holds the budget the end tag is the next token, then the output goes on
    as a prompt ending there would (greedy); a prompt whose thinking is closed, or never opened, is untouched;
    under async scheduling (a row near its budget waits for its newest token)."""
    llm = make_llm()
    prompt = random_prompts(llm, (6,))[0]
    start, end = 3, 4  # (two ids the tiny model's greedy paths here never reach on their own)
    tags = dict(thinking_tags=(start, end))

    def run(ids, budget, n=12):
        return llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True, thinking_token_budget=budget,
                                                  **tags))[0].token_ids

    def free(ids, n=12):
        return llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids

    for opened, budget in ((prompt + [start], 3), (prompt + [start, 9, 9], 3), (prompt + [start], 0)):
        thought = len(opened) - 1 - opened.index(start)  # (tokens after the start tag in the prompt)
        left = max(0, budget - thought)
        got = run(opened, budget)
        head = free(opened, left) if left else []
        assert start not in head and end not in head
        assert got[:left] == head and got[left] == end, (opened[-3:], budget, got)
        assert got[left + 1:] == free(opened + got[:left + 1], 12 - left - 1)
    closed = prompt + [start, 9, end]
    assert run(closed, 1) == free(closed)
    assert run(prompt, 0) == free(prompt)  # (no start tag, in the prompt or the output)
    with pytest.raises(InvalidRequest, match="thinking_token_budget: this model has no thinking tags"):
        SamplingParams(thinking_token_budget=5)
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None


def test_the_prefix_cache_is_reset_only_while_nothing_runs(make_llm):
    """Engine.reset_prefix_cache (vLLM's /reset_prefix_cache): refused while a request runs or waits (its pages'
    hashes are in use), done when idle: the next identical prompt is computed again, its tokens the same."""
    llm = make_llm()
    prompt = random_prompts(llm, (70,))[0]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    assert llm.generate([prompt], params)[0].num_cached_tokens >= 64
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=20, ignore_eos=True), request_id="busy")
    refused = engine.reset_prefix_cache()
    engine.step()
    assert refused.result(timeout=0) is False
    while engine.has_work():
        engine.step()
    done = engine.reset_prefix_cache()
    while engine.has_work():
        engine.step()
    assert done.result(timeout=0) is True and engine.pool.num_cached == 0
    again = llm.generate([prompt], params)[0]
    assert again.num_cached_tokens == 0 and again.token_ids == first.token_ids


def test_logprobs_and_stats(make_llm):
    llm = make_llm()
    out = llm.generate(random_prompts(llm, (9,)), SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for token, (lp, top) in zip(out.token_ids, out.logprobs):
        assert len(top) == 3 and top[0][0] == token  # greedy: the chosen token is the top one
        assert lp == pytest.approx(top[0][1]) and top[0][1] >= top[1][1] >= top[2][1]
    st = llm.engine.stats()
    assert st.output_tokens == 5 and st.prompt_tokens_computed == 9 and st.running == 0 and st.waiting == 0
    assert 0 <= st.padding_fraction < 1 and 0 < st.page_utilization <= 1


def test_processed_logprobs_mode_gives_the_logprobs_of_the_drawn_distribution(make_llm):
    """--logprobs-mode processed_logprobs: a sampled token's logprobs are of what it was drawn from (here its top 3,
    summing to 1; the rest -9999), the tokens those of the default mode, whose logprobs are the model's own."""
    prompts = random_prompts(make_llm(), (9, 14))
    params = SamplingParams(max_tokens=6, temperature=0.8, top_k=3, logprobs=5, seed=11, ignore_eos=True)
    raw = make_llm().generate(prompts, params)
    processed = make_llm(logprobs_mode="processed_logprobs").generate(prompts, params)
    for a, b in zip(raw, processed):
        assert a.token_ids == b.token_ids
        for (lp, top), (raw_lp, raw_top) in zip(b.logprobs, a.logprobs):
            values = [v for _, v in top]
            assert abs(sum(np.exp(values[:3])) - 1) < 1e-4 and values[3:] == [-9999.0, -9999.0]
            assert lp >= values[2] and lp != raw_lp  # (the drawn one is among the 3 kept)
            assert [t for t, _ in top[:3]] == [t for t, _ in raw_top[:3]]


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
def test_pallas_attention_gives_the_reference_tokens(make_llm, kernel):
    """The engine with the Pallas kernels (interpret mode) generates exactly the reference's greedy
    tokens: decode batches, whole prompts and prefill chunks that start mid-page."""
    from jaxcb.model.llama import Attention

    # Two token buckets (8: decode batches; 32: chunks of at most 20 prompt tokens beside decode rows):
    # every step kind the test is about, at a third of the interpreted kernels' compile time.
    buckets = dict(max_prefill_tokens=20, decode_batch=(8,), prefill_tokens=(32,))
    reference = make_llm(attention="xla", **buckets)
    pallas = make_llm(attention="pallas", **buckets)
    assert pallas.engine.runner.attention == Attention("gpu", interpret=True)
    pallas.engine.runner.attention = Attention(kernel, interpret=True)
    prompts = random_prompts(reference, (1, 15, 16, 17, 45, 70), seed=4)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in reference.generate(prompts, params)]
    assert [o.token_ids for o in pallas.generate(prompts, params)] == want


def test_a_final_event_reaches_its_caller_after_the_request_gave_its_pages_back(make_llm):
    """A caller that reads the engine's state on its final event sees its pages freed and its id free."""
    llm = make_llm()
    engine = llm.engine
    seen = []

    def on_event(event):
        if event.finished:
            seen.append((engine.pool.num_free, engine.stats().running, engine.is_live(event.request_id)))

    for i, prompt in enumerate(random_prompts(llm, (5, 40, 17), seed=9)):
        engine.add_request(prompt, SamplingParams(max_tokens=3 + 4 * i, ignore_eos=True), callback=on_event)
    engine.run_until_done()
    assert len(seen) == 3
    assert seen[-1] == (engine.pool.num_usable, 0, False)
    assert [running for _, running, _ in seen] == [2, 1, 0] and not any(live for _, _, live in seen)


@pytest.mark.parametrize("sampled", [False, True])
def test_round_robin_switches_leave_the_tokens_unchanged(make_llm, sampled):
    """Four requests over two slots, a quantum of 5 tokens: they take turns, each return recomputes at
    most its partial last page (plus the token in flight), and every token equals the plain run's."""
    plain = make_llm(decode_batch=(1, 2, 4))
    rr = make_llm(decode_batch=(1, 2), policy="round-robin", quantum_tokens=5)
    prompts = random_prompts(plain, (21, 40, 9, 33), seed=4)
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8 if sampled else 0.0, seed=50 + i)
              for i in range(len(prompts))]
    want = plain.generate(prompts, params)
    got = rr.generate(prompts, params)
    st = rr.engine.stats()
    assert st.switches >= 4 and st.preemptions == 0
    assert st.switch_recomputed_tokens <= st.switches * (rr.engine.config.page_size + 1)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    rr.engine.pool.check_all_free()


def test_the_latency_controller_state_is_in_the_stats_and_the_metrics(make_llm):
    from prometheus_client import generate_latest

    from serve.metrics import Metrics

    llm = make_llm(target_p99_tpot_ms=1e-3)  # unreachable: the controller shrinks to its floor
    prompts = random_prompts(llm, (8,) * 6, seed=5)
    llm.generate(prompts, SamplingParams(max_tokens=100, ignore_eos=True))
    st = llm.engine.stats()
    assert st.running_limit == 1 and st.prefill_budget == llm.engine.scheduler.controller.min_budget
    assert st.measured_p99_tpot_ms > 0 and st.measured_p99_ttft_ms > 0
    m = Metrics()
    m.refresh(st)
    body = generate_latest(m.registry).decode()
    assert "jaxcb:running_limit 1.0" in body
    assert f"jaxcb:prefill_budget_tokens {float(st.prefill_budget)}" in body
    assert "jaxcb:measured_p99_tpot_seconds" in body and "jaxcb:num_round_robin_switches 0.0" in body


def test_fast_compile_gives_the_optimized_compiles_tokens(make_llm, tmp_path):
    """model.compile = "fast" (--compile fast) compiles each step with XLA's backend optimisations off:
    the same tokens, greedy and seeded; the setting is read from the config file and the flag, and a
    bad value is refused naming it."""
    import argparse

    from jaxcb.cli.args import add_model_args, engine_config
    from jaxcb.device.runner import COMPILER_OPTIONS
    from jaxcb.host.engine_config import DEFAULT_CONFIG, load_config, make_config

    optimized, fast = make_llm(compile="optimized"), make_llm(compile="fast")
    assert optimized.engine.runner.compiler_options == COMPILER_OPTIONS["optimized"]
    assert fast.engine.runner.compiler_options == COMPILER_OPTIONS["fast"]
    prompts = [[5, 6, 7, 8], list(range(3, 60)), [9] * 20]
    for params in (SamplingParams(max_tokens=16, ignore_eos=True),
                   SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=3)):
        assert [o.token_ids for o in fast.generate(prompts, params)] == \
            [o.token_ids for o in optimized.generate(prompts, params)]
    path = tmp_path / "c.toml"
    path.write_text(open(DEFAULT_CONFIG).read().replace('compile = "optimized"', 'compile = "fast"'))
    assert load_config(str(path)).compile == "fast" and load_config().compile == "optimized"
    p = argparse.ArgumentParser()
    add_model_args(p)
    assert engine_config(p.parse_args(["--compile", "fast"])).compile == "fast"
    with pytest.raises(ValueError, match="model.compile: 'quick' is not one of"):
        make_config(compile="quick")
