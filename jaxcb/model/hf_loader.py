"""Hugging Face checkpoint directories: config.json, *.safetensors and tokenizer.json.

Llama-family architectures load into the one model with its named variations (jaxcb.model.config):
Llama and Mistral as they are, Qwen2 with its q/k/v biases, Qwen3 with its per-head q/k norms and
explicit head_dim, Gemma 2 (four norms a layer, soft-capping, sliding layers alternating with full
ones) and Gemma 3 (text: q/k norms, five sliding layers to a full one, a local RoPE base), Mixtral and
Qwen3-MoE and OLMoE (a mixture of experts in place of the MLP; OLMoE's q and k normed whole), OLMo 2 (norms after attention and the MLP only; q and
k normed whole), gpt-oss (attention sinks, biases, clamped SwiGLU experts in MXFP4 or floats, sliding layers,
YaRN on every layer), Llama 4 Scout and Maverick (experts scaled at their inputs beside a shared one, Maverick's
dense layers between, NoPE layers with temperature tuning, weightless q/k norms, RoPE on complex pairs read as
rotate-half; chunked attention), GLM-4.5 (dense first layers, then DeepSeek-V3's router over experts beside
shared ones; partial RoPE), DeepSeek-V3 (GLM-4.5's kind of experts; multi-head latent attention, its kv_b_proj
split into the absorbed up-projections, its interleaved RoPE pairs reordered) and V2 (its softmax router, groups
by their best), MiniMax-M2 (q/k normed whole, partial RoPE, sigmoid-routed experts with correction biases); a
separate output head when the embeddings are not tied. The safetensors files are memory-mapped and each weight read
when it is used (jaxcb.model.lazy_weights), transposed from torch's [out, in] to this project's [in, out].
"""

from __future__ import annotations

import glob
import json
import math
import os

import logging

import numpy as np

from jaxcb.host.errors import InvalidConfig
from jaxcb.model import rope_scaling
from jaxcb.model.config import ModelConfig, check_all_used
from jaxcb.model.lazy_weights import LazyWeights

log = logging.getLogger("jaxcb.model.hf_loader")

# architecture -> family
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "SmolLM3ForCausalLM": "smollm3", "GraniteForCausalLM": "granite", "Phi3ForCausalLM": "phi3",
                 "Qwen3ForCausalLM": "qwen3", "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
                 "Gemma3ForCausalLM": "gemma3",
                 "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3moe", "GraniteMoeForCausalLM": "granitemoe",
                 "Qwen2MoeForCausalLM": "qwen2moe", "Olmo2ForCausalLM": "olmo2", "OlmoeForCausalLM": "olmoe",
                 "GptOssForCausalLM": "gpt-oss", "Llama4ForCausalLM": "llama4", "Glm4MoeForCausalLM": "glm4moe",
                 "DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2",
                 "MiniMaxM2ForCausalLM": "minimax_m2",
                 "Llama4ForConditionalGeneration": "llama4",
                 # Vision-language checkpoints as released (a vision tower beside the language model): served on
                 # text. Gemma 3 4B+; Qwen2-VL, Qwen2.5-VL (a Qwen2) and Qwen3-VL (a Qwen3), whose M-RoPE gives
                 # every section a text token's one position: plain RoPE; Mistral Small 3.1+ (Mistral3) and
                 # Llava, whose language model is named by text_config.model_type (_TEXT_MODELS)
                 "Gemma3ForConditionalGeneration": "gemma3", "Qwen2VLForConditionalGeneration": "qwen2",
                 "Qwen2_5_VLForConditionalGeneration": "qwen2", "Qwen3VLForConditionalGeneration": "qwen3",
                 "Mistral3ForConditionalGeneration": "text_config", "LlavaForConditionalGeneration": "text_config",
                 # Base models without a language-model head, as embedding models are released (e5-mistral's and
                 # Linq's MistralModel, bge-multilingual-gemma2's Gemma2Model): tensors without "model.", served for
                 # embeddings only (ModelConfig.headless)
                 "LlamaModel": "llama", "MistralModel": "llama", "Qwen2Model": "qwen2", "Qwen3Model": "qwen3",
                 "GemmaModel": "gemma", "Gemma2Model": "gemma2", "Gemma3TextModel": "gemma3",
                 # Sequence classifiers (rerankers, reward models, text classifiers): the base model under "model."
                 # and a `score` head on the last token's hidden state, which jaxcb.host.classifier applies; the
                 # engine serves them headless
                 "LlamaForSequenceClassification": "llama", "MistralForSequenceClassification": "llama",
                 "Qwen2ForSequenceClassification": "qwen2", "Qwen3ForSequenceClassification": "qwen3",
                 "GemmaForSequenceClassification": "gemma", "Gemma2ForSequenceClassification": "gemma2",
                 "Gemma3TextForSequenceClassification": "gemma3"}
_BASE_MODELS = frozenset(a for a in ARCHITECTURES if a.endswith("Model"))
SEQUENCE_CLASSIFIERS = frozenset(a for a in ARCHITECTURES if a.endswith("ForSequenceClassification"))
CLASSIFIER_TENSORS = ("score.weight", "score.bias")  # a sequence classifier's head (jaxcb.host.classifier reads it)
_TEXT_MODELS = {"llama": "llama", "mistral": "llama"}  # text_config.model_type -> family (Mistral3's, Llava's)
# Where a checkpoint keeps the language model's tensors: a causal LM's "model.", a multimodal one's
# (transformers' two layouts of it), a base model's at the top; and the parts of a multimodal one that text does
# not use.
_PREFIXES = ("model.", "language_model.model.", "model.language_model.", "")
_VISION_PARTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                 "visual.", "model.visual.", "vision_model.", "model.vision_model.")

_LAYER = {  # our name -> (HF name in layer i, transpose)
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
# Fused projections (Phi-3): split into the table's own (by our names), in their order of rows.
_FUSED = {"self_attn.qkv_proj.weight": ("wq", "wk", "wv"), "mlp.gate_up_proj.weight": ("w_gate", "w_up")}
# The families whose MLP is a mixture of experts, and the layouts their checkpoints keep experts in (told apart
# by the router's name): Mixtral's names; Qwen2-MoE's, Qwen3-MoE's and OLMoE's ("mlp"): the router, and each
# expert's gate, up and down projections; Granite MoE's: the router, every expert's gate and up projections in
# one tensor [X, 2F, E] (gate first), and their down projections [X, E, F].
_MOE_FAMILIES = ("mixtral", "qwen2moe", "qwen3moe", "olmoe", "granitemoe", "gpt-oss", "llama4", "glm4moe", "deepseek_v3",
                 "deepseek_v2", "minimax_m2")
_MOE = {"mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.", ("w1", "w3", "w2")),
        "mlp": ("mlp.gate.weight", "mlp.experts.{j}.", ("gate_proj", "up_proj", "down_proj")),
        "granitemoe": ("block_sparse_moe.router.layer.weight", "block_sparse_moe.",
                       ("input_linear", "input_linear", "output_linear"))}
_BIASES = {"bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias"}
# gpt-oss's experts: the router (with a bias), every expert's gate and up projections in one tensor [X, E, 2F]
# (gate and up columns interleaved, gate first) and their down projections [X, F, E], each with a bias; as
# released, the expert matrices in MXFP4 (_mxfp4: `<name>_blocks` and `<name>_scales`)
_GPT_OSS = {"router": "mlp.router.weight", "router_bias": "mlp.router.bias", "gate_up": "mlp.experts.gate_up_proj",
            "down": "mlp.experts.down_proj"}
_FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)

_QK_NORMS = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
# Gemma names its norms by place: post_attention_layernorm is the attention output's, not the MLP input's.
_GEMMA_NORMS = {"mlp_norm": "pre_feedforward_layernorm.weight", "post_attn_norm": "post_attention_layernorm.weight",
                "post_mlp_norm": "post_feedforward_layernorm.weight"}


def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _rope(raw: dict, kind: str | None = None) -> tuple[float | None, dict | None]:
    """(RoPE base, scaling) from either transformers layout: `rope_theta` (+ `rope_scaling`), or
    `rope_parameters` (transformers 5; per layer type for Gemma 3)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and kind in params and isinstance(params[kind], dict):
        params = params[kind]
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"]), params
    # transformers 4's layout: `rope_scaling` is the global layers'; Gemma 3's sliding layers run plain RoPE
    # at rope_local_base_freq (read by the caller)
    return ((float(raw["rope_theta"]) if "rope_theta" in raw else None),
            None if kind == "sliding_attention" else raw.get("rope_scaling"))


def _plain_rope(scaling) -> None:
    kind = rope_scaling.kind(scaling)
    factor = scaling.get("factor", 1.0) if scaling else 1.0
    if kind not in (None, "default") and not (kind == "linear" and factor == 1.0):
        raise InvalidConfig(f"config.json: rope_scaling {scaling!r} is not supported (plain RoPE only)")


def _longrope(scaling: dict, raw: dict, rotary_dim: int, max_context: int) -> dict:
    """LongRoPE (Phi-3.5, Phi-4-mini): each frequency divided by its short factor up to the original context,
    by its long factor past it (ModelConfig.at_context), cos and sin scaled by the attention factor
    (transformers' default from the ratio of the contexts). Without long factors the served context is capped
    at the original one."""
    try:
        original = int(scaling.get("original_max_position_embeddings") or raw["original_max_position_embeddings"])
        short = [float(f) for f in scaling["short_factor"]]
        factor = float(scaling.get("factor") or max_context / original)
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidConfig(f"config.json: rope_scaling (longrope) lacks what it needs ({e})") from None
    try:
        long = [float(f) for f in scaling.get("long_factor") or ()]
    except (TypeError, ValueError) as e:
        raise InvalidConfig(f"config.json: rope_scaling.long_factor is not a list of numbers ({e})") from None
    for name, factors in (("short_factor", short), ("long_factor", long)):
        if (factors or name == "short_factor") and len(factors) != rotary_dim // 2:  # (the long ones may be absent)
            raise InvalidConfig(f"config.json: rope_scaling.{name} has {len(factors)} factors for {rotary_dim} "
                                f"rotated dimensions (one per frequency: {rotary_dim // 2})")
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return {"rope_freq_factors": tuple(short), "rope_attention_factor": float(attention),
            "rope_long_factors": tuple(long), "rope_original_context": original,
            "max_context": max_context if long else min(max_context, original)}


def config_json(path: str) -> dict:
    """A checkpoint's config.json as it is."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidConfig(f"model: {path}/config.json is not readable JSON ({e})") from None


def read_config(path: str) -> ModelConfig:
    raw = config_json(path)
    arch = (raw.get("architectures") or ["?"])[0]
    text = raw.get("text_config") or {}
    raw = {**raw, **text}
    if arch not in ARCHITECTURES:
        raise InvalidConfig(f"config.json: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    encoder = next((k for k in ("use_bidirectional_attention", "is_causal") if raw.get(k) is (k != "is_causal")), None)
    if encoder is not None:  # (EmbeddingGemma's: an encoder)
        raise InvalidConfig(f"config.json: {encoder}: bidirectional attention is not supported (jaxcb runs causal "
                            "decoders)")
    family = ARCHITECTURES[arch]
    if family == "text_config":
        family = _TEXT_MODELS.get(text.get("model_type"))
        if family is None:
            raise InvalidConfig(f"config.json: text_config.model_type {text.get('model_type')!r}: {arch} is served "
                                f"(on text) with a language model of type {' or '.join(_TEXT_MODELS)}")
    gemma = family.startswith("gemma")
    if family == "gpt-oss":  # transformers' GptOssConfig defaults, for what a config leaves out
        raw = {"attention_bias": True, "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "head_dim": 64, **raw}
        if not raw.get("rope_scaling") and not isinstance(raw.get("rope_parameters"), dict):
            raw["rope_scaling"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "truncate": False, "original_max_position_embeddings": 4096}
    theta, scaling = _rope(raw, "full_attention")
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        layers = int(raw["num_hidden_layers"])
        head_dim = int(raw.get("head_dim") or hidden // heads)
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if family in ("deepseek_v2", "deepseek_v3"):  # (RoPE rotates the keys' own part: its width; the rest below)
            head_dim = int(raw["qk_rope_head_dim"])
        max_context = int(raw.get("max_position_embeddings", 2048))
        partial = float((scaling or {}).get("partial_rotary_factor") or raw.get("partial_rotary_factor")
                        or (int(raw["rotary_dim"]) / head_dim if raw.get("rotary_dim") else 1.0))  # (MiniMax-M2's)
        rotary_dim = int(head_dim * partial)  # (Phi-4-mini: only each head's first dimensions rotate)
        extra = rope_scaling.from_dict(scaling, theta or 10000.0, rotary_dim, max_context)
        max_context = extra.pop("max_context", max_context)
        if partial != 1.0:
            extra["rotary_dim"] = rotary_dim
        if rope_scaling.kind(scaling) in ("longrope", "su"):
            extra.update(_longrope(scaling, raw, rotary_dim, max_context))
            max_context = extra.pop("max_context")
        if family in ("qwen2", "qwen2moe") and raw.get("use_sliding_window"):
            raise InvalidConfig("config.json: use_sliding_window (Qwen2's sliding layers) is not supported")
        if (arch == "MistralForCausalLM" or raw.get("model_type") == "mistral" or family == "phi3") and raw.get("sliding_window"):
            # Mistral 7B v0.1 and Phi-3 attend to their last `sliding_window` tokens in every layer: exactly
            # full attention up to there, which is as far as jaxcb serves them.
            max_context = min(max_context, int(raw["sliding_window"]))
        if family == "smollm3":  # Llama with no RoPE in some layers (no_rope_layers: 0 = none; every fourth)
            if raw.get("use_sliding_window"):
                raise InvalidConfig("config.json: use_sliding_window (SmolLM3's sliding layers) is not supported")
            interval = int(raw.get("no_rope_layer_interval", 4))
            uses = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
            if len(uses) != layers:
                raise InvalidConfig(f"config.json: no_rope_layers has {len(uses)} entries for {layers} layers")
            extra.update(nope_layers=tuple(not u for u in uses))
        if family in ("granite", "granitemoe"):  # Llama with scalars on the embeddings, residual branches, scores, logits
            extra.update(embed_multiplier=float(raw.get("embedding_multiplier", 1.0)),
                         residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
                         query_scale=float(raw.get("attention_multiplier", 1.0)),
                         logit_scale=float(raw.get("logits_scaling", 1.0)))
        if family == "gemma2" and extra:
            raise InvalidConfig(f"config.json: rope_scaling {scaling!r}: Gemma 2 has plain RoPE")
        if family in ("qwen3", "qwen3moe"):
            extra.update(qk_norm=True)
        if family == "olmo2":  # norms after attention and the MLP only; q and k normed whole, before RoPE
            extra.update(qk_norm=True, qk_norm_whole=True, post_norms=True, pre_norms=False)
        if family == "olmoe":  # Llama's norms, q and k normed whole before RoPE, experts
            extra.update(qk_norm=True, qk_norm_whole=True)
        if raw.get("clip_qkv") is not None:  # (OLMo's: q, k and v clamped)
            raise InvalidConfig(f"config.json: clip_qkv {raw['clip_qkv']!r} is not supported")
        # (Mixtral's and Granite MoE's experts are intermediate_size wide, Qwen's moe_intermediate_size)
        moe_width = family in ("qwen3moe", "qwen2moe", "glm4moe", "deepseek_v2", "deepseek_v3")
        intermediate = int(raw["moe_intermediate_size"] if moe_width else raw["intermediate_size"])
        if family == "llama4":  # (Maverick: dense MLPs intermediate_size_mlp wide between the experts' layers)
            step = int(raw.get("interleave_moe_layer_step", 1))
            moe = raw.get("moe_layers")
            moe = list(range(step - 1, layers, step)) if moe is None else moe  # (transformers' default)
            extra.update(_moe_layers([i in moe for i in range(layers)], raw.get("intermediate_size_mlp"),
                                     "moe_layers / interleave_moe_layer_step"))
            interval = int(raw.get("no_rope_layer_interval", 4))
            uses = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
            if len(uses) != layers:
                raise InvalidConfig(f"config.json: no_rope_layers has {len(uses)} entries for {layers} layers")
            chunk = raw.get("attention_chunk_size", 8192)  # (transformers' default; null: none)
            if chunk:  # the RoPE layers attend within chunks (their pages a group of their own), the NoPE layers to all
                extra.update(sliding_window=int(chunk), sliding_layers=tuple(bool(u) for u in uses),
                             attention_chunked=True, rope_scaled_sliding=True)  # (one RoPE, scaled, for all)
            extra.update(nope_layers=tuple(not u for u in uses), qk_rms_rope=bool(raw.get("use_qk_norm", True)),
                         nope_temperature=int(raw.get("floor_scale", 8192)) if raw.get("attn_temperature_tuning", True)
                         else 0, nope_temperature_scale=float(raw.get("attn_scale", 0.1)), moe_input_scale=True,
                         shared_expert_size=int(raw["intermediate_size"]), shared_expert_gated=False)
        if family in ("qwen2moe", "qwen3moe"):  # dense MLPs (intermediate_size wide) in mlp_only_layers and
            step, only = int(raw.get("decoder_sparse_step") or 1), raw.get("mlp_only_layers") or []  # between steps
            extra.update(_moe_layers([i not in only and (i + 1) % step == 0 for i in range(layers)],
                                     raw.get("intermediate_size"), "mlp_only_layers / decoder_sparse_step"))
        if family in ("deepseek_v2", "deepseek_v3"):  # latent attention (ModelConfig.kv_lora_rank), router below
            extra.update(_latent_attention(raw, head_dim, scaling, family))
            head_dim, kv_heads = extra.pop("head_dim"), 1
        if family in ("glm4moe", "deepseek_v2", "deepseek_v3"):  # the first layers dense; shared experts always run;
            first = int(raw.get("first_k_dense_replace", 0))  # DeepSeek-V3's router (V2's: softmax, below)
            extra.update(_moe_layers([i >= first for i in range(layers)], raw.get("intermediate_size"),
                                     "first_k_dense_replace"))
            grouped = family != "deepseek_v2" or raw.get("topk_method") == "group_limited_greedy"
            extra.update(router_sigmoid=family != "deepseek_v2", router_choice_bias=family != "deepseek_v2",
                         expert_groups=int(raw.get("n_group") or 1) if grouped else 1,
                         expert_groups_used=int(raw.get("topk_group") or 1) if grouped else 1,
                         routed_scale=float(raw.get("routed_scaling_factor", 1.0)), qk_norm=bool(raw.get("use_qk_norm")),
                         shared_expert_size=intermediate * int(raw.get("n_shared_experts") or 0),
                         shared_expert_gated=False)
            if family == "deepseek_v2":  # (the chosen ones' probabilities as they are, unless norm_topk_prob)
                extra["norm_topk"] = bool(raw.get("norm_topk_prob", False))
        if family == "minimax_m2":  # q and k normed over all their heads; DeepSeek-V3's router without groups
            for key, allowed in (("scoring_func", "sigmoid"), ("qk_norm_type", "per_layer")):
                if raw.get(key, allowed) != allowed:
                    raise InvalidConfig(f"config.json: {key} {raw[key]!r} is not supported for MiniMax-M2 ({allowed})")
            extra.update(qk_norm=True, qk_norm_whole=True, router_sigmoid=True,
                         router_choice_bias=bool(raw.get("use_routing_bias", True)))
        if family in _MOE_FAMILIES:
            experts = int(raw.get("num_experts") or raw.get("n_routed_experts") or raw["num_local_experts"])
            used = int(raw["num_experts_per_tok"])
            if not 0 < used <= experts:
                raise InvalidConfig(f"config.json: num_experts_per_tok {used} is not between 1 and the {experts} experts")
            # (renormalized: Mixtral's and Granite MoE's always; Qwen's and OLMoE's as norm_topk_prob, transformers'
            # default off)
            extra.update(num_experts=experts, experts_per_token=used,
                         norm_topk=bool(raw.get("norm_topk_prob", family not in ("qwen3moe", "qwen2moe", "olmoe"))))
            extra.setdefault("shared_expert_size", int(raw.get("shared_expert_intermediate_size") or 0))
        if family == "gpt-oss":  # sinks, biases everywhere, clamped SwiGLU experts, sliding layers, YaRN on all
            window = int(raw.get("sliding_window") or 0)
            types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                               for i in range(layers)]
            if len(types) != layers:
                raise InvalidConfig(f"config.json: layer_types has {len(types)} entries for {layers} layers")
            extra.update(attn_sinks=True, expert_bias=True, activation="swiglu_oai",
                         swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)), swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
                         sliding_window=window, rope_scaled_sliding=True,
                         sliding_layers=tuple(t == "sliding_attention" for t in types) if window else ())
        if gemma:
            window = int(raw.get("sliding_window") or 0)
            types = raw.get("layer_types")
            if not types:
                period = 2 if family == "gemma2" else int(raw.get("sliding_window_pattern", 6))
                types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]
            local_theta, local_scaling = _rope(raw, "sliding_attention")
            local_theta = float(raw.get("rope_local_base_freq", local_theta or 0.0))
            _plain_rope(local_scaling)
            extra.update(
                norm_plus_one=True, post_norms=family != "gemma", embed_scale=True, qk_norm=family == "gemma3",
                activation="gelu_tanh",
                query_scale=float(raw.get("query_pre_attn_scalar", head_dim)) ** -0.5,
                sliding_window=window,
                sliding_layers=tuple(t == "sliding_attention" for t in types) if window else (),
                local_rope_theta=local_theta if family == "gemma3" else 0.0,
                attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
                final_softcap=float(raw.get("final_logit_softcapping") or 0.0))
            act = raw.get("hidden_activation") or raw.get("hidden_act")
            if family == "gemma" and act == "gelu":  # (Gemma 1's released configs: transformers runs it as the
                act = None  # tanh approximation it was trained with)
            if act not in (None, "gelu_pytorch_tanh", "gelu_tanh"):
                raise InvalidConfig(f"config.json: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        return ModelConfig(
            vocab_size=int(raw["vocab_size"]), hidden_size=hidden, intermediate_size=intermediate,
            num_layers=layers, num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_context=max_context,
            rope_theta=theta or 10000.0, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_embeddings=(not _has_head(path) if arch.endswith("ForConditionalGeneration") or arch in _BASE_MODELS
                            else arch in SEQUENCE_CLASSIFIERS or bool(raw.get("tie_word_embeddings", gemma))),
            headless=arch in _BASE_MODELS and not _has_head(path) or arch in SEQUENCE_CLASSIFIERS,
            name=os.path.basename(os.path.normpath(path)),
            attention_bias=family in ("qwen2", "qwen2moe") or bool(raw.get("attention_bias", False)),
            # (transformers' attention_bias puts one on the output projection too, but for Qwen2's and GLM's)
            out_bias=bool(raw.get("attention_bias", False)) and family not in ("qwen2", "qwen2moe", "glm4moe"),
            family={"qwen2": "llama", "smollm3": "llama", "granite": "llama", "phi3": "llama", "mixtral": "llama",
                    "granitemoe": "llama", "qwen2moe": "llama",
                    "qwen3moe": "qwen3"}.get(family, family), **extra,
        )
    except KeyError as e:
        raise InvalidConfig(f"config.json: {e.args[0]} is missing") from None


# The routers DeepSeek's configs may name: scoring_func and topk_method per family (the first of each its default)
_DEEPSEEK_ROUTERS = {"deepseek_v3": (("sigmoid",), ("noaux_tc",)),
                     "deepseek_v2": (("softmax",), ("greedy", "group_limited_greedy"))}


def _latent_attention(raw: dict, rope: int, scaling, family: str) -> dict:
    """ModelConfig's latent attention fields from a DeepSeek-V2/V3 config.json (`rope`: qk_rope_head_dim): the
    cached width (rotated part + latent) as head_dim, and the softmax's scale, (qk_nope + qk_rope)^-0.5, times
    YaRN's mscale(factor, mscale_all_dim) squared where the RoPE is YaRN's (DeepSeek's rule, transformers' and
    vLLM's). A router the family does not have is refused by name."""
    for key, allowed in zip(("scoring_func", "topk_method"), _DEEPSEEK_ROUTERS[family]):
        if raw.get(key, allowed[0]) not in allowed:
            raise InvalidConfig(f"config.json: {key} {raw[key]!r} is not supported for {family} "
                                f"({' or '.join(allowed)})")
    latent, nope = int(raw["kv_lora_rank"]), int(raw["qk_nope_head_dim"])
    scale = (nope + rope) ** -0.5
    if rope_scaling.kind(scaling) == "yarn" and (scaling or {}).get("mscale_all_dim"):
        factor = float(scaling["factor"])
        mscale = 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return {"kv_lora_rank": latent, "q_lora_rank": int(raw.get("q_lora_rank") or 0), "qk_nope_dim": nope,
            "v_head_dim": int(raw["v_head_dim"]), "rotary_dim": rope, "head_dim": rope + latent, "query_scale": scale}


def _moe_layers(flags: list[bool], dense_size, what: str) -> dict:
    """ModelConfig's moe_layers and dense_size from a config's per-layer kinds (True: experts), or nothing when
    every layer has experts."""
    if all(flags):
        return {}
    if not any(flags):
        raise InvalidConfig(f"config.json: {what} leave no layer with experts")
    if not dense_size:
        raise InvalidConfig(f"config.json: {what} make dense layers, but their MLP's width is missing")
    return {"moe_layers": tuple(flags), "dense_size": int(dense_size)}


def _weight_files(path: str) -> list[str]:
    """The checkpoint's safetensors files: those its shards' index (model.safetensors.index.json) names, as
    transformers reads them (Mistral's releases keep a consolidated.safetensors of another layout beside them), else
    every *.safetensors file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return sorted(glob.glob(os.path.join(path, "*.safetensors")))
    try:
        with open(index, encoding="utf-8") as f:
            files = sorted({str(file) for file in json.load(f)["weight_map"].values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise InvalidConfig(f"model: {index} is not a readable shards' index ({type(e).__name__}: {e})") from None
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise InvalidConfig(f"model: {path} lacks {', '.join(missing[:3])}, which model.safetensors.index.json names")
    return [os.path.join(path, f) for f in files]


def classifier_tensors(path: str) -> dict[str, np.ndarray]:
    """The CLASSIFIER_TENSORS a checkpoint has (a sequence classifier's head, jaxcb.host.classifier), memory-mapped."""
    out = {}
    for file in _weight_files(path):
        tensors = _read_safetensors(file)
        out.update({n: tensors[n] for n in CLASSIFIER_TENSORS if n in tensors})
    return out


def _has_head(path: str) -> bool:
    """Whether the checkpoint stores an output head (a vision-language config's tie_word_embeddings may sit in
    either of its two configs, and transformers versions read different ones: the tensors decide). Read from
    the shards' index, or the files' headers."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    try:
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                names = list(json.load(f)["weight_map"])
        else:
            names = [n for file in sorted(glob.glob(os.path.join(path, "*.safetensors")))
                     for n in safe_open(file, "np").keys()]
    except Exception as e:  # noqa: BLE001 - json's and the library's own error types
        raise InvalidConfig(f"model: the tensor names of {path} are not readable ({e})") from None
    return any(n == "lm_head.weight" or n.endswith(".lm_head.weight") for n in names)


# Llama 4's experts: the router, every expert's gate and up projections in one tensor [X, E, 2F] (gate first),
# their down projections [X, F, E]
_LLAMA4 = {"router": "feed_forward.router.weight", "gate_up": "feed_forward.experts.gate_up_proj",
           "down": "feed_forward.experts.down_proj"}


def _mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 (OCP microscaling: 32 FP4 E2M1 values sharing a power-of-two scale) as gpt-oss stores its experts:
    blocks uint8 [X, out, in/32, 16] (two values a byte, the low nibble first), scales uint8 [X, out, in/32]
    (exponent + 127). Returns float32 [X, in, out], this project's layout."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise InvalidConfig(f"model: MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match")
    values = np.empty(blocks.shape[:-1] + (32,), np.float32)
    values[..., 0::2], values[..., 1::2] = _FP4[blocks & 15], _FP4[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return np.ascontiguousarray(values.reshape(*blocks.shape[:-2], -1).swapaxes(-1, -2))


def _halves_order(d: int) -> np.ndarray:
    """The order that takes d dimensions rotated as complex pairs (2i, 2i + 1) to rotate-half's pairs (i, i + d/2)."""
    return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])


def halves_from_pairs(w: np.ndarray, config: ModelConfig) -> np.ndarray:
    """A q or k projection's output columns [..., heads x D] of a model whose RoPE rotates complex pairs (2i,
    2i + 1) (Llama 4) reordered, each head's, to rotate-half's pairs (i, i + D/2): the same rotation. q and k
    alike, so their products stay the same in layers without RoPE too; a LoRA adapter's B columns likewise."""
    d = config.head_dim
    return np.ascontiguousarray(w.reshape(*w.shape[:-1], -1, d)[..., _halves_order(d)].reshape(w.shape))


def reorder_pairs(weights: LazyWeights, config: ModelConfig) -> None:
    """A Llama 4 checkpoint's q and k (and their biases) read as halves_from_pairs reads them (both loaders: its
    GGUF keeps the checkpoint's order too)."""
    if config.family == "llama4":
        for key in ("wq", "wk", "bq", "bk"):
            if key in weights:
                weights.then(key, lambda w: halves_from_pairs(w, config))


def _up_projections(config: ModelConfig, kv_b: list[np.ndarray]) -> dict[str, np.ndarray]:
    """DeepSeek's kv_b_proj (per layer [H*(N+V), C]: each head's key rows, then its value rows) as the absorbed
    form's w_uk [L, H, N, C] and w_uv [L, H, C, V]."""
    h, n, v, c = config.num_heads, config.qk_nope_dim, config.v_head_dim, config.kv_lora_rank
    stacked = np.stack([np.asarray(w, np.float32) for w in kv_b])
    if stacked.shape[1:] != (h * (n + v), c):
        raise InvalidConfig(f"model: kv_b_proj has shape {stacked.shape[1:]}, expected {(h * (n + v), c)}")
    per_head = stacked.reshape(-1, h, n + v, c)
    return {"w_uk": np.ascontiguousarray(per_head[:, :, :n]),
            "w_uv": np.ascontiguousarray(per_head[:, :, n:].transpose(0, 1, 3, 2))}


def _latent_rope_halves(weights: LazyWeights, config: ModelConfig) -> None:
    """The rotated parts of latent attention's queries (each head's last R columns of wq / wq_b) and keys (wkv_a's
    last R columns) read reordered from interleaved pairs (2i, 2i + 1) to rotate-half's (i, i + R/2): the same
    rotation, and the same products of queries and keys."""
    r = config.rotary_dim
    order = _halves_order(r)

    def queries(w):
        q = w.reshape(*w.shape[:-1], config.num_heads, -1)
        q[..., -r:] = q[..., -r:][..., order]
        return q.reshape(w.shape)

    def keys(w):
        w[..., -r:] = w[..., -r:][..., order]
        return w

    weights.then("wq_b" if config.q_lora_rank else "wq", queries)
    weights.then("wkv_a", keys)


# safetensors' dtype names -> numpy's (bfloat16 and float8 through ml_dtypes, which jax brings)
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32", "I16": "int16",
           "I8": "int8", "U8": "uint8", "BOOL": "bool", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
           "F8_E5M2": "float8_e5m2"}


def _read_safetensors(file: str) -> dict[str, np.ndarray]:
    """A safetensors file's tensors, memory-mapped (read from the disk only when used), from its header: the
    library's numpy reader reads a whole file into memory and has no float8 type (DeepSeek-V3's, Qwen3-FP8's
    releases)."""
    import ml_dtypes

    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if size > os.path.getsize(file) - 8:
                raise ValueError(f"its header's length, {size} bytes, runs past the end of the file")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        data = np.memmap(file, np.uint8, mode="r", offset=8 + size) if header else np.zeros(0, np.uint8)
        out = {}
        for name, t in header.items():
            if t["dtype"] not in _DTYPES:
                raise InvalidConfig(f"model: {file}: tensor {name} has dtype {t['dtype']}, which jaxcb does not read")
            dtype = np.dtype(getattr(ml_dtypes, _DTYPES[t["dtype"]], None) or _DTYPES[t["dtype"]])
            begin, end = t["data_offsets"]
            out[name] = data[begin:end].view(dtype).reshape(t["shape"])
        return out
    except InvalidConfig:
        raise
    except Exception as e:  # noqa: BLE001 - a short file, a bad header: json's, numpy's and the OS's errors
        raise InvalidConfig(f"model: {file} is not a readable safetensors file ({type(e).__name__}: {e})") from None


def _float8_blocks(tensors: dict, raw: dict) -> dict[str, tuple[str, tuple[int, int]]]:
    """Float8 weights with block scales (DeepSeek-V3's and Qwen3-FP8's "fp8" quantization: `<name>` in float8 e4m3,
    `<name>_scale_inv` one float a block of config.json's (`raw`) quantization_config.weight_block_size, default 128 x
    128, of its [out, in] matrix): {name: (its scales' name, block)}, each checked against its matrix; read as
    w = q * scale_inv of its block (_read)."""
    scaled = [n for n, a in tensors.items() if str(a.dtype).startswith("float8")]
    if not scaled:
        return {}
    quant = raw.get("quantization_config") or {}
    block = quant.get("weight_block_size") or [128, 128]
    if quant.get("quant_method", "fp8") != "fp8" or len(block) != 2:
        raise InvalidConfig(f"config.json: quantization_config {quant!r}: jaxcb reads fp8 weights with block scales")
    out = {}
    for name in scaled:
        scale, w = tensors.get(name + "_scale_inv"), tensors[name]
        if scale is None or w.ndim != 2:
            raise InvalidConfig(f"model: float8 tensor {name} has no {name}_scale_inv of blocks beside it")
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        if scale.shape != (rows, cols):
            raise InvalidConfig(f"model: {name}_scale_inv has shape {scale.shape}, expected {(rows, cols)} "
                                f"(blocks of {block[0]} x {block[1]})")
        out[name] = (name + "_scale_inv", (block[0], block[1]))
    return out


def hf_state_dict(config: ModelConfig, weights: dict) -> dict[str, np.ndarray]:
    """The loader layout's weights of a dense Llama-like model (Q/K/V biases and an untied head included) by the names
    and in the layouts ([out, in]) a Hugging Face checkpoint keeps them: what weights_from_tensors reads back."""
    if config.num_experts or config.mla or config.qk_norm or config.post_norms or config.out_bias or config.attn_sinks:
        raise InvalidConfig(f"model: {config.name}'s weights are not a plain Llama's (experts, latent attention or "
                            "extra norms): no Hugging Face names for them here")
    tensors = {"model.embed_tokens.weight": np.asarray(weights["embed"]),
               "model.norm.weight": np.asarray(weights["final_norm"])}
    names = dict(_LAYER)
    if config.attention_bias:
        names.update({k: (v, False) for k, v in _BIASES.items()})
    for key, (name, transpose) in names.items():
        stack = np.asarray(weights[key])
        for i in range(config.num_layers):
            tensors[f"model.layers.{i}.{name}"] = np.ascontiguousarray(stack[i].T if transpose else stack[i])
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = np.ascontiguousarray(np.asarray(weights["lm_head"]).T)
    return tensors


def load_weights(path: str, config: ModelConfig) -> LazyWeights:
    """The weights in the loader layout of jaxcb.model.llama (float32), each read from the memory-mapped files when
    it is used (jaxcb.model.lazy_weights): every tensor's presence, and the plain ones' shapes, checked first."""
    files = _weight_files(path)
    if not files:
        raise InvalidConfig(f"model: {path} has no *.safetensors files")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(_read_safetensors(f))
    return weights_from_tensors(tensors, config_json(path), config, path)


def weights_from_tensors(tensors: dict, settings: dict, config: ModelConfig, path: str) -> LazyWeights:
    """The loader layout's weights from a checkpoint's tensors by their Hugging Face names (`tensors`: numpy
    arrays or anything np.asarray reads; `settings`: its config.json, {} for none; `path`: what the errors name):
    every tensor the model needs must be there and every one given must be used."""
    tensors = dict(tensors)  # (fused projections add their parts' names)
    settings = {**settings, **(settings.get("text_config") or {})}  # (a multimodal one's language model's, as read_config)
    float8 = _float8_blocks(tensors, settings)
    used = {scale for scale, _ in float8.values()}

    def need(name: str) -> str:
        """A tensor the weights are made of: there, and counted as used."""
        if name not in tensors:
            raise InvalidConfig(f"model: tensor {name} is missing from {path}")
        used.add(name)
        return name

    def read(name: str, transpose: bool = False, raw: bool = False) -> np.ndarray:
        """The tensor's values, a view where it can be (of the mapped file, transposed): cast when copied."""
        w = tensors[name]
        if not isinstance(w, np.ndarray):  # (weights given in memory: JAX's arrays, or anything numpy reads)
            try:
                w = np.asarray(w)
            except (TypeError, ValueError, RuntimeError) as e:
                raise InvalidConfig(f"model: tensor {name} is not an array numpy reads ({e})") from None
        if raw:  # (packed values: as stored)
            return np.asarray(w)
        if name in float8:  # its values times their blocks' scales
            scale_name, (b0, b1) = float8[name]
            scale = np.asarray(tensors[scale_name], np.float32)
            w = np.asarray(w, np.float32) * np.repeat(np.repeat(scale, b0, 0), b1, 1)[:w.shape[0], :w.shape[1]]
        return np.swapaxes(w, -1, -2) if transpose else w

    weights = LazyWeights(config.weight_shapes(), "model (config.json)", read, need, lambda name: tensors[name].shape)
    one, stack = weights.one, weights.stack

    prefix = next((p for p in _PREFIXES if p + "embed_tokens.weight" in tensors), "model.")
    vision = [n for n in tensors if n.startswith(_VISION_PARTS)]
    if vision:  # (a multimodal checkpoint: jaxcb serves its language model, on text)
        log.info("%s: the language model only; the vision tower's %d tensors are not loaded", path, len(vision))
    layer = prefix + "layers.{i}."
    for i in range(config.num_layers):  # fused projections (Phi-3) split into the unfused ones' names
        for fused, parts in _FUSED.items():
            name = layer.format(i=i) + fused
            if name in tensors:
                rows = [config.weight_shapes()[p][-1] for p in parts]  # (each part's outputs)
                if tensors[name].shape[0] != sum(rows):
                    raise InvalidConfig(f"model: tensor {name} has {tensors[name].shape[0]} rows, not {sum(rows)}")
                for part, piece in zip(parts, np.split(np.asarray(tensors[name]), np.cumsum(rows)[:-1])):
                    tensors[layer.format(i=i) + _LAYER[part][0]] = piece  # (views of the mapped file)
                used.add(name)
    one("embed", prefix + "embed_tokens.weight")
    one("final_norm", prefix + "norm.weight")
    names = dict(_LAYER)
    # (the multi-token prediction layers a checkpoint keeps after its last layer: GLM-4.5's, DeepSeek-V3's
    # num_nextn_predict_layers; MiniMax-M2's num_mtp_modules, as vLLM drops them)
    mtp = int(settings.get("num_nextn_predict_layers") or settings.get("num_mtp_modules") or 0)
    if mtp:  # (GLM-4.5's multi-token prediction layers after the last one: jaxcb does not run them)
        log.info("%s: its %d multi-token prediction layers are not loaded", path, mtp)
        skipped = tuple(layer.format(i=config.num_layers + j) for j in range(mtp))
        used.update(n for n in tensors if n.startswith(skipped))
    if config.num_experts:  # the router [L, E, X] and each expert's matrices stacked [L, X, in, out]
        moe_layers = config.stacked_over("router")
        at = [layer.format(i=i) for i in moe_layers]  # (the layers with experts)
        first = at[0]
        llama4 = first + _LLAMA4["router"] in tensors
        ffn = "feed_forward" if llama4 else "mlp"  # (where a shared expert sits)
        shared_at = ("shared_experts" if first + "mlp.shared_experts.gate_proj.weight" in tensors  # (GLM's, DeepSeek's)
                     else "shared_expert")
        for key, shared in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            if config.mixed_mlp:  # (the dense layers' MLP)
                names["dense" + key[1:]] = (f"{ffn}.{shared}.weight", True)
            if config.shared_expert_size:  # (Qwen2-MoE's shared expert: the dense MLP's names, and its gate)
                names[key] = (f"{ffn}.{shared_at}.{shared}.weight", True)
            else:
                del names[key]
        if config.shared_expert_size and config.shared_expert_gated:
            names["shared_gate"] = ("mlp.shared_expert_gate.weight", True)
        if config.router_choice_bias:  # (GLM's and DeepSeek's under the router; MiniMax-M2's beside it)
            names["router_choice_bias"] = (("block_sparse_moe.e_score_correction_bias"
                                            if first + "block_sparse_moe.e_score_correction_bias" in tensors
                                            else "mlp.gate.e_score_correction_bias"), False)
        f = config.intermediate_size
        layout = next((a for a, moe in _MOE.items() if first + moe[0] in tensors), None)
        if first + _GPT_OSS["router"] in tensors:  # gpt-oss's (_GPT_OSS): float or MXFP4 matrices [X, in, out]
            layout = "gpt-oss"

            def matrix(a, name):  # (names: the MXFP4 blocks and scales, or the floats)
                return (a + name + "_blocks", a + name + "_scales") if a + name + "_blocks" in tensors else a + name

            for key, part, cut in (("experts_gate", "gate_up", slice(0, None, 2)), ("experts_up", "gate_up", slice(1, None, 2)),
                                   ("experts_down", "down", slice(None))):
                parts = [matrix(a, _GPT_OSS[part]) for a in at]
                if isinstance(parts[0], str):
                    stack(key, parts, each=lambda w, cut=cut: w[..., cut])
                else:  # MXFP4: decoded a layer at a time
                    for blocks, scales in parts:
                        need(blocks), need(scales)
                    weights.layered(key, [lambda b=b, s=s, cut=cut: _mxfp4(read(b, raw=True), read(s, raw=True))[..., cut]
                                          for b, s in parts])
                if part == "gate_up":
                    stack(key + "_bias", [a + _GPT_OSS["gate_up"] + "_bias" for a in at], each=lambda w, cut=cut: w[..., cut])
            stack("router", [a + _GPT_OSS["router"] for a in at], True)
            stack("router_bias", [a + _GPT_OSS["router_bias"] for a in at])
            stack("experts_down_bias", [a + _GPT_OSS["down"] + "_bias" for a in at])
        elif llama4:  # Llama 4's (_LLAMA4)
            layout = "llama4"
            stack("router", [a + _LLAMA4["router"] for a in at], True)
            stack("experts_gate", [a + _LLAMA4["gate_up"] for a in at], each=lambda w: w[..., :f])
            stack("experts_up", [a + _LLAMA4["gate_up"] for a in at], each=lambda w: w[..., f:])
            stack("experts_down", [a + _LLAMA4["down"] for a in at])
        elif layout is None:
            raise InvalidConfig(f"model: {path} has no router tensor (one of "
                                f"{', '.join(first + moe[0] for moe in _MOE.values())})")
        router, expert, parts = _MOE.get(layout, (None, None, ()))
        if router is not None:
            stack("router", [a + router for a in at], True)
        for key, part in zip(("experts_gate", "experts_up", "experts_down"), parts):
            if layout == "granitemoe":  # every expert's at once, [X, out, in]; gate and up halves of one
                rows = {"experts_gate": slice(0, f), "experts_up": slice(f, None)}.get(key, slice(None))
                stack(key, [a + expert + part + ".weight" for a in at],
                      each=lambda w, rows=rows: np.swapaxes(w[:, rows], -1, -2))
                continue
            stack(key, [[a + expert.format(j=j) + part + ".weight" for j in range(config.num_experts)] for a in at], True)
    if config.mla:  # latent attention: its matrices in place of q/k/v; kv_b split into the up-projections
        del names["wk"], names["wv"]
        if config.q_lora_rank:
            del names["wq"]
            names.update(wq_a=("self_attn.q_a_proj.weight", True), q_a_norm=("self_attn.q_a_layernorm.weight", False),
                         wq_b=("self_attn.q_b_proj.weight", True))
        names.update(wkv_a=("self_attn.kv_a_proj_with_mqa.weight", True),
                     kv_a_norm=("self_attn.kv_a_layernorm.weight", False))
        kv_b = [need(layer.format(i=i) + "self_attn.kv_b_proj.weight") for i in range(config.num_layers)]
        for key in ("w_uk", "w_uv"):  # (each from one read of kv_b_proj)
            weights.layered(key, [lambda n=n, key=key: _up_projections(config, [read(n)])[key][0] for n in kv_b])
    if config.attention_bias:
        names.update({k: (v, False) for k, v in _BIASES.items()})
    if config.out_bias:
        names["bo"] = ("self_attn.o_proj.bias", False)
    if config.attn_sinks:
        names["sinks"] = ("self_attn.sinks", False)
    if config.qk_norm:
        names.update({k: (v, False) for k, v in _QK_NORMS.items()})
    if config.post_norms:
        names.update({k: (v, False) for k, v in _GEMMA_NORMS.items()})
    if not config.pre_norms:  # (OLMo 2: its post_attention_layernorm is the attention output's, as Gemma's)
        del names["attn_norm"], names["mlp_norm"]
    for key, (name, transpose) in names.items():
        stack(key, [layer.format(i=i) + name for i in config.stacked_over(key)], transpose)
    reorder_pairs(weights, config)
    if config.mla and settings.get("rope_interleave", True):  # (DeepSeek's RoPE pairs interleaved: transformers' default)
        _latent_rope_halves(weights, config)
    head = "language_model.lm_head.weight" if "language_model.lm_head.weight" in tensors else "lm_head.weight"
    if not config.tie_embeddings:
        one("lm_head", head, transpose=True)
    classifier = set(CLASSIFIER_TENSORS) if config.headless else set()
    check_all_used(set(tensors) - used - {head} - set(vision) - classifier, path)  # (a tied head may be stored too)
    missing = sorted(set(config.weight_shapes()) - set(weights))
    if missing:  # (the config's weights this loader did not find a source for)
        raise InvalidConfig(f"model (config.json): no tensors for {', '.join(missing)}")
    return weights
