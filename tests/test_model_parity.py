"""SmolLM2 in float32 on the CPU against Hugging Face transformers (tests/golden, tools/make_golden.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb.host.batch import SeqSpec, StepShape, pack
from jaxcb.host.engine_config import make_config
from jaxcb.host.request import SamplingParams
from jaxcb.device.runner import COMPILER_OPTIONS
from jaxcb.llm import LLM
from jaxcb.model.llama import forward
from jaxcb.model.paged_attention import allocate_kv_pages
from tests.parity import check_against_golden

# The real model as served (tests/conftest.py turns the rest down); the options are XLA:CPU's.
OPTIMIZED = COMPILER_OPTIONS["optimized"] if jax.default_backend() == "cpu" else None


def test_prefill_logits_match_reference(smollm2_model, golden):
    import jax

    cfg, params, _, _ = smollm2_model
    page_size = 16
    kv = allocate_kv_pages(cfg.num_layers, cfg.num_kv_heads, 8, page_size, cfg.head_dim, jnp.float32)
    step = jax.jit(forward, static_argnames=("config",), donate_argnums=(1,), compiler_options=OPTIMIZED)
    worst = 0.0
    for rec, ref in zip(golden["records"], golden["prefill_logits"]):
        ids = rec["prompt_ids"]
        # Pages out of order on purpose: the page table, not contiguity, decides where tokens live.
        pages = [7, 3, 5, 1][: -(-len(ids) // page_size)]
        batch = pack([SeqSpec(ids, 0, pages)], StepShape(64, 1, 4, 64), page_size)
        kv, logits = step(params, kv, batch, config=cfg)
        got = np.asarray(logits[0])
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        worst = max(worst, rel)
        assert rel < 1e-4, (rec["text"], rel)
    print(f"worst prefill relative error {worst:.2e}")


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_model):
    # One decode bucket of exactly the 20 golden prompts and one prefill bucket: two compilations, no padded rows.
    config = make_config(num_pages=512, max_context=256, decode_batch=(20,), prefill_tokens=(64,))
    return LLM.from_params(*smollm2_model[:3], config=config, eos_ids=smollm2_model[3])


def test_greedy_batch_matches_reference(smollm2_llm, golden):
    """All 20 prompts at once through the continuous-batching engine."""
    prompts = [r["prompt_ids"] for r in golden["records"]]
    outs = smollm2_llm.generate(prompts, SamplingParams(max_tokens=golden["steps"], ignore_eos=True))
    full = check_against_golden(outs, golden)
    print(f"{full}/{len(outs)} prompts identical in full")
    smollm2_llm.engine.pool.check_all_free()


def test_text_prompts_with_chat_template(smollm2_llm, golden):
    recs = golden["records"][:3]
    outs = smollm2_llm.generate([r["text"] for r in recs], SamplingParams(max_tokens=8, ignore_eos=True), chat=True)
    for out, rec in zip(outs, recs):
        assert out.prompt_token_ids == rec["prompt_ids"]
        assert out.token_ids == rec["greedy_ids"][:8]
    smollm2_llm.engine.pool.check_all_free()


def test_a_schema_that_meets_the_grammar_librarys_limit_fails_one_request_not_the_next(smollm2_llm):
    """A pattern whose regex derivatives outgrow llguidance's lexer limit mid-output (SmolLM2's vocabulary: after
    about a hundred tokens of a matching string) fails the request that met it; every copy of a compiled
    matcher shares those derivatives, so the compiled one is dropped and the next request with the schema
    starts afresh instead of failing at its first token."""
    import json

    from jaxcb.host.structured import Constraint

    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(.{0,50}[0-9]){0,40}$"}},
              "required": ["s"]}
    c = Constraint("json", json.dumps(schema), "response_format")
    g, tok = smollm2_llm.engine.grammars, smollm2_llm.tokenizer
    m = g.matcher(c)  # a request's copy, driven along a long matching string to the limit
    scratch = np.empty((1, g.words), np.int32)
    for t in tok.encode('{"s": "' + "".join(f"ab{i % 10}cd x{i % 7}y" for i in range(200))):
        g.fill_masks([m], [0], scratch)
        if m.is_error() or not m.consume_token(t):
            break
    assert "too many expressions" in m.get_error()
    params = SamplingParams(max_tokens=6, structured=c)
    failed, = smollm2_llm.generate([[1, 2, 3]], params)  # (its copy shares the spent derivatives: fails at once)
    assert failed.finish_reason == "error" and failed.token_ids == [] and "too many expressions" in failed.error
    fresh, = smollm2_llm.generate([[1, 2, 3]], params)
    assert fresh.finish_reason == "length" and len(fresh.token_ids) == 6 and not fresh.error
    smollm2_llm.engine.pool.check_all_free()


def test_speculative_decoding_gives_the_reference_tokens(smollm2_model, golden):
    """n-gram speculation, every proposal kept, on 8 of the golden prompts (all running at once): the
    reference tokens, up to the reference's own near ties."""
    from jaxcb.host.speculative import SpeculativeConfig

    config = make_config(num_pages=256, max_context=256, decode_batch=(8,), prefill_tokens=(64,),
                         speculative=SpeculativeConfig("ngram", adaptive=False))
    llm = LLM.from_params(*smollm2_model[:3], config=config, eos_ids=smollm2_model[3])
    some = dict(golden, records=golden["records"][:8])  # one round of 8 running (a second would take as long again)
    prompts = [r["prompt_ids"] for r in some["records"]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=golden["steps"], ignore_eos=True))
    check_against_golden(outs, some)
    st = llm.engine.stats()
    assert st.speculative_accepted > 0, st
    llm.engine.pool.check_all_free()
