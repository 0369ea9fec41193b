"""Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE and Granite MoE (mixtures of experts), OLMo 2 (norms after attention and
the MLP only, q and k normed whole), SmolLM3 (no RoPE in some layers), Granite (scalars on the embeddings, residual branches, scores
and logits), Phi-3 (fused projections; Phi-4-mini's partial rotary and LongRoPE), Gemma 2 and Gemma 3
against transformers' own modules: tiny random checkpoints in the Hugging
Face layout (tools/make_tiny_hf.py wrote them and their golden outputs with transformers), loaded
through jaxcb's Hugging Face loader and run by the engine (sliding window 8, so prompts and decode run
far past it, and the sliding layers' pages are freed as they go). Also Llama with Llama 3's RoPE scaling
Qwen3 and Llama with YaRN, and Gemma 3 with linear scaling of its global layers (all from 32 positions: the
prompts run past it),
and Gemma 3 as its multimodal checkpoints come (the language model's tensors under language_model.),
run on text."""

import dataclasses
import json
import os
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb.host.batch import SeqSpec, StepShape, pack
from jaxcb.host.engine_config import make_config
from jaxcb.host.request import SamplingParams
from jaxcb.llm import LLM, load_model
from jaxcb.model.llama import forward
from jaxcb.model.paged_attention import allocate_kv_pages
from tests.server_util import compile_mode

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "tiny_hf")
FAMILIES = ("qwen3", "gpt-oss", "llama4", "llama4-chunked", "llama4-maverick", "glm4moe", "qwen3moe-dense", "deepseek-v3", "deepseek-v3-q", "deepseek-v2", "minimax-m2", "llama-bias", "mixtral", "qwen2moe", "qwen3moe", "granitemoe", "olmoe", "olmo2", "smollm3", "granite", "phi3", "phi3-longrope", "gemma", "gemma2", "gemma3", "llama3-rope", "qwen3-yarn", "llama-yarn", "gemma3-linear", "gemma3-mm", "mistral3-mm", "llava", "qwen2.5-vl", "qwen3-vl")
# checkpoints of a family with RoPE scaling, or with a vision tower beside it (served on text), or a
# Llama with layers without RoPE, Granite's scalars or Phi-3's fused projections
FAMILY_OF = {"llama-bias": "llama", "mistral3-mm": "llama", "llava": "llama", "qwen2.5-vl": "llama", "qwen3-vl": "qwen3", "llama3-rope": "llama", "qwen3-yarn": "qwen3", "llama-yarn": "llama", "gemma3-linear": "gemma3", "gemma3-mm": "gemma3", "smollm3": "llama",
             "granite": "llama", "phi3": "llama", "phi3-longrope": "llama", "mixtral": "llama", "qwen3moe": "qwen3",
             "granitemoe": "llama", "qwen2moe": "llama", "llama4-chunked": "llama4", "llama4-maverick": "llama4",
             "qwen3moe-dense": "qwen3", "deepseek-v3": "deepseek_v3", "deepseek-v3-q": "deepseek_v3",
             "deepseek-v2": "deepseek_v2", "minimax-m2": "minimax_m2"}


def golden(family, name="golden"):
    with open(os.path.join(GOLDEN, family, f"{name}.json")) as f:
        return json.load(f)["records"]


def before_near_tie(record, steps=None) -> int:
    """How many of a golden record's greedy ids hold (up to its first near tie: margin < 1e-3), at most `steps`."""
    margins = record["margins"][:steps]
    return next((i for i, m in enumerate(margins) if m < 1e-3), len(margins))


def prefill_logits(config, params, ids, page_size=16):
    """The last position's logits of one sequence, from one packed step (pages for every group)."""
    n = -(-len(ids) // page_size)
    pages = list(range(1, n + 1))
    shape = StepShape(max(64, -(-len(ids) // 64) * 64), 1, max(4, n), max(64, n * page_size))
    window = config.sliding_window if config.windowed else 0
    step = pack([SeqSpec(list(ids), 0, pages, window_page_ids=pages if window else None)], shape, page_size, window)
    alloc = lambda layers: allocate_kv_pages(layers, config.num_kv_heads, max(8, n + 1), page_size,  # noqa: E731
                                             config.head_dim, jnp.float32)
    kv = (alloc(config.num_full_layers), alloc(config.num_sliding_layers)) if config.windowed else alloc(config.num_layers)
    _, logits = forward(params, kv, step, config)
    return np.asarray(logits[0])


def as_gguf(tmp_path, family, arch, **write):
    """The tiny `family` checkpoint as llama.cpp's converter writes it (arch `arch`; `write`: more of
    tests.tiny_gguf.write_tiny_gguf's arguments): (the checkpoint's config, its weights as the Hugging Face loader
    reads them, the GGUF as jaxcb loads it back)."""
    from jaxcb.model.gguf_loader import load_gguf
    from jaxcb.model.hf_loader import load_weights
    from tests.tiny_gguf import write_tiny_gguf

    src = os.path.join(GOLDEN, family)
    config = load_model(src, jnp.float32)[0]
    weights = load_weights(src, config)
    path = str(tmp_path / f"{family}.gguf")
    write_tiny_gguf(path, config, arch=arch, weights=weights, **write)
    return config, weights, load_gguf(path)


def assert_same_fields(got, want, fields) -> None:
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}


def assert_references_logits(config, params, family, context=""):
    """The prefill logits of `config` with `params` (Params, or the loaders' numpy weights) within 1e-5 of their
    scale of transformers' on each of `family`'s golden prompts."""
    from jaxcb.model.llama import params_from_numpy

    if isinstance(params, Mapping):  # (the loader's weights)
        params = params_from_numpy(params, jnp.float32)
    for record in golden(family):
        ref = np.asarray(record["prefill_logits"], np.float32)
        ours = prefill_logits(config, params, record["prompt_ids"])
        assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max(), (context or family, len(record["prompt_ids"]))


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(family):
    config, params, _, _ = load_model(os.path.join(GOLDEN, family), jnp.float32)
    assert config.family == FAMILY_OF.get(family, family)
    assert config.qk_norm == (config.family in ("qwen3", "gemma3", "olmo2", "olmoe", "glm4moe", "minimax_m2"))
    assert config.windowed == (family.startswith("gemma") and family != "gemma" or family in ("gpt-oss", "llama4",
                                                                                              "llama4-chunked",
                                                                                              "llama4-maverick"))
    assert config.mixed_mlp == (family in ("llama4-maverick", "glm4moe", "qwen3moe-dense") or family.startswith("deepseek"))
    assert config.mla == family.startswith("deepseek")
    for record in golden(family):
        ours = prefill_logits(config, params, record["prompt_ids"])
        ref = np.asarray(record["prefill_logits"], np.float32)
        scale = np.abs(ref).max()
        assert np.abs(ours - ref).max() <= 1e-5 * scale, (family, len(record["prompt_ids"]), np.abs(ours - ref).max())


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_matches_transformers_up_to_a_near_tie(family):
    """Continuous batching of all prompts at once, chunked prefill (16-token buckets), decode past the
    window: the greedy ids are the reference's up to its first near tie (margin < 1e-3). (LongRoPE: served up
    to its original context, where its short factors apply, as they did in the reference's short prompts.)"""
    config, params, tok, _ = load_model(os.path.join(GOLDEN, family), jnp.float32)
    llm = LLM.from_params(config, params, tok, config=make_config(
        num_pages=64, page_size=16, max_context=config.rope_original_context or 128, decode_batch=(4,),
        prefill_tokens=(16,), max_prefill_tokens=16, compile=compile_mode(config)))
    records = golden(family)
    outs = llm.generate([r["prompt_ids"] for r in records], SamplingParams(max_tokens=16, ignore_eos=True))
    for record, out in zip(records, outs):
        n = before_near_tie(record)
        assert out.token_ids[:n] == record["greedy_ids"][:n], (family, len(record["prompt_ids"]))
    llm.engine.pool.check_all_free()
    if config.windowed:
        llm.engine.window_group.pool.check_all_free()


def test_gemma_norms_are_one_plus_w():
    """The loader keeps Gemma's (1 + w) form: reading the weights as plain scales changes the logits."""
    import dataclasses

    config, params, _, _ = load_model(os.path.join(GOLDEN, "gemma3"), jnp.float32)
    record = golden("gemma3")[0]
    plain = dataclasses.replace(config, norm_plus_one=False)
    assert np.abs(prefill_logits(plain, params, record["prompt_ids"]) -
                  np.asarray(record["prefill_logits"])).max() > 1e-2


@pytest.mark.parametrize("family, plain", [("llama3-rope", {"rope_freq_factors": ()}),
                                           ("gemma3-linear", {"rope_linear_factor": 1.0}),
                                           ("qwen3-yarn", {"rope_freq_factors": ()}),
                                           ("qwen3-yarn", {"rope_attention_factor": 1.0}),
                                           ("llama-yarn", {"rope_freq_factors": ()}),
                                           ("llama-yarn", {"rope_attention_factor": 1.0})])
def test_rope_scaling_is_read_and_matters(family, plain):
    """Llama 3's per-frequency factors (1 for short wavelengths, 8 for long ones, a blend between),
    Gemma 3's linear factor of its global layers and YaRN's factors and attention factor come from
    config.json; without each the logits are not the reference's."""
    import dataclasses
    import math

    config, params, _, _ = load_model(os.path.join(GOLDEN, family), jnp.float32)
    if family == "llama3-rope":
        f = config.rope_freq_factors
        assert f[0] == 1.0 and f[-1] == 8.0 and any(1.0 < x < 8.0 for x in f), f
    elif family.endswith("yarn"):  # the highest frequencies kept, the lowest divided by the factor, a ramp between
        factor = 4.0 if family == "qwen3-yarn" else 8.0
        f = config.rope_freq_factors
        assert f[0] == 1.0 and f[-1] == pytest.approx(factor) and any(1.0 < x < factor for x in f), f
        assert config.max_context == max(256, 32 * factor)  # the original context stretched, or the model's if longer
        attention = 1 + 0.1 * math.log(4.0) if family == "qwen3-yarn" else (1 + 0.1 * math.log(8)) / (1 + 0.05 * math.log(8))
        assert config.rope_attention_factor == pytest.approx(attention)
    else:
        assert config.rope_linear_factor == 8.0 and not config.rope_freq_factors
        assert np.all(config.rope_divisors() == 8.0)  # (the global layers': the logits say the sliding ones are plain)
    record = golden(family)[2]
    ref = np.asarray(record["prefill_logits"], np.float32)
    unscaled = prefill_logits(dataclasses.replace(config, **plain), params, record["prompt_ids"])
    assert np.abs(unscaled - ref).max() > 1e-3 * np.abs(ref).max()


@pytest.mark.parametrize("change", ["sinks", "clamp", "yarn_on_sliding", "expert_bias", "out_bias", "interleave"])
def test_gpt_oss_parts_are_read_and_matter(change):
    """gpt-oss's parts, each as transformers runs it (test_prefill_logits_match_transformers): without its
    attention sinks, its SwiGLU's clamps, YaRN on the sliding layers too, the experts' and router's biases, the
    attention output's bias, or with gate and up read as halves instead of interleaved columns, the logits are
    not the reference's."""
    from jaxcb.model.hf_loader import load_weights
    from jaxcb.model.llama import params_from_numpy

    src = os.path.join(GOLDEN, "gpt-oss")
    config = load_model(src, jnp.float32)[0]
    assert (config.family, config.attn_sinks, config.expert_bias, config.out_bias, config.activation) == (
        "gpt-oss", True, True, True, "swiglu_oai")
    assert config.sliding_layers == (True, False) * 2 and config.rope_scaled_sliding and config.swiglu_limit == 1.0
    weights = load_weights(src, config)
    if change == "sinks":  # a sink of -inf takes nothing from the softmax
        weights["sinks"] = np.full_like(weights["sinks"], -1e30)
    elif change == "clamp":
        config = dataclasses.replace(config, swiglu_limit=1e9)
    elif change == "yarn_on_sliding":
        config = dataclasses.replace(config, rope_scaled_sliding=False)
    elif change == "expert_bias":
        weights.update({k: np.zeros_like(weights[k]) for k in weights if k.endswith("_bias")})
    elif change == "out_bias":
        weights["bo"] = np.zeros_like(weights["bo"])
    else:
        gate, up = weights["experts_gate"], weights["experts_up"]
        both = np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)  # the stored interleaved order
        weights["experts_gate"], weights["experts_up"] = np.split(both, 2, axis=-1)
    record = golden("gpt-oss")[2]
    ref = np.asarray(record["prefill_logits"], np.float32)
    got = prefill_logits(config, params_from_numpy(weights, jnp.float32), record["prompt_ids"])
    assert np.abs(got - ref).max() > 1e-3 * np.abs(ref).max()


@pytest.mark.parametrize("change", ["rotary_pairs", "qk_rms", "temperature", "input_scale", "nope"])
def test_llama4_parts_are_read_and_matter(change):
    """Llama 4's parts, each as transformers runs it (test_prefill_logits_match_transformers): without its RoPE
    read as complex pairs (q/k columns reordered to rotate-half's), the RoPE layers' weightless q/k norms, the
    NoPE layers' temperature tuning, the experts' input scaling by the sigmoid of their logit, or the NoPE layers,
    the logits are not the reference's."""
    from jaxcb.model.hf_loader import load_weights
    from jaxcb.model.llama import params_from_numpy

    src = os.path.join(GOLDEN, "llama4")
    config = load_model(src, jnp.float32)[0]
    assert (config.family, config.nope_layers, config.qk_rms_rope, config.nope_temperature, config.moe_input_scale,
            config.shared_expert_size, config.shared_expert_gated) == ("llama4", (False, True) * 2, True, 4, True, 32, False)
    weights = load_weights(src, config)
    if change == "rotary_pairs":  # the checkpoint's column order, as a rotate-half model would read it
        d = config.head_dim
        back = np.argsort(np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)]))
        for key, heads in (("wq", config.num_heads), ("wk", config.num_kv_heads)):
            w = weights[key]
            weights[key] = w.reshape(*w.shape[:-1], heads, d)[..., back].reshape(w.shape)
    else:
        config = dataclasses.replace(config, **{"qk_rms": {"qk_rms_rope": False}, "temperature": {"nope_temperature": 0},
                                                "input_scale": {"moe_input_scale": False},
                                                "nope": {"nope_layers": ()}}[change])
    record = golden("llama4")[2]
    ref = np.asarray(record["prefill_logits"], np.float32)
    got = prefill_logits(config, params_from_numpy(weights, jnp.float32), record["prompt_ids"])
    assert np.abs(got - ref).max() > 1e-3 * np.abs(ref).max()


def test_a_llama4_lora_adapter_is_read_in_the_reordered_columns(tmp_path):
    """A PEFT adapter of Llama 4's attention (its q and k B columns in the checkpoint's complex-pair order) read
    in the order the loader gives the base's columns: merged into the base as jaxcb holds it, the logits of the
    checkpoint with the adapter merged in as PEFT merges it (W + scale B A)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxcb.model.hf_loader import load_weights
    from jaxcb.model.llama import params_from_numpy
    from jaxcb.model.lora import merge, read_adapter
    from tests.lora_util import write_adapter

    src = os.path.join(GOLDEN, "llama4")
    config = load_model(src, jnp.float32)[0]
    raw = write_adapter(str(tmp_path / "adapter"), config, rank=4, targets=("wq", "wk", "wv", "wo"), scale=1.0)
    folder = tmp_path / "merged"
    shutil.copytree(src, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    names = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
    for (target, i), (a, b, scale) in raw.items():
        key = f"model.layers.{i}.self_attn.{names[target]}.weight"
        tensors[key] = tensors[key] + scale * (b @ a)
    save_file(tensors, str(folder / "model.safetensors"))
    record = golden("llama4")[2]
    want = prefill_logits(config, params_from_numpy(load_weights(str(folder), config)), record["prompt_ids"])
    adapter = read_adapter(str(tmp_path / "adapter"), config)
    got = prefill_logits(config, params_from_numpy(merge(load_weights(src, config), adapter)), record["prompt_ids"])
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
    base = prefill_logits(config, params_from_numpy(load_weights(src, config)), record["prompt_ids"])
    assert np.abs(base - want).max() > 1e-2 * np.abs(want).max()  # (the adapter matters)


def test_a_llama4_gguf_gives_transformers_logits(tmp_path):
    """Llama 4 as llama.cpp's converter writes it ("llama4": q and k in the checkpoint's complex-pair order, the
    router, experts and ungated shared expert in ffn_*, Llama 3's factors in rope_freqs): the Hugging Face
    loader's weights exactly and transformers' logits. llama.cpp's constants for what the file does not say (NoPE
    every fourth layer, temperature floor 8,192, chunks of 8,192 in the other layers) stand where the tiny
    checkpoint's differ (every other layer, floor 4, chunks of 256): set back for the logits."""
    config, weights, got = as_gguf(tmp_path, "llama4", "llama4", rope_freqs=config_factors("llama4"))
    fields = ("num_experts", "experts_per_token", "intermediate_size", "family", "moe_input_scale", "qk_rms_rope",
              "shared_expert_size", "shared_expert_gated", "tie_embeddings", "nope_temperature_scale")
    assert_same_fields(got.config, config, fields)
    assert got.config.rope_freq_factors == pytest.approx(config.rope_freq_factors)  # (float32 in the file)
    assert (got.config.nope_layers, got.config.nope_temperature) == ((False, False, False, True), 8192)
    assert (got.config.sliding_layers, got.config.sliding_window, got.config.attention_chunked) == (
        (True, True, True, False), 8192, True)
    assert sorted(got.weights) == sorted(weights)
    for key, w in weights.items():
        np.testing.assert_array_equal(got.weights[key], w, err_msg=key)
    assert_references_logits(dataclasses.replace(got.config, nope_layers=config.nope_layers, nope_temperature=4,
                                                 sliding_layers=config.sliding_layers, sliding_window=256),
                             got.weights, "llama4")


def config_factors(family):
    return load_model(os.path.join(GOLDEN, family), jnp.float32)[0].rope_freq_factors


def test_llama4_as_released_with_its_vision_tower_loads_on_text(tmp_path):
    """Llama4ForConditionalGeneration as released keeps its vision tower under vision_model.: left aside, the
    language model served on text; and its GGUFs' tokenizer.ggml.pre "llama4" is GPT-4o's split (llama.cpp's)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxcb.host.tokenizer import PRE_TOKENIZERS

    folder = tmp_path / "llama4-cg"
    shutil.copytree(os.path.join(GOLDEN, "llama4"), folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "architectures": ["Llama4ForConditionalGeneration"]}))
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["vision_model.patch_embedding.linear.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    config, params, _, _ = load_model(str(folder), jnp.float32)
    assert_references_logits(config, params, "llama4")
    assert "llama4" in PRE_TOKENIZERS


def test_llama4s_chunked_attention_is_read_and_matters(tmp_path):
    """Llama 4's RoPE layers attend within chunks of attention_chunk_size (a query at t sees keys from
    t - t % chunk on), its NoPE layers to every key, the context served past a chunk: on the checkpoint with
    chunks of 16 (whose prompts and decode cross several, test_engine_greedy_matches_transformers_up_to_a_near_tie)
    a sliding window of 16 in its place, or full attention, gives other logits than the reference's; no
    chunk size (null) is full attention. (Maverick's dense layers between the experts': the llama4-maverick
    checkpoint among FAMILIES.)"""
    import shutil

    from jaxcb.model.hf_loader import read_config

    config, params, _, _ = load_model(os.path.join(GOLDEN, "llama4-chunked"), jnp.float32)
    assert (config.sliding_layers, config.sliding_window, config.attention_chunked, config.max_context) == (
        (True, False) * 2, 16, True, 256)
    assert config.attention_window == -16
    record = golden("llama4-chunked")[2]
    ref = np.asarray(record["prefill_logits"], np.float32)
    for other in ({"attention_chunked": False}, {"sliding_layers": (), "sliding_window": 0, "attention_chunked": False}):
        got = prefill_logits(dataclasses.replace(config, **other), params, record["prompt_ids"])
        assert np.abs(got - ref).max() > 1e-3 * np.abs(ref).max(), other
    folder = tmp_path / "llama4"
    shutil.copytree(os.path.join(GOLDEN, "llama4"), folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "attention_chunk_size": None}))
    assert not read_config(str(folder)).windowed


def test_a_gpt_oss_gguf_gives_transformers_logits(tmp_path):
    """gpt-oss as llama.cpp's converter writes it ("gpt-oss": attn_sinks, biases on the output projection, the
    router and ffn_{gate,up,down}_exps, the MLP's norm as post_attention_norm, the sliding window and its
    period of 2, YaRN): the Hugging Face loader's weights exactly and transformers' logits (llama.cpp's SwiGLU
    limit is its constant 7, the tiny checkpoint's 1: set back for the logits)."""
    fields = ("num_experts", "experts_per_token", "intermediate_size", "family", "attn_sinks", "expert_bias",
              "out_bias", "attention_bias", "activation", "sliding_window", "sliding_layers", "rope_scaled_sliding",
              "rope_freq_factors", "rope_attention_factor", "max_context", "norm_topk", "tie_embeddings")
    config, weights, got = as_gguf(tmp_path, "gpt-oss", "gpt-oss", rope_scaling=("yarn", 8.0), extra_uint32={
        "gpt-oss.attention.sliding_window": 8, "gpt-oss.rope.scaling.original_context_length": 32})
    assert_same_fields(got.config, config, fields)
    assert got.config.swiglu_limit == 7.0
    assert sorted(got.weights) == sorted(weights)
    for key, w in weights.items():
        np.testing.assert_array_equal(got.weights[key], w, err_msg=key)
    assert_references_logits(dataclasses.replace(got.config, swiglu_limit=config.swiglu_limit), got.weights, "gpt-oss")
    # llama.cpp's sliding_window_pattern of 0: every layer sliding
    from jaxcb.model.gguf_loader import open_reader, read_config
    from tests.tiny_gguf import write_tiny_gguf

    path = str(tmp_path / "every-layer-sliding.gguf")
    write_tiny_gguf(path, config, arch="gpt-oss", weights=weights, extra_uint32={
        "gpt-oss.attention.sliding_window": 8, "gpt-oss.attention.sliding_window_pattern": 0})
    assert read_config(open_reader(path)).sliding_layers == (True,) * config.num_layers


def test_a_gpt_oss_config_reads_transformers_defaults_for_what_it_leaves_out(tmp_path):
    """A gpt-oss config.json without rope_scaling, attention_bias or rms_norm_eps means transformers'
    GptOssConfig defaults (YaRN from 4,096 positions x 32, untruncated; biases; 1e-5), not plain RoPE."""
    import shutil

    from jaxcb.model.hf_loader import read_config

    folder = tmp_path / "gpt-oss"
    shutil.copytree(os.path.join(GOLDEN, "gpt-oss"), folder)
    raw = json.loads((folder / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling", "attention_bias", "rms_norm_eps", "rope_theta"):
        raw.pop(key, None)
    (folder / "config.json").write_text(json.dumps(raw))
    config = read_config(str(folder))
    assert (config.attention_bias, config.out_bias, config.rms_norm_eps, config.rope_theta) == (True, True, 1e-5, 150000.0)
    assert config.rope_freq_factors[-1] == pytest.approx(32.0) and config.max_context == 4096 * 32


def test_gpt_oss_mxfp4_experts_are_read_as_released(tmp_path):
    """gpt-oss's released checkpoints keep the experts in MXFP4: `<name>_blocks` uint8 [X, out, in/32, 16] (two
    FP4 E2M1 values a byte, the low nibble first) and `<name>_scales` uint8 [X, out, in/32] (a power of two,
    exponent + 127). The tiny checkpoint's experts so encoded load as each value decodes (written out here one
    value at a time), and serve transformers' logits up to that rounding."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxcb.model.hf_loader import load_weights

    fp4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    src = os.path.join(GOLDEN, "gpt-oss")
    folder = tmp_path / "gpt-oss-mxfp4"
    shutil.copytree(src, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    decoded = {}
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        w = np.swapaxes(tensors.pop(name), -1, -2)  # [X, out, in]
        x, rows, cols = w.shape
        blocks = np.zeros((x, rows, cols // 32, 16), np.uint8)
        scales = np.zeros((x, rows, cols // 32), np.uint8)
        want = np.zeros_like(w)
        for e, r, b in np.ndindex(x, rows, cols // 32):
            part = w[e, r, 32 * b:32 * b + 32]
            exp = int(np.ceil(np.log2(max(np.abs(part).max(), 1e-30) / 6.0)))  # the largest value within 6 x 2^exp
            scales[e, r, b] = exp + 127
            for j, v in enumerate(part):
                code = int(np.argmin([abs(abs(v) / 2.0**exp - f) for f in fp4])) | (8 if v < 0 else 0)
                blocks[e, r, b, j // 2] |= code << (4 * (j % 2))
                want[e, r, 32 * b + j] = (-1 if code & 8 else 1) * fp4[code & 7] * 2.0**exp
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        decoded[name] = np.swapaxes(want, -1, -2)  # [X, in, out]
    save_file(tensors, str(folder / "model.safetensors"))
    config = load_model(str(folder), jnp.float32)[0]
    weights = load_weights(str(folder), config)
    for i in range(config.num_layers):
        gate_up = decoded[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        np.testing.assert_array_equal(weights["experts_gate"][i], gate_up[..., 0::2])
        np.testing.assert_array_equal(weights["experts_up"][i], gate_up[..., 1::2])
        np.testing.assert_array_equal(weights["experts_down"][i], decoded[f"model.layers.{i}.mlp.experts.down_proj"])
    record = golden("gpt-oss")[2]
    from jaxcb.model.llama import params_from_numpy

    got = prefill_logits(config, params_from_numpy(weights, jnp.float32), record["prompt_ids"])
    ref = np.asarray(record["prefill_logits"], np.float32)
    assert np.abs(got - ref).max() <= 0.1 * np.abs(ref).max()


def test_smollm3s_layers_without_rope_are_read_and_matter(tmp_path):
    """SmolLM3's no_rope_layers (here every other layer) from config.json, and every fourth layer in a
    smollm3 GGUF (llama.cpp's rule, its Q/K rows permuted as a Llama's); RoPE in every layer instead gives
    other logits than the reference's."""
    import dataclasses

    from jaxcb.model.gguf_loader import load_gguf
    from tests.tiny_gguf import tiny_model_config, write_tiny_gguf

    config, params, _, _ = load_model(os.path.join(GOLDEN, "smollm3"), jnp.float32)
    assert config.nope_layers == (False, True, False, True) and config.family == "llama"
    record = golden("smollm3")[2]
    ref = np.asarray(record["prefill_logits"], np.float32)
    roped = prefill_logits(dataclasses.replace(config, nope_layers=()), params, record["prompt_ids"])
    assert np.abs(roped - ref).max() > 1e-3 * np.abs(ref).max()
    path = str(tmp_path / "m.gguf")
    want = write_tiny_gguf(path, tiny_model_config(num_layers=8), arch="smollm3")
    got = load_gguf(path)
    assert got.config.nope_layers == (False, False, False, True) * 2
    for k in want:
        np.testing.assert_array_equal(got.weights[k], want[k], err_msg=k)


def test_phi4_minis_partial_rotary_and_longrope_are_read_and_matter():
    """Phi-4-mini's kind of checkpoint: 3/4 of each head rotated, LongRoPE's short factors and attention
    factor (transformers' default, sqrt(1 + ln(256/64) / ln 64)), its long factors for a served context past the
    original 64 positions (ModelConfig.at_context); without any one of them, or with the long factors on these
    short prompts, the logits are not the reference's."""
    import dataclasses
    import math

    config, params, _, _ = load_model(os.path.join(GOLDEN, "phi3-longrope"), jnp.float32)
    assert config.rotary_dim == 12 and config.rope_freq_factors == (1.0, 1.3, 1.9, 2.6, 3.4, 4.0)
    assert config.rope_attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))
    assert config.max_context == 256 and config.rope_original_context == 64
    assert config.rope_long_factors == (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
    assert config.at_context(64) is config and config.at_context(65).rope_freq_factors == config.rope_long_factors
    record = golden("phi3-longrope")[2]
    ref = np.asarray(record["prefill_logits"], np.float32)
    for plain in ({"rotary_dim": 0, "rope_freq_factors": (), "rope_long_factors": ()}, {"rope_freq_factors": ()},
                  {"rope_attention_factor": 1.0}, {"rope_freq_factors": config.rope_long_factors}):
        without = prefill_logits(dataclasses.replace(config, **plain), params, record["prompt_ids"])
        assert np.abs(without - ref).max() > 1e-4 * np.abs(ref).max(), plain


def test_longrope_past_its_original_context_gives_transformers_long_factor_outputs():
    """An engine serving the LongRoPE checkpoint past its original 64 positions (max_context 256) takes the long
    factors for every position (ModelConfig.at_context, llama.cpp's rule): on prompts of 90 and 151 tokens, which
    transformers runs with its long factors, the prefill logits are within 1e-5 of its scale of transformers'
    and the greedy ids (batched, chunked prefill) are its own up to a near tie; the short factors are not."""
    import dataclasses

    config, params, tok, _ = load_model(os.path.join(GOLDEN, "phi3-longrope"), jnp.float32)
    records = golden("phi3-longrope", "golden_long")
    assert all(len(r["prompt_ids"]) > config.rope_original_context for r in records)
    long = config.at_context(256)
    for record in records:
        ref = np.asarray(record["prefill_logits"], np.float32)
        assert np.abs(prefill_logits(long, params, record["prompt_ids"]) - ref).max() <= 1e-5 * np.abs(ref).max()
        short = prefill_logits(dataclasses.replace(long, rope_freq_factors=config.rope_freq_factors), params,
                               record["prompt_ids"])
        assert np.abs(short - ref).max() > 1e-3 * np.abs(ref).max()
    llm = LLM.from_params(config, params, tok, config=make_config(
        num_pages=64, page_size=16, max_context=256, decode_batch=(2,), prefill_tokens=(32,), max_prefill_tokens=32,
        compile=compile_mode(config)))
    assert llm.engine.model_config.rope_freq_factors == config.rope_long_factors
    outs = llm.generate([r["prompt_ids"] for r in records], SamplingParams(max_tokens=16, ignore_eos=True))
    for record, out in zip(records, outs):
        n = before_near_tie(record)
        assert n >= 8 and out.token_ids[:n] == record["greedy_ids"][:n], len(record["prompt_ids"])
    llm.engine.pool.check_all_free()


def test_a_phi3_gguf_gives_transformers_logits(tmp_path):
    """The Phi-4-mini-like checkpoint's weights in a phi3 GGUF as llama.cpp's converter lays it out (Q/K/V and
    gate/up fused, rotate-half rows kept, rope.dimension_count, rope_factors_short/long, rope.scaling.attn_factor
    and original_context_length): the same config and transformers' own logits."""
    import math

    from jaxcb.model.gguf_loader import load_gguf
    from jaxcb.model.hf_loader import load_weights
    from tests.tiny_gguf import write_tiny_gguf

    src = os.path.join(GOLDEN, "phi3-longrope")
    config, _, _, _ = load_model(src, jnp.float32)
    weights = load_weights(src, config)
    path = str(tmp_path / "phi3.gguf")
    write_tiny_gguf(path, dataclasses.replace(config, max_context=256), arch="phi3", weights=weights,
                    extra_uint32={"phi3.rope.dimension_count": 12, "phi3.rope.scaling.original_context_length": 64},
                    extra_float32={"phi3.rope.scaling.attn_factor": math.sqrt(1 + math.log(4) / math.log(64))},
                    extra_tensors={"rope_factors_short.weight": config.rope_freq_factors,
                                   "rope_factors_long.weight": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]})
    got = load_gguf(path)
    fields = ("rotary_dim", "max_context", "num_layers", "head_dim", "tie_embeddings")
    assert {f: getattr(got.config, f) for f in fields} == {f: getattr(config, f) for f in fields}
    assert got.config.rope_attention_factor == pytest.approx(config.rope_attention_factor)
    assert got.config.rope_freq_factors == pytest.approx(config.rope_freq_factors)  # (float32 in the file)
    assert got.config.rope_long_factors == pytest.approx(config.rope_long_factors)
    assert got.config.rope_original_context == 64

    assert_references_logits(got.config, got.weights, "phi3-longrope")


def test_granites_scalars_are_read_and_each_matters(tmp_path):
    """Granite's embedding, residual and attention multipliers and its logits scaling, from config.json and
    from a granite GGUF's metadata (llama.cpp's keys; Q/K permuted as a Llama's); leaving any one out gives
    other logits than the reference's."""
    import dataclasses

    from jaxcb.model.gguf_loader import load_gguf
    from tests.tiny_gguf import tiny_model_config, write_tiny_gguf

    config, params, _, _ = load_model(os.path.join(GOLDEN, "granite"), jnp.float32)
    scalars = dict(embed_multiplier=6.0, residual_multiplier=0.3, query_scale=0.1, logit_scale=4.0)
    assert {k: getattr(config, k) for k in scalars} == pytest.approx(scalars)
    record = golden("granite")[2]
    ref = np.asarray(record["prefill_logits"], np.float32)
    for name, plain in (("embed_multiplier", 1.0), ("residual_multiplier", 1.0), ("query_scale", 0.0),
                        ("logit_scale", 1.0)):
        without = prefill_logits(dataclasses.replace(config, **{name: plain}), params, record["prompt_ids"])
        assert np.abs(without - ref).max() > 1e-4 * np.abs(ref).max(), name  # (10x the match's tolerance)
    path = str(tmp_path / "m.gguf")
    keys = {"granite.embedding_scale": 6.0, "granite.residual_scale": 0.3, "granite.attention.scale": 0.1,
            "granite.logit_scale": 4.0}
    want = write_tiny_gguf(path, tiny_model_config(), arch="granite", extra_float32=keys)
    got = load_gguf(path)
    assert {k: getattr(got.config, k) for k in scalars} == pytest.approx(scalars)
    for k in want:
        np.testing.assert_array_equal(got.weights[k], want[k], err_msg=k)


@pytest.mark.parametrize("family", ["gemma3-linear", "llama3-rope", "phi3-longrope", "qwen3-yarn"])
def test_transformers_4_layout_of_the_rope_settings_reads_the_same(tmp_path, family):
    """The same checkpoints with their RoPE settings as transformers 4 writes them (and the Hub's Llama 3.x,
    Gemma 3 4B+ and Phi-4-mini configs are): `rope_theta` and `rope_scaling` (the global layers'), Gemma 3's
    local base in `rope_local_base_freq`, Phi-3's `partial_rotary_factor` and `original_max_position_embeddings`
    beside them and LongRoPE by its first name, "su"; the same config and the reference's logits."""
    import json
    import shutil

    src = os.path.join(GOLDEN, family)
    old = str(tmp_path / family)
    shutil.copytree(src, old)
    with open(os.path.join(old, "config.json")) as f:
        raw = json.load(f)
    params = raw.pop("rope_parameters")
    full = params.get("full_attention", params)
    raw["rope_theta"] = full.pop("rope_theta")
    raw["rope_scaling"] = full
    if "sliding_attention" in params:
        raw["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
    if family.startswith("phi3"):
        raw["partial_rotary_factor"] = full.pop("partial_rotary_factor")
        raw["original_max_position_embeddings"] = full.pop("original_max_position_embeddings")
        full["type"] = {"longrope": "su"}[full.pop("rope_type")]
    with open(os.path.join(old, "config.json"), "w") as f:
        json.dump(raw, f)
    config, params_old, _, _ = load_model(old, jnp.float32)
    assert config == load_model(src, jnp.float32)[0]
    record = golden(family)[2]
    ref = np.asarray(record["prefill_logits"], np.float32)
    assert np.abs(prefill_logits(config, params_old, record["prompt_ids"]) - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("family", ["gemma3", "llama3-rope", "smollm3", "phi3-longrope", "glm4moe"])
def test_convert_round_trip_keeps_the_family(tmp_path, family):
    from jaxcb.cli import main as cli

    src = os.path.join(GOLDEN, family)
    out = str(tmp_path / "converted")
    assert cli(["convert", src, out, "--dtype", "float32"]) == 0
    config, params, _, _ = load_model(out)
    original, _, _, _ = load_model(src, jnp.float32)
    assert config == original and config.windowed == (family == "gemma3")
    record = golden(family)[1]
    ref = np.asarray(record["prefill_logits"], np.float32)
    assert np.abs(prefill_logits(config, params, record["prompt_ids"]) - ref).max() <= 1e-5 * np.abs(ref).max()


def test_server_serves_a_gemma_model_and_names_its_family(config_path, tiny_model, tmp_path):
    """`jaxcb serve` on the tiny Gemma 3 directory (with the tiny test tokenizer beside it, as the server
    needs one): GetModelInfo names the family and the window, and a completion gives the reference's
    greedy tokens."""
    import shutil

    from serve.client import Client
    from tests.server_util import ServerProcess

    model_dir = str(tmp_path / "gemma3")
    shutil.copytree(os.path.join(GOLDEN, "gemma3"), model_dir)
    tiny_model[2].save(model_dir)
    server = ServerProcess(model_dir, config_path)
    try:
        server.wait_serving()
        record = golden("gemma3")[2]
        with Client(server.target) as c:
            info = c.model_info()
            assert (info.family, info.sliding_window, info.num_sliding_layers) == ("gemma3", 8, 3)
            out = c.complete(token_ids=record["prompt_ids"], max_tokens=8, ignore_eos=True, timeout=60)
        n = before_near_tie(record, 8)
        assert list(out.token_ids)[:n] == record["greedy_ids"][:n]
    finally:
        assert server.stop() == 0, server.output()[-2000:]


def test_prompt_logprobs_on_a_sliding_window_model_are_what_decoding_gave():
    """Gemma 3 (sliding window 8): a prompt and its greedy continuation scored as one prompt, far past
    the window, in 4 sample rows a step: the continuation's logprobs are those decoding gave."""
    config, params, tok, _ = load_model(os.path.join(GOLDEN, "gemma3"), jnp.float32)
    llm = LLM.from_params(config, params, tok, config=make_config(
        num_pages=64, page_size=16, max_context=128, decode_batch=(4,), prefill_tokens=(16,), max_prefill_tokens=16,
        compile=compile_mode(config)))
    prompt = golden("gemma3")[0]["prompt_ids"]
    gen = llm.generate([prompt], SamplingParams(max_tokens=24, logprobs=2, ignore_eos=True))[0]
    scored = llm.generate([prompt + gen.token_ids], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    got = scored.prompt_logprobs[len(prompt):]
    assert len(got) == len(gen.token_ids) and len(prompt) + len(got) > 3 * config.sliding_window
    for (lp, rank, top), (want, want_top) in zip(got, gen.logprobs):
        assert lp == pytest.approx(want, abs=1e-4) and rank == 1
        assert [t for t, _ in top] == [t for t, _ in want_top]
    llm.engine.pool.check_all_free()
    llm.engine.window_group.pool.check_all_free()


def test_mixture_of_experts_gguf_files_load_as_llama_cpp_writes_them(tmp_path):
    """Mixtral as a "llama" GGUF with expert_count (Q/K rows permuted), Qwen3-MoE as a "qwen3moe" one
    (expert_feed_forward_length), Qwen2-MoE as a "qwen2moe" one (its shared expert, *_shexp, and the shared
    expert's gate), Granite MoE as a "granitemoe" one (its scalars; gate and up apart) and OLMoE as an "olmoe" one
    (q and k norms over the whole projections; not renormalized), each
    layer's router in ffn_gate_inp and its experts stacked in ffn_{gate,up,down}_exps as llama.cpp's converter
    writes them: the Hugging Face loader's weights exactly, and Mixtral's and Granite MoE's give transformers'
    logits (llama.cpp renormalizes the chosen experts' weights for all three, as those two do; the tiny
    Qwen3-MoE does not, norm_topk_prob false)."""
    granite = {"granitemoe.embedding_scale": 6.0, "granitemoe.residual_scale": 0.3, "granitemoe.attention.scale": 0.1,
               "granitemoe.logit_scale": 4.0}
    for family, arch in (("mixtral", "llama"), ("qwen3moe", "qwen3moe"), ("granitemoe", "granitemoe"),
                         ("qwen2moe", "qwen2moe"), ("olmoe", "olmoe")):
        config, weights, got = as_gguf(tmp_path, family, arch, extra_float32=granite if arch == "granitemoe" else None)
        fields = ("num_experts", "experts_per_token", "intermediate_size", "qk_norm", "family", "num_layers",
                  "embed_multiplier", "residual_multiplier", "logit_scale", "tie_embeddings", "shared_expert_size",
                  "attention_bias")
        assert {f: getattr(got.config, f) for f in fields} == pytest.approx({f: getattr(config, f) for f in fields})
        assert got.config.norm_topk == (arch not in ("qwen2moe", "olmoe"))  # (llama.cpp's rule for each)
        assert got.config.qk_norm_whole == (arch == "olmoe")
        assert sorted(got.weights) == sorted(weights)
        for key, w in weights.items():
            np.testing.assert_array_equal(got.weights[key], w, err_msg=f"{family} {key}")
        if family == "qwen3moe":
            continue
        assert_references_logits(got.config, got.weights, family)


@pytest.mark.parametrize("src, wanted", [("qwen3", "qwen3-yarn"), ("llama3-rope", "llama-yarn"), ("qwen3-yarn", "qwen3")])
def test_rope_scaling_set_by_the_server_gives_that_checkpoints_logits(src, wanted):
    """`--rope-scaling` / model.rope_scaling (transformers' dict as JSON) replaces the model file's scaling: the
    tiny checkpoints share their weights (the same seed and shapes), so Qwen3 with the YaRN of qwen3-yarn's
    config gives its logits, Llama 3's scaling replaced by llama-yarn's gives those, and {"rope_type": "default"}
    takes qwen3-yarn's away; bad settings are refused naming the field before any model is read."""
    from jaxcb.host.engine_config import load_config
    from jaxcb.host.errors import InvalidConfig

    with open(os.path.join(GOLDEN, wanted, "config.json")) as f:
        scaling = json.load(f).get("rope_parameters") if wanted != "qwen3" else {"rope_type": "default"}
    config, params, _, _ = load_model(os.path.join(GOLDEN, src), jnp.float32, rope_scaling=json.dumps(scaling))
    assert config.max_context == load_model(os.path.join(GOLDEN, wanted), jnp.float32)[0].max_context
    stretched = json.dumps({**scaling, "factor": 16.0}) if wanted != "qwen3" else None
    if stretched:  # (the golden checkpoints' context is longer than 32 x their factor; 32 x 16 is not)
        assert load_model(os.path.join(GOLDEN, src), jnp.float32, rope_scaling=stretched)[0].max_context == 512
    assert_references_logits(config, params, wanted)
    import argparse

    from jaxcb.cli.args import add_model_args, engine_config

    p = argparse.ArgumentParser()
    add_model_args(p)
    assert engine_config(p.parse_args(["--rope-scaling", json.dumps(scaling)])).rope_scaling == json.dumps(scaling)
    for bad, message in (("{", "not JSON"), ('{"rope_type": "dynamic", "factor": 2}', "must be an object with rope_type default, linear"),
                         ('[1]', "must be an object")):
        with pytest.raises(InvalidConfig, match=f"model.rope_scaling: {message}"):
            load_config(None).replace(rope_scaling=bad)
    with pytest.raises(InvalidConfig, match="model.rope_scaling: rope_scaling .* lacks a number"):
        load_model(os.path.join(GOLDEN, src), jnp.float32, rope_scaling='{"rope_type": "yarn"}')
    with pytest.raises(InvalidConfig, match="not between 1 and a million"):
        load_model(os.path.join(GOLDEN, src), jnp.float32, rope_scaling='{"rope_type": "yarn", "factor": 1e308}')
    # LLM.from_params takes the engine config's setting too
    base, base_params, tok, _ = load_model(os.path.join(GOLDEN, src), jnp.float32)
    llm = LLM.from_params(base, base_params, tok, config=make_config(num_pages=16, max_context=64, decode_batch=(1,),
                                                                     prefill_tokens=(16,), compile="fast").replace(
        rope_scaling=json.dumps(scaling)))
    assert llm.engine.model_config == config


def test_rope_scaling_in_the_config_file_is_a_table(tmp_path):
    """model.rope_scaling in the engine's TOML is an inline table, kept as the JSON the loaders read."""
    from jaxcb.host.engine_config import DEFAULT_CONFIG, load_config
    from jaxcb.host.errors import InvalidConfig

    path = tmp_path / "c.toml"
    table = '{rope_type = "yarn", factor = 4.0, original_max_position_embeddings = 32768}'
    path.write_text(open(DEFAULT_CONFIG).read().replace("[model]\n", f"[model]\nrope_scaling = {table}\n"))
    assert json.loads(load_config(str(path)).rope_scaling) == {"rope_type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 32768}
    path.write_text(open(DEFAULT_CONFIG).read().replace("[model]\n", '[model]\nrope_scaling = {type = "ntk"}\n'))
    with pytest.raises(InvalidConfig, match="model.rope_scaling: must be an object with rope_type"):
        load_config(str(path))


def test_gemma_1_reads_its_legacy_activation_and_loads_as_a_gguf(tmp_path):
    """Gemma 1 (CodeGemma too): its released configs' hidden_act "gelu" is the tanh approximation (as transformers
    reads it); as llama.cpp's "gemma" GGUF (norms stored as 1 + w) the same config, weights and logits."""
    import shutil

    src = os.path.join(GOLDEN, "gemma")
    config, _, _, _ = load_model(src, jnp.float32)
    assert (config.norm_plus_one, config.post_norms, config.embed_scale, config.activation) == (
        True, False, True, "gelu_tanh")
    legacy = str(tmp_path / "gemma")
    shutil.copytree(src, legacy)
    with open(os.path.join(legacy, "config.json")) as f:
        raw = json.load(f)
    with open(os.path.join(legacy, "config.json"), "w") as f:
        json.dump({**raw, "hidden_act": "gelu"}, f)
    assert load_model(legacy, jnp.float32)[0] == config
    _, _, got = as_gguf(tmp_path, "gemma", "gemma")
    assert_same_fields(got.config, config, ("family", "norm_plus_one", "post_norms", "embed_scale", "activation",
                                            "head_dim", "tie_embeddings"))
    assert_references_logits(got.config, got.weights, "gemma")


def test_a_yarn_gguf_gives_transformers_logits(tmp_path):
    """Qwen3 converted by llama.cpp with YaRN on (rope.scaling.type yarn, its factor and original context): the
    Hugging Face config's RoPE and context, and transformers' logits; YaRN's llama.cpp-only knobs are refused by
    name rather than run approximately."""
    from jaxcb.host.errors import InvalidConfig
    from jaxcb.model.gguf_loader import load_gguf
    from jaxcb.model.hf_loader import load_weights
    from tests.tiny_gguf import write_tiny_gguf

    src = os.path.join(GOLDEN, "qwen3-yarn")
    config, _, _, _ = load_model(src, jnp.float32)
    weights = load_weights(src, config)
    path = str(tmp_path / "yarn.gguf")
    write_tiny_gguf(path, dataclasses.replace(config, max_context=64), arch="qwen3", weights=weights,
                    rope_scaling=("yarn", 4.0), extra_uint32={"qwen3.rope.scaling.original_context_length": 32})
    got = load_gguf(path)
    assert got.config.max_context == 128  # (the file's 64 stretched from the original 32)
    assert got.config.rope_freq_factors == pytest.approx(config.rope_freq_factors)
    assert got.config.rope_attention_factor == pytest.approx(config.rope_attention_factor)
    assert_references_logits(got.config, got.weights, "qwen3-yarn")
    write_tiny_gguf(path, config, arch="qwen3", weights=weights, rope_scaling=("yarn", 4.0),
                    extra_float32={"qwen3.rope.scaling.yarn_log_multiplier": 0.1})
    with pytest.raises(InvalidConfig, match="qwen3.rope.scaling.yarn_log_multiplier: 0.1"):
        load_gguf(path)


@pytest.mark.parametrize("family, arch", [("qwen2.5-vl", "qwen2vl"), ("qwen3-vl", "qwen3vl")])
def test_a_vision_language_models_text_gguf_gives_transformers_logits(tmp_path, family, arch):
    """The language model of Qwen2.5-VL and Qwen3-VL as llama.cpp's converter writes it (archs qwen2vl and qwen3vl,
    the vision tower in a file of its own): the Hugging Face loader's config and weights, and transformers' logits
    on text."""
    config, _, got = as_gguf(tmp_path, family, arch)
    assert_same_fields(got.config, config, ("family", "qk_norm", "attention_bias", "num_layers", "head_dim",
                                            "tie_embeddings", "rope_theta"))
    assert_references_logits(got.config, got.weights, family)


def test_hub_layout_of_vision_language_configs_reads_the_same(tmp_path):
    """Qwen2.5-VL's config as the Hub has it (every text setting at the top, rope_scaling of type "mrope" with its
    sections) reads as the tiny checkpoint's text_config does; a Llava or Mistral3 whose language model is of a
    type not served is refused naming text_config.model_type."""
    import shutil

    from jaxcb.host.errors import InvalidConfig

    src = os.path.join(GOLDEN, "qwen2.5-vl")
    hub = str(tmp_path / "qwen2.5-vl")
    shutil.copytree(src, hub)
    with open(os.path.join(hub, "config.json")) as f:
        raw = json.load(f)
    text = raw.pop("text_config")
    params = text.pop("rope_parameters")
    raw.update(text, rope_theta=params["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
               model_type="qwen2_5_vl")
    with open(os.path.join(hub, "config.json"), "w") as f:
        json.dump(raw, f)
    config, params_hub, _, _ = load_model(hub, jnp.float32)
    assert config == load_model(src, jnp.float32)[0]
    record = golden("qwen2.5-vl")[1]
    ref = np.asarray(record["prefill_logits"], np.float32)
    assert np.abs(prefill_logits(config, params_hub, record["prompt_ids"]) - ref).max() <= 1e-5 * np.abs(ref).max()
    other = str(tmp_path / "llava")
    shutil.copytree(os.path.join(GOLDEN, "llava"), other)
    with open(os.path.join(other, "config.json")) as f:
        raw = json.load(f)
    raw["text_config"]["model_type"] = "phi"
    with open(os.path.join(other, "config.json"), "w") as f:
        json.dump(raw, f)
    with pytest.raises(InvalidConfig, match="text_config.model_type 'phi': LlavaForConditionalGeneration is served"):
        load_model(other, jnp.float32)


def test_an_olmo2_gguf_gives_transformers_logits(tmp_path):
    """OLMo 2 as llama.cpp's converter writes it (arch olmo2: its norms after attention and the MLP as
    post_attention_norm and post_ffw_norm, q and k norms over whole projections, Q/K not permuted): the Hugging
    Face loader's weights exactly and transformers' logits."""
    config, weights, got = as_gguf(tmp_path, "olmo2", "olmo2")
    assert_same_fields(got.config, config, ("family", "qk_norm", "qk_norm_whole", "pre_norms", "post_norms",
                                            "num_layers", "head_dim"))
    assert sorted(got.weights) == sorted(weights) and "attn_norm" not in weights
    for key, w in weights.items():
        np.testing.assert_array_equal(got.weights[key], w, err_msg=key)
    assert_references_logits(got.config, got.weights, "olmo2")


def test_each_way_of_running_the_experts_gives_the_same_output():
    """The mixture of experts both ways (a loop over the experts some token chose: the CPU; the pairs grouped
    by expert through jax.lax.ragged_dot: GPU and TPU) against a
    float64 loop over tokens, with and without renormalizing the chosen experts' weights; gpt-oss's (biases on
    the router's logits and each expert's projections, the clamped SwiGLU, here with a limit the values pass);
    and Llama 4's (the chosen experts' sigmoid scores scale their inputs, their outputs summed); and DeepSeek-V3's
    (GLM-4.5's: chosen by sigmoid score plus a correction bias within the best group, weighed by their
    renormalized scores times a scale); and DeepSeek-V2's group_limited_greedy (softmax probabilities, the experts
    of the best groups by their best, weighed unrenormalized times a scale)."""
    import jax

    from jaxcb.model.config import tiny_config
    from jaxcb.model.llama import experts, random_weights

    rng = np.random.default_rng(3)
    for norm_topk, oss, llama4, v3 in ((True, False, False, False), (False, False, False, False),
                                       (True, True, False, False), (False, False, True, False),
                                       (True, False, False, True), (False, False, False, "v2")):
        config = tiny_config(num_experts=8, experts_per_token=3, intermediate_size=24, norm_topk=norm_topk,
                             moe_input_scale=llama4,
                             **(dict(expert_bias=True, activation="swiglu_oai", swiglu_limit=0.3) if oss else {}),
                             **(dict(router_sigmoid=True, router_choice_bias=True, expert_groups=2,
                                     expert_groups_used=1, routed_scale=2.5) if v3 is True else {}),
                             **(dict(expert_groups=4, expert_groups_used=2, routed_scale=2.0) if v3 == "v2" else {}))
        w = random_weights(config, seed=4)
        bias = {k: w[k][1].astype(np.float64) if oss else 0.0 for k in ("router_bias", "experts_gate_bias",
                                                                        "experts_up_bias", "experts_down_bias")}
        from jaxcb.model.llama import params_from_numpy

        layer = jax.tree.map(lambda a: a[1], params_from_numpy(w).layers)
        quantized = jax.tree.map(lambda a: a[1], params_from_numpy(w, mode="int8").layers)
        for t in (1, 2, 5, 23):  # pairs: 3 and 6 (most experts chosen by none), 15, 69
            x = rng.standard_normal((t, config.hidden_size)).astype(np.float32)
            logits = x.astype(np.float64) @ w["router"][1] + bias["router_bias"]
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            want = np.zeros((t, config.hidden_size))
            for i in range(t):
                chosen = np.argsort(-probs[i])[:3]
                weights = probs[i, chosen] / (probs[i, chosen].sum() if norm_topk else 1.0)
                if v3 == "v2":  # the best 2 of 4 groups by their best probability, their three best, times 2
                    best = np.argsort(-probs[i].reshape(4, 2).max(-1))[:2]
                    kept = np.where(np.isin(np.arange(8) // 2, best), probs[i], 0.0)
                    chosen = np.argsort(-kept)[:3]
                    weights = probs[i, chosen] * 2.0
                elif v3:  # the best group of four by its two best (score + bias), its three best; their scores
                    scores = 1 / (1 + np.exp(-logits[i]))
                    choice = (scores + w["router_choice_bias"][1]).reshape(2, 4)
                    group = np.argmax(np.sort(choice, -1)[:, -2:].sum(-1))
                    chosen = group * 4 + np.argsort(-choice[group])[:3]
                    weights = scores[chosen] / scores[chosen].sum() * 2.5
                if llama4:
                    for e in chosen:  # its sigmoid score scales its input
                        xe = x[i] / (1 + np.exp(-logits[i, e]))
                        g, u = xe @ w["experts_gate"][1][e], xe @ w["experts_up"][1][e]
                        want[i] += ((g / (1 + np.exp(-g))) * u) @ w["experts_down"][1][e]
                    continue
                for e, p in zip(chosen, weights):
                    g, u = x[i] @ w["experts_gate"][1][e], x[i] @ w["experts_up"][1][e]
                    if oss:
                        g = np.minimum(g + bias["experts_gate_bias"][e], 0.3)
                        u = np.clip(u + bias["experts_up_bias"][e], -0.3, 0.3)
                        hidden = g / (1 + np.exp(-1.702 * g)) * (u + 1)
                        want[i] += p * (hidden @ w["experts_down"][1][e] + bias["experts_down_bias"][e])
                    else:
                        want[i] += p * ((g / (1 + np.exp(-g))) * u) @ w["experts_down"][1][e]
            for grouped in (False, True):
                got = jax.jit(lambda x, g=grouped: experts(config, x, layer, grouped=g))(x)
                assert np.abs(np.asarray(got) - want).max() <= 1e-5 * np.abs(want).max(), (norm_topk, v3, t, grouped)
            # int8 experts: each way the same (the same dequantized matrices), near the float output
            ways = [np.asarray(jax.jit(lambda x, g=g: experts(config, x, quantized, grouped=g))(x))
                    for g in (False, True)]
            assert np.abs(ways[0] - ways[1]).max() <= 1e-5 * np.abs(want).max(), (norm_topk, t)
            assert np.abs(ways[0] - want).max() <= 0.05 * np.abs(want).max(), (norm_topk, t, oss, llama4)


@pytest.mark.parametrize("family", ["mixtral", "qwen2moe", "qwen3moe", "granitemoe", "glm4moe", "llama4-maverick"])
def test_experts_are_stored_as_the_layers_matrices_are(family):
    """--weights bfloat16, int8 and int4 store the experts as they store the layers' matrices (the router
    stays in the compute dtype): the bytes the memory plan counts, logits near the float ones (the tiny
    random checkpoints' spread: int4's groups of 32 over 64 inputs are coarse), and the engine runs them
    (Qwen3-MoE's int4: its experts dequantized as they are read, the ones no token chose skipped)."""
    import jax

    from jaxcb.host.memory_plan import weight_bytes
    from jaxcb.model.quant import QuantWeight

    records = golden(family)
    for mode, bound in (("bfloat16", 0.01), ("int8", 0.03), ("int4", 0.3)):
        config, params, tok, _ = load_model(os.path.join(GOLDEN, family), jnp.float32, weights=mode)
        experts = params.layers.experts_down
        assert isinstance(experts, QuantWeight) == (mode != "bfloat16") and params.layers.router.dtype == jnp.float32
        assert sum(x.nbytes for x in jax.tree.leaves(params)) == weight_bytes(config, mode, 4)
        ref = np.asarray(records[2]["prefill_logits"], np.float32)  # (40 tokens)
        error = np.abs(prefill_logits(config, params, records[2]["prompt_ids"]) - ref).max() / np.abs(ref).max()
        assert error <= bound, (mode, error)
    if family != "qwen3moe":  # (its decode rows, 4 x 2 pairs, leave some of its 8 experts unread)
        return
    llm = LLM.from_params(config, params, tok, config=make_config(
        num_pages=64, page_size=16, max_context=128, decode_batch=(4,), prefill_tokens=(16,), max_prefill_tokens=16,
        compile=compile_mode(config)))
    outs = llm.generate([r["prompt_ids"] for r in records], SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8] * len(records)
    llm.engine.pool.check_all_free()


def test_the_experts_settings_are_read_and_matter():
    """Renormalizing the chosen experts' weights (Mixtral's always, Qwen3-MoE's norm_topk_prob) and the
    number each token takes each move the logits far past the tolerance; LoRA slots on the MLP's matrices
    are refused for a mixture of experts by the field."""
    from jaxcb.device.lora import zero_slots
    from jaxcb.host.errors import InvalidConfig
    from jaxcb.host.lora import TARGETS

    config, params, _, _ = load_model(os.path.join(GOLDEN, "qwen2moe"), jnp.float32)  # its shared expert's gate
    ids = golden("qwen2moe")[1]["prompt_ids"]
    shut = params.replace(layers=params.layers.replace(shared_gate=jnp.full_like(params.layers.shared_gate, -30.0)))
    ref = prefill_logits(config, params, ids)
    assert np.abs(prefill_logits(config, shut, ids) - ref).max() > 1e-3 * np.abs(ref).max()
    for family in ("mixtral", "qwen3moe"):
        config, params, _, _ = load_model(os.path.join(GOLDEN, family), jnp.float32)
        ids = golden(family)[1]["prompt_ids"]
        ref = prefill_logits(config, params, ids)
        for change in ({"norm_topk": not config.norm_topk}, {"experts_per_token": 1}):
            moved = np.abs(prefill_logits(dataclasses.replace(config, **change), params, ids) - ref).max()
            assert moved > 1e-4 * np.abs(ref).max(), (family, change, moved)
        with pytest.raises(InvalidConfig, match=r"^lora.targets: \['w_gate', 'w_up', 'w_down'\] are not matrices"):
            zero_slots(config, TARGETS, 2, 4, jnp.float32)
        assert set(zero_slots(config, ("wq", "wo"), 2, 4, jnp.float32)["a"]) == {"wq", "wo"}


def test_glm4_moes_parts_are_read_and_matter(tmp_path):
    """GLM-4.5's checkpoint (Glm4MoeForCausalLM): its first layer a dense MLP, the others experts chosen by
    sigmoid score plus a correction bias within the best of two groups, weighed times routed_scaling_factor,
    beside an always-on shared expert; half of each head rotated; q/k/v biases and per-head q/k norms. Each
    part moves the logits past the tolerance when changed; the multi-token prediction layer a released
    checkpoint keeps after the last one (num_nextn_predict_layers) is left unread, and refused when the config
    does not name it. LoRA slots on the shared expert's matrices (stacked over the experts' layers only) are
    refused by the field, on attention's taken."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxcb.device.lora import zero_slots
    from jaxcb.host.errors import InvalidConfig

    config, params, _, _ = load_model(os.path.join(GOLDEN, "glm4moe"), jnp.float32)
    assert (config.moe_layers, config.dense_size, config.intermediate_size, config.shared_expert_size) == (
        (False, True, True, True), 128, 32, 32)
    assert (config.router_sigmoid, config.expert_groups, config.expert_groups_used, config.routed_scale,
            config.rotary_dim, config.qk_norm, config.attention_bias, config.out_bias) == (
        True, 2, 1, 2.5, 8, True, True, False)
    assert params.layers.dense_gate.shape == (1, 64, 128) and params.layers.experts_gate.shape == (3, 8, 64, 32)
    with pytest.raises(InvalidConfig, match=r"^lora.targets: \['w_gate'\] are not matrices"):
        zero_slots(config, ("wq", "w_gate"), 2, 4, jnp.float32)
    assert set(zero_slots(config, ("wq", "wo"), 2, 4, jnp.float32)["a"]) == {"wq", "wo"}
    record = golden("glm4moe")[2]
    ref = np.asarray(record["prefill_logits"], np.float32)
    layers = params.layers
    for change, p in (({"expert_groups_used": 2}, params), ({"routed_scale": 1.0}, params),
                      ({"rotary_dim": 0}, params), ({"shared_expert_gated": True}, params.replace(
                          layers=layers.replace(shared_gate=jnp.zeros((3, 64, 1))))),
                      ({}, params.replace(layers=layers.replace(router_choice_bias=jnp.zeros_like(
                          layers.router_choice_bias))))):
        got = prefill_logits(dataclasses.replace(config, **change), p, record["prompt_ids"])
        assert np.abs(got - ref).max() > 1e-3 * np.abs(ref).max(), change
    folder = tmp_path / "glm"
    shutil.copytree(os.path.join(GOLDEN, "glm4moe"), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    mtp = {n.replace("layers.3.", "layers.4."): a for n, a in tensors.items() if ".layers.3." in n}
    mtp["model.layers.4.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    save_file(mtp, str(folder / "mtp.safetensors"))
    got = prefill_logits(*load_model(str(folder), jnp.float32)[:2], record["prompt_ids"])
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 0}))
    with pytest.raises(InvalidConfig, match="tensors jaxcb's decoder does not use"):
        load_model(str(folder), jnp.float32)


def test_a_draft_of_a_model_with_dense_layers_among_the_experts_keeps_their_kinds():
    """Speculative decoding with the first layers of a model whose layers are dense and experts' in turn
    (the tiny Llama 4 Maverick: dense, experts, dense, experts): each part cut to the draft's layers of its
    kind, the tokens the engine gives without it; a draft of dense layers only is refused by the field."""
    from jaxcb.host.errors import InvalidConfig
    from jaxcb.host.speculative import SpeculativeConfig
    from jaxcb.llm import draft_model_config, load_draft

    config, params, tok, _ = load_model(os.path.join(GOLDEN, "llama4-maverick"), jnp.float32)
    spec = SpeculativeConfig("draft", num_tokens=3, draft_layers=2, adaptive=False)
    draft, draft_params = load_draft(spec, config, params)
    assert (draft.num_layers, draft.moe_layers, draft.num_expert_layers) == (2, (False, True), 1)
    assert draft_params.layers.dense_gate.shape[0] == 1 and draft_params.layers.router.shape[0] == 1
    assert draft_params.layers.wq.shape[0] == 2
    with pytest.raises(InvalidConfig, match="speculative.draft_layers: the first 1 layers .* dense MLPs only"):
        draft_model_config(dataclasses.replace(spec, draft_layers=1), config)
    records = golden("llama4-maverick")
    outs = {}
    for name, speculative in (("off", SpeculativeConfig()), ("draft", spec)):
        llm = LLM.from_params(config, params, tok, config=make_config(
            num_pages=64, page_size=16, max_context=128, decode_batch=(4,), prefill_tokens=(16,),
            max_prefill_tokens=16, compile=compile_mode(config), speculative=speculative))
        outs[name] = [o.token_ids for o in llm.generate([r["prompt_ids"] for r in records],
                                                        SamplingParams(max_tokens=12, ignore_eos=True))]
        llm.engine.pool.check_all_free()
        if name == "draft":
            assert llm.engine.stats().speculative_proposed > 0
    assert outs["draft"] == outs["off"]


@pytest.mark.parametrize("family, log_multiplier", [("deepseek-v3", 0.1), ("deepseek-v2", 0.0707), ("deepseek-v3-q", None)])
def test_a_deepseek2_gguf_gives_transformers_logits(tmp_path, family, log_multiplier):
    """DeepSeek-V3 and V2 as llama.cpp's converter writes them (deepseek2): latent attention's matrices (queries
    through q_lora_rank or attn_q, kv_b split into attn_k_b [H, C, N] and attn_v_b [H, V, C] for the absorbed form,
    the rotated parts in the checkpoint's interleaved pairs), key_length / value_length / key_length_mla /
    value_length_mla, YaRN with yarn_log_multiplier (0.1 x mscale_all_dim) in the softmax's scale, leading dense
    layers, shared experts, the router (V3's sigmoid with groups and correction biases, V2's softmax with groups by
    their best, the file without expert_gating_func as V2's and V2.5's are, which llama.cpp reads as softmax): the
    Hugging Face loader's config and weights exactly and transformers' logits. An older file's attn_kv_b (the
    checkpoint's kv_b_proj) reads the same."""
    from jaxcb.model.gguf_loader import load_gguf
    from tests.tiny_gguf import write_tiny_gguf

    yarn = {} if log_multiplier is None else dict(
        rope_scaling=("yarn", 4.0), extra_uint32={"deepseek2.rope.scaling.original_context_length": 64},
        extra_float32={"deepseek2.rope.scaling.yarn_log_multiplier": log_multiplier})
    config, weights, got = as_gguf(tmp_path, family, "deepseek2", **yarn)
    fields = ("num_experts", "experts_per_token", "intermediate_size", "family", "moe_layers", "dense_size",
              "shared_expert_size", "shared_expert_gated", "router_sigmoid", "router_choice_bias", "expert_groups",
              "expert_groups_used", "routed_scale", "norm_topk", "rotary_dim", "qk_norm", "kv_lora_rank", "q_lora_rank",
              "qk_nope_dim", "v_head_dim", "head_dim", "num_kv_heads", "rope_freq_factors", "rope_attention_factor",
              "max_context")
    assert_same_fields(got.config, config, fields)
    assert got.config.query_scale == pytest.approx(config.query_scale, rel=1e-6)
    assert sorted(got.weights) == sorted(weights)
    for key, w in weights.items():
        np.testing.assert_array_equal(got.weights[key], w, err_msg=key)
    assert_references_logits(got.config, got.weights, family)
    if family != "deepseek-v3":
        return
    old = str(tmp_path / "kv_b.gguf")  # (kv_b_proj whole: attn_kv_b [H * (N + V), C], each head's key rows, then values)
    h, n, v = config.num_heads, config.qk_nope_dim, config.v_head_dim
    kv_b = {f"blk.{i}.attn_kv_b.weight": np.concatenate([weights["w_uk"][i], weights["w_uv"][i].swapaxes(-1, -2)],
                                                         axis=1).reshape(h * (n + v), -1)
            for i in range(config.num_layers)}
    write_tiny_gguf(old, config, arch="deepseek2", weights=weights, extra_tensors=kv_b, latent_split=False, **yarn)
    older = load_gguf(old)
    for key in ("w_uk", "w_uv"):
        np.testing.assert_array_equal(older.weights[key], weights[key], err_msg=key)


def test_a_minimax_m2_gguf_gives_transformers_logits(tmp_path):
    """MiniMax-M2 as llama.cpp's converter writes it (minimax-m2): q and k normed over all their heads (attn_q_norm,
    attn_k_norm), the first rope.dimension_count of each head rotated, the sigmoid gating with exp_probs_b, the chosen
    experts' weights renormalized (llama.cpp's rule for it, without a key): the Hugging Face loader's config and
    weights exactly and transformers' logits."""
    config, weights, got = as_gguf(tmp_path, "minimax-m2", "minimax-m2")
    fields = ("num_experts", "experts_per_token", "intermediate_size", "family", "router_sigmoid", "router_choice_bias",
              "expert_groups", "routed_scale", "norm_topk", "rotary_dim", "head_dim", "qk_norm", "qk_norm_whole")
    assert_same_fields(got.config, config, fields)
    assert sorted(got.weights) == sorted(weights)
    for key, w in weights.items():
        np.testing.assert_array_equal(got.weights[key], w, err_msg=key)
    assert_references_logits(got.config, got.weights, "minimax-m2")


@pytest.mark.parametrize("family", ["glm4moe", "llama4-maverick"])
def test_a_gguf_with_dense_layers_among_the_experts_gives_transformers_logits(tmp_path, family):
    """GLM-4.5 and Llama 4 Maverick as llama.cpp's converter writes them ("glm4moe": leading_dense_block_count, the
    sigmoid gating, expert_weights_scale/norm, exp_probs_b, shared experts, partial RoPE; "llama4":
    interleave_moe_layer_step): the dense layers' MLP in ffn_gate/up/down beside the experts' layers, the Hugging
    Face loader's weights exactly and transformers' logits. A GLM file's multi-token prediction block after the
    last layer (block_count counts it, nextn_predict_layers names it) is not read."""
    from tests.tiny_gguf import write_tiny_gguf

    arch = "glm4moe" if family == "glm4moe" else "llama4"
    config, weights, got = as_gguf(tmp_path, family, arch)
    fields = ("num_experts", "experts_per_token", "intermediate_size", "family", "moe_layers", "dense_size",
              "shared_expert_size", "shared_expert_gated", "router_sigmoid", "router_choice_bias", "expert_groups",
              "expert_groups_used", "routed_scale", "norm_topk", "rotary_dim", "qk_norm", "attention_bias")
    assert_same_fields(got.config, config, fields)
    assert sorted(got.weights) == sorted(weights)
    for key, w in weights.items():
        np.testing.assert_array_equal(got.weights[key], w, err_msg=key)
    if family == "llama4-maverick":  # (llama.cpp's constants where the tiny checkpoint's differ: set back)
        got_config = dataclasses.replace(got.config, nope_layers=config.nope_layers, nope_temperature=4,
                                         sliding_layers=config.sliding_layers, sliding_window=16)
        assert_references_logits(got_config, got.weights, family)
        return
    assert_references_logits(got.config, got.weights, family)
    from jaxcb.model.gguf_loader import load_gguf

    path = str(tmp_path / "mtp.gguf")  # a fifth block: the multi-token prediction layer's tensors
    extra = {"blk.4.nextn.eh_proj.weight": np.zeros((128, 64)), "blk.4.attn_norm.weight": np.ones(64)}
    write_tiny_gguf(path, config, arch=arch, weights=weights, extra_tensors=extra, block_count=5,
                    extra_uint32={f"{arch}.nextn_predict_layers": 1})
    mtp = load_gguf(path)
    assert mtp.config == got.config
    assert_references_logits(mtp.config, mtp.weights, family)


def test_deepseek_v3s_latent_attention_is_read_and_matters(tmp_path):
    """DeepSeek-V3's multi-head latent attention, served absorbed (each head's query carried into the latent; one
    KV head of the rotated part and the latent): the config's widths, the softmax scale with YaRN's mscale squared,
    the interleaved RoPE pairs (read as rotate-half), each moving the logits when changed; its matrices stored
    in bfloat16 and int8 as the memory plan counts them (the up-projections, read per head, stay in the compute
    dtype), the logits near; int4 groups that do not divide a matrix's rows are refused naming it."""
    import shutil

    import jax

    from jaxcb.host.errors import InvalidConfig
    from jaxcb.host.memory_plan import weight_bytes

    config, params, _, _ = load_model(os.path.join(GOLDEN, "deepseek-v3"), jnp.float32)
    assert (config.num_kv_heads, config.head_dim, config.rotary_dim, config.kv_lora_rank, config.q_lora_rank,
            config.qk_nope_dim, config.v_head_dim) == (1, 40, 8, 32, 48, 16, 16)
    mscale = 0.1 * np.log(4.0) + 1.0
    assert config.query_scale == pytest.approx(24 ** -0.5 * mscale ** 2)
    assert params.layers.w_uk.shape == (4, 4, 16, 32) and params.layers.w_uv.shape == (4, 4, 32, 16)
    record = golden("deepseek-v3")[2]
    ref = np.asarray(record["prefill_logits"], np.float32)
    got = prefill_logits(dataclasses.replace(config, query_scale=24 ** -0.5), params, record["prompt_ids"])
    assert np.abs(got - ref).max() > 1e-3 * np.abs(ref).max()  # (without the mscale)
    folder = tmp_path / "ds"
    shutil.copytree(os.path.join(GOLDEN, "deepseek-v3"), folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "rope_interleave": False}))
    config2, params2, _, _ = load_model(str(folder), jnp.float32)
    got = prefill_logits(config2, params2, record["prompt_ids"])
    assert np.abs(got - ref).max() > 1e-3 * np.abs(ref).max()  # (the pairs read in the other order)
    (folder / "config.json").write_text(json.dumps({**raw, "topk_method": "group_limited_greedy"}))
    with pytest.raises(InvalidConfig, match="topk_method 'group_limited_greedy' is not supported"):
        load_model(str(folder), jnp.float32)
    for mode, bound in (("bfloat16", 0.01), ("int8", 0.03)):
        config, params, _, _ = load_model(os.path.join(GOLDEN, "deepseek-v3"), jnp.float32, weights=mode)
        assert sum(x.nbytes for x in jax.tree.leaves(params)) == weight_bytes(config, mode, 4)
        assert params.layers.w_uk.dtype == jnp.float32
        error = np.abs(prefill_logits(config, params, record["prompt_ids"]) - ref).max() / np.abs(ref).max()
        assert error <= bound, (mode, error)
    with pytest.raises(InvalidConfig, match="int4 groups of 32 do not divide the 48 input rows of wq_b"):
        load_model(os.path.join(GOLDEN, "deepseek-v3"), jnp.float32, weights="int4")


def test_latent_attention_padded_to_the_pallas_kernels_width_gives_the_reference_tokens():
    """The Pallas kernels take head dims that are powers of two: latent attention's cached width (here 8 + 32) is
    padded with zeros to one (64; DeepSeek-V3's 576 to 1,024) where they run (interpreted here), and the engine
    gives transformers' greedy tokens; the native CPU kernel takes the width as it is."""
    config, params, tok, _ = load_model(os.path.join(GOLDEN, "deepseek-v3"), jnp.float32)
    assert dataclasses.replace(config, kv_lora_rank=512, rotary_dim=64, head_dim=576, rope_freq_factors=(),
                               rope_linear_factor=1.0).for_kernels().head_dim == 1024
    records = golden("deepseek-v3")
    for attention, width in (("pallas", 64), ("native", 40)):
        llm = LLM.from_params(config, params, tok, config=make_config(
            num_pages=64, page_size=16, max_context=128, decode_batch=(4,), prefill_tokens=(16,), max_prefill_tokens=16,
            compile=compile_mode(config), attention=attention))
        assert llm.engine.runner.model_config.head_dim == width
        outs = llm.generate([r["prompt_ids"] for r in records], SamplingParams(max_tokens=8, ignore_eos=True))
        for record, out in zip(records, outs):
            n = before_near_tie(record, 8)
            assert out.token_ids[:n] == record["greedy_ids"][:n], (attention, len(record["prompt_ids"]))
        llm.engine.pool.check_all_free()


def _fp8_checkpoint(src: str, dst, block: int) -> dict:
    """`src`'s checkpoint with its linear layers' weights in float8 e4m3 with a scale a block of block x block, as
    DeepSeek-V3's and Qwen3-FP8's releases store them (weight_scale_inv); returns their dequantized values."""
    import shutil

    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors, out, values = load_file(str(dst / "model.safetensors")), {}, {}
    for name, w in tensors.items():
        if w.ndim != 2 or any(p in name for p in ("norm", "embed", "lm_head", "gate.weight")):
            out[name] = w
            continue
        r, c = -(-w.shape[0] // block), -(-w.shape[1] // block)
        padded = np.zeros((r * block, c * block), np.float32)
        padded[:w.shape[0], :w.shape[1]] = w
        scale = np.maximum(np.abs(padded.reshape(r, block, c, block)).max((1, 3)) / 448.0, 1e-12).astype(np.float32)
        full = np.repeat(np.repeat(scale, block, 0), block, 1)[:w.shape[0], :w.shape[1]]
        out[name], out[name + "_scale_inv"] = (w / full).astype(ml_dtypes.float8_e4m3fn), scale
        values[name] = out[name].astype(np.float32) * full
    save_file(out, str(dst / "model.safetensors"))
    raw = json.loads((dst / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block, block]}
    (dst / "config.json").write_text(json.dumps(raw))
    return values


def test_float8_weights_with_block_scales_are_read_as_released(tmp_path):
    """DeepSeek-V3's (and Qwen3-FP8's) float8 e4m3 weights with a scale a block (weight_scale_inv, blocks of
    quantization_config.weight_block_size; here 16 x 16 over 40- and 96-row matrices, so blocks are cut at the
    edges): each value q * its block's scale exactly, the logits within float8's error of transformers' on the
    float weights, the greedy token the same; a float8 tensor without its scales, or another quantization
    method, is refused by name."""
    from jaxcb.host.errors import InvalidConfig
    from jaxcb.model.hf_loader import load_weights, read_config

    values = _fp8_checkpoint(os.path.join(GOLDEN, "deepseek-v3"), tmp_path / "fp8", 16)
    config = read_config(str(tmp_path / "fp8"))
    weights = load_weights(str(tmp_path / "fp8"), config)
    latent = values["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"].T[:, :32]  # (the rotated part reordered)
    np.testing.assert_array_equal(weights["wkv_a"][2][:, :32], latent)
    np.testing.assert_array_equal(weights["experts_down"][1, 5], values["model.layers.2.mlp.experts.5.down_proj.weight"].T)
    params = load_model(str(tmp_path / "fp8"), jnp.float32)[1]
    for record in golden("deepseek-v3"):
        ref = np.asarray(record["prefill_logits"], np.float32)
        got = prefill_logits(config, params, record["prompt_ids"])
        assert np.abs(got - ref).max() <= 0.08 * np.abs(ref).max() and np.argmax(got) == np.argmax(ref)
    raw = json.loads((tmp_path / "fp8" / "config.json").read_text())
    (tmp_path / "fp8" / "config.json").write_text(json.dumps({**raw, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(InvalidConfig, match="quantization_config"):
        load_weights(str(tmp_path / "fp8"), config)
    from safetensors.numpy import save_file

    from jaxcb.model.hf_loader import _read_safetensors

    tensors = _read_safetensors(str(tmp_path / "fp8" / "model.safetensors"))
    del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file({n: np.ascontiguousarray(a) for n, a in tensors.items()}, str(tmp_path / "fp8" / "model.safetensors"))
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(InvalidConfig, match=r"float8 tensor model.layers.1.self_attn.o_proj.weight has no .*_scale_inv"):
        load_weights(str(tmp_path / "fp8"), config)


def test_minimax_m2s_parts_are_read_and_matter(tmp_path):
    """MiniMax-M2 (MiniMaxM2ForCausalLM): q and k RMS-normed over all their heads, the first rotary_dim of each head
    rotated (the released config's field), every layer's experts chosen by sigmoid score plus a correction bias
    and renormalized; each part moves the logits past the tolerance when changed. The multi-token prediction
    modules a release keeps after its last layer (num_mtp_modules) are left unread."""
    import shutil

    from safetensors.numpy import load_file, save_file

    config, params, _, _ = load_model(os.path.join(GOLDEN, "minimax-m2"), jnp.float32)
    assert (config.qk_norm_whole, config.rotary_dim, config.router_sigmoid, config.norm_topk, config.num_experts,
            config.mixed_mlp) == (True, 8, True, True, 8, False)
    assert params.layers.q_norm.shape == (4, 64) and params.layers.router_choice_bias.shape == (4, 8)
    record = golden("minimax-m2")[2]
    ref = np.asarray(record["prefill_logits"], np.float32)
    unbiased = params.replace(layers=params.layers.replace(router_choice_bias=jnp.zeros((4, 8))))
    for change, p in (({"rotary_dim": 0}, params), ({"norm_topk": False}, params), ({"router_sigmoid": False}, params),
                      ({}, unbiased)):
        got = prefill_logits(dataclasses.replace(config, **change), p, record["prompt_ids"])
        assert np.abs(got - ref).max() > 1e-3 * np.abs(ref).max(), change
    folder = tmp_path / "m2"
    shutil.copytree(os.path.join(GOLDEN, "minimax-m2"), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({n.replace("layers.3.", "layers.4."): a for n, a in tensors.items() if ".layers.3." in n},
              str(folder / "mtp.safetensors"))
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "use_mtp": True, "num_mtp_modules": 1}))
    got = prefill_logits(*load_model(str(folder), jnp.float32)[:2], record["prompt_ids"])
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
