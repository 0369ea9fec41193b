"""Gemma 3 270M, the second embedded model, against Hugging Face transformers loading the same GGUF
(tests/golden/gemma3*, written by `tools/make_golden.py --model gemma3-270m`): the same prompt ids,
prefill logits within 1e-4 of the largest, and greedy tokens up to the first near tie, for 20 prompts
(whitespace runs, digits, emoji, CJK, markup, and one of ~1,500 tokens that decodes past the 512-token
sliding window)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb.device.runner import COMPILER_OPTIONS
from jaxcb.host.batch import SeqSpec, StepShape, pack
from jaxcb.host.engine_config import make_config
from jaxcb.host.request import SamplingParams
from jaxcb.llm import LLM
from jaxcb.model.llama import forward
from jaxcb.model.paged_attention import allocate_kv_pages

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "gemma3")
NEAR_TIE = 1e-2


@pytest.fixture(scope="module")
def golden():
    with open(GOLDEN + ".json") as f:
        records = json.load(f)["records"]
    sample = np.load(GOLDEN + "_prefill_logits.npz")
    return records, sample


def test_config_and_tokenizer(gemma3_model, golden):
    config, _, tok, eos = gemma3_model
    assert (config.family, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.sliding_window, config.vocab_size) == ("gemma3", 18, 640, 4, 1, 256, 512, 262144)
    assert config.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(18))
    assert tok.add_bos and tok.encode("Hi")[0] == tok.bos_id
    records, _ = golden
    same = [tok.encode(r["text"]) == r["prompt_ids"] for r in records]
    print(f"\nGemma 3 tokenizer: {sum(same)}/{len(records)} prompts give transformers' ids")
    assert all(same), [r["text"][:40] for r, ok in zip(records, same) if not ok]
    for r in records:  # decoding gives the text back (the byte-fallback and "▁" spaces undone)
        assert tok.decode(r["prompt_ids"]) == r["text"]
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "Hi"}])


def test_prefill_logits_within_1e4(gemma3_model, golden):
    """All 20 prompts as prefill chunks of one packed step (one compilation): each sequence's logits."""
    config, params, _, _ = gemma3_model
    records, sample = golden
    s, specs, next_page = 16, [], 1
    for r in records:
        n = -(-len(r["prompt_ids"]) // s)
        pages = list(range(next_page, next_page + n))
        next_page += n
        specs.append(SeqSpec(r["prompt_ids"], 0, pages, window_page_ids=pages))
    total = sum(len(r["prompt_ids"]) for r in records)
    step = pack(specs, StepShape(-(-total // 256) * 256, len(records), 96, 64), s, config.sliding_window)
    pool = lambda layers: allocate_kv_pages(layers, 1, next_page, s, 256, jnp.float32)  # noqa: E731
    run = jax.jit(forward, static_argnames=("config",), compiler_options=COMPILER_OPTIONS["optimized"])
    _, logits = run(params, (pool(config.num_full_layers), pool(config.num_sliding_layers)), step, config=config)
    logits = np.asarray(logits)
    worst = max(np.abs(logits[i][sample["ids"][i]] - sample["logits"][i]).max() / sample["max_abs"][i]
                for i in range(len(records)))
    print(f"\nGemma 3 prefill logits: worst relative error {worst:.2e} over {len(records)} prompts")
    assert worst < 1e-4, worst


def test_greedy_48_tokens_match_up_to_the_first_near_tie(gemma3_model, golden):
    """All 20 prompts batched at once; the long one decodes past the sliding window, with its
    out-of-window sliding pages going back to their pool as it goes."""
    config, params, tok, eos = gemma3_model
    records, _ = golden
    llm = LLM.from_params(config, params, tok, eos_ids=eos, config=make_config(
        num_pages=200, page_size=16, max_context=2048, decode_batch=(len(records),), prefill_tokens=(256,),
        max_prefill_tokens=256))  # two buckets (two compilations), decode rows for exactly the 20 prompts
    outs = llm.generate([r["prompt_ids"] for r in records], SamplingParams(max_tokens=48, ignore_eos=True))
    agree = []
    for r, out in zip(records, outs):
        n = next((i for i, m in enumerate(r["margins"]) if m < NEAR_TIE), len(r["margins"]))
        agree.append(out.token_ids[:n] == r["greedy_ids"][:n])
    full = sum(out.token_ids == r["greedy_ids"] for r, out in zip(records, outs))
    print(f"\nGemma 3 greedy: {sum(agree)}/{len(records)} agree up to the first near tie (margin < {NEAR_TIE}), "
          f"{full}/{len(records)} identical for all 48 tokens; the {len(records[-1]['prompt_ids'])}-token prompt: "
          f"{'agrees' if agree[-1] else 'DISAGREES'}")
    assert sum(agree) >= 0.9 * len(records), agree
    assert agree[-1], "the prompt past the sliding window disagrees"
    llm.engine.pool.check_all_free()
    llm.engine.window_group.pool.check_all_free()
