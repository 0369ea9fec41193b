"""Sliding-window layers over their own page group (jaxcb.host.window): pages before the window go back as a
sequence decodes, and everything else the engine does (batching, prefix caching, preemption, n > 1)
gives the tokens of a run that never freed anything."""

import dataclasses

import pytest

from jaxcb.host.engine_config import make_config
from jaxcb.host.page_pool import NULL_PAGE
from jaxcb.host.request import SamplingParams
from jaxcb.host.window import WindowGroup
from jaxcb.llm import LLM
from jaxcb.model.config import tiny_config
from jaxcb.model.llama import params_from_numpy, random_weights

WINDOW, PAGE = 24, 8
# A Gemma-shaped tiny model: sliding layers around a full one, (1 + w) norms, four norms a layer.
CONFIG = tiny_config(vocab_size=128, num_layers=3, family="gemma3", qk_norm=True, norm_plus_one=True,
                     post_norms=True, activation="gelu_tanh", embed_scale=True, sliding_window=WINDOW,
                     sliding_layers=(True, False, True), local_rope_theta=10000.0, rope_theta=1e6)
PROMPTS = [[(5 * i + j) % 120 + 3 for i in range(n)] for j, n in enumerate((5, 30, 61, 90))]


@pytest.fixture(scope="module")
def params():
    return params_from_numpy(random_weights(CONFIG, seed=5))


def make(params, config=CONFIG, **engine):
    values = dict(num_pages=96, page_size=PAGE, max_context=256, decode_batch=(4,), prefill_tokens=(32,),
                  max_prefill_tokens=32, compile="fast")  # few buckets, compiled fast: a tiny model
    values.update(engine)
    return LLM.from_params(config, params, None, config=make_config(**values))


def run(llm, prompts=PROMPTS, **sampling):
    sp = SamplingParams(max_tokens=40, ignore_eos=True, **sampling)
    return [o.token_ids for o in llm.generate(prompts, sp)]


def check_whole(llm):
    llm.engine.pool.check_all_free()
    llm.engine.window_group.pool.check_all_free()


def test_window_masks_keys_the_sliding_layers_cannot_see(params):
    """The window changes the tokens (past it), and only there: a model whose window covers the whole
    context gives the tokens of the same model with no sliding layers."""
    one_theta = dataclasses.replace(CONFIG, local_rope_theta=CONFIG.rope_theta)  # only the window differs
    plain = run(make(params, dataclasses.replace(one_theta, sliding_window=0, sliding_layers=())))
    assert run(make(params, dataclasses.replace(one_theta, sliding_window=4096))) == plain
    assert run(make(params, one_theta)) != plain


def test_a_decoding_sequence_holds_at_most_window_over_page_plus_one_sliding_pages(params):
    llm = make(params)
    engine = llm.engine
    group = engine.window_group
    limit = -(-WINDOW // PAGE) + 1
    ids = [engine.add_request(p, SamplingParams(max_tokens=60, ignore_eos=True)) for p in PROMPTS[2:]]
    assert ids
    most = 0
    while engine.has_work():
        engine.step()
        for r in engine.scheduler.running:
            held = group.held(r)
            decoding = r.num_computed > len(r.prompt_ids)  # its last step ran a decode token
            assert held <= (limit if decoding else group.pages_per_chunk(32)), (held, r.num_computed)
            if decoding and r.num_computed > WINDOW + PAGE:
                assert r.window_page_ids[0] == NULL_PAGE  # the first page is long gone
                most = max(most, held)
            assert len(r.page_ids) == -(-r.num_computed // PAGE) or r.num_computed == 0  # full layers keep all
    assert most == limit
    check_whole(llm)


def test_tokens_are_unchanged_by_batching_preemption_and_prefix_caching(params):
    alone = [run(make(params), [p])[0] for p in PROMPTS]
    assert run(make(params)) == alone  # batched continuously
    # Few pages: requests are preempted and recomputed.
    tight = make(params, num_pages=24)
    assert run(tight) == alone
    assert tight.engine.scheduler.num_preemptions > 0
    check_whole(tight)
    # n > 1 greedy samples share the prompt's pages through the prefix cache.
    assert run(make(params), PROMPTS[2:3], n=3) == alone[2:3] * 3


def test_prefix_cache_reuses_a_prefix_whose_window_is_still_cached(params):
    llm = make(params)
    base = PROMPTS[3]
    first = run(llm, [base])[0]
    out = llm.generate([base + [7, 8, 9]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert out.num_cached_tokens >= len(base) // PAGE * PAGE - PAGE  # most of the prompt came from the cache
    cold = make(params, prefix_caching=False)
    assert out.token_ids == run(cold, [base + [7, 8, 9]], )[0][:20]
    assert run(llm, [base])[0] == first
    check_whole(llm)


def test_a_prefix_whose_window_pages_were_evicted_is_shortened_to_what_is_cached():
    class R:
        window_page_ids: list

    group = WindowGroup(num_pages=16, page_size=PAGE, window=WINDOW)
    hashes = [bytes([i]) * 16 for i in range(10)]
    r = R()
    r.window_page_ids = []
    assert group.grow(r, 0, 10 * PAGE)
    group.register(r, 0, hashes)
    # Pages 4 and 5 leave the cache (another request's allocation evicted them).
    group.pool.free(r.window_page_ids)
    r.window_page_ids = []
    for p in (group.pool.lookup(hashes[4:5]) + group.pool.lookup(hashes[5:6])):
        del group.pool._page_of[group.pool._hash_of.pop(p)]
        group.pool._cached_free.pop(p)
        group.pool._is_free[p] = True
        group.pool._num_plain_free += 1
    group.pool.check()
    # A 10-page prefix needs sliding pages first_needed(80) = 7 .. 9: all cached.
    k, pages = group.usable_prefix(hashes, 10)
    assert k == 10 and len(pages) == 10 - group.first_needed(10 * PAGE)
    # An 8-page one needs pages 5 .. 7, and 5 is gone: it shortens to 5 pages (2 .. 4, 4 gone too -> 4).
    k, pages = group.usable_prefix(hashes, 8)
    assert k == 4 and len(pages) == 4 - group.first_needed(4 * PAGE)
    group.attach(r, k, pages)
    assert r.window_page_ids[:group.first_needed(4 * PAGE)] == [NULL_PAGE] * group.first_needed(4 * PAGE)
    group.release(r)
    group.pool.check_all_free()


def test_memory_plan_counts_each_group_and_fits_more_sequences():
    from jaxcb.host.memory_plan import plan

    common = dict(budget_bytes=16 << 30, fraction=0.9, weight_bytes=1 << 30, num_layers=18, num_kv_heads=1,
                  head_dim=256, hidden_size=640, intermediate_size=2048, vocab_size=262144, dtype_bytes=2,
                  page_size=16, max_context=8192, max_batch=32, max_prefill_tokens=512, num_heads=4)
    windowed = plan(**common, sliding_layers=15, window=512)
    full = plan(**common)
    assert windowed.kv_bytes <= full.kv_bytes + 2 * windowed.window_bytes_per_token * windowed.page_size  # rounding
    assert windowed.max_batch_at(8192) > 3 * full.max_batch_at(8192)
    assert windowed.max_batch_without_window(8192) == pytest.approx(full.max_batch_at(8192), rel=0.01)
    assert "sliding pages" in windowed.describe()


def test_pallas_kernels_give_the_plain_jax_tokens(params):
    """The engine with the Pallas kernels (interpret mode on the CPU) over both page groups: the window
    and scale reach the kernels, and the inactive group's empty lengths keep its call a no-op."""
    prompts = PROMPTS[1:3]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    xla = [o.token_ids for o in make(params).generate(prompts, sp)]
    pallas = make(params, attention="pallas")
    assert pallas.engine.runner.attention.kernel == "gpu"
    assert [o.token_ids for o in pallas.generate(prompts, sp)] == xla
    check_whole(pallas)
