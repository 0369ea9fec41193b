"""Write tiny random-weight Hugging Face checkpoints of Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE (and with dense layers among
its experts'), Granite MoE, OLMoE, OLMo 2, Llama 4 (Scout's and Maverick's kinds), GLM-4.5, DeepSeek-V2 and V3, MiniMax-M2,
SmolLM3 (no RoPE in every other layer
here), Granite (its four scalars), Phi-3 (fused projections; and Phi-4-mini's partial rotary and LongRoPE),
Gemma 2 and Gemma 3 with transformers' own modules, and their golden outputs, for
tests/test_families.py; and of Llama with Llama 3's RoPE
scaling, Qwen3 and Llama with YaRN and Gemma 3 with linear scaling of its global layers (RoPE scaled from 32 positions, so that
the prompts run far past it); and Gemma 3 as its multimodal checkpoints come (Gemma3ForConditionalGeneration:
the language model beside a vision tower), run on text.

Run with the `tools` environment (see tools/make_golden.py):
    .venv-tools/bin/python -m tools.make_tiny_hf [NAME ...]      # default: every one

For each family: tests/golden/tiny_hf/<family>/ holds config.json and model.safetensors as
`save_pretrained` writes them, and golden.json: per prompt (token ids), the float32 logits of the
last prompt position and greedy ids for 16 tokens from a plain loop over the model's forward pass
with its KV cache (eager attention, so the sliding window is the reference's own mask). The sliding
window is 8 tokens so that the prompts (up to 40 tokens) and their decode run well past it.

    .venv-tools/bin/python -m tools.make_tiny_hf --long phi3-longrope

adds golden_long.json to a family already written (its saved checkpoint, weights unchanged): the same records
for prompts past its original context (LONG_PROMPTS: LongRoPE's long factors, which transformers takes for a
sequence longer than original_max_position_embeddings).

    .venv-tools/bin/python -m tools.make_tiny_hf --hidden qwen3 gemma3

adds golden_hidden.json to families already written: per prompt (PROMPTS), the base model's last hidden states
(transformers' last_hidden_state, after the final norm: what embeddings pool, tests/test_embeddings.py).

    .venv-tools/bin/python -m tools.make_tiny_hf --classify

writes the sequence classification checkpoints (CLASSIFIERS) and their heads' logits (tests/test_classify.py).
"""

from __future__ import annotations

import json
import os

import numpy as np

OUT = "tests/golden/tiny_hf"
PROMPTS = [[2, 17, 99, 4, 31], [2] + [(7 * i + 3) % 250 + 3 for i in range(22)], [2] + [(11 * i + 5) % 250 + 3 for i in range(39)]]
LONG_PROMPTS = [[2] + [(17 * i + 11) % 250 + 3 for i in range(89)], [2] + [(5 * i + 1) % 250 + 3 for i in range(150)]]
STEPS = 16
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)


# DeepSeek's latent attention: every head its own keys and values (expanded from the latent), no head_dim of its own
MLA_COMMON = {**{k: v for k, v in COMMON.items() if k != "head_dim"}, "num_key_value_heads": 4}


def configs():
    from transformers import (CLIPVisionConfig, DeepseekV2Config, DeepseekV3Config, MiniMaxM2Config, Gemma2Config, Glm4MoeConfig, GptOssConfig, Llama4TextConfig, GemmaConfig, Gemma3Config, Gemma3TextConfig, GraniteConfig,
                              GraniteMoeConfig, LlamaConfig, LlavaConfig, Mistral3Config, MistralConfig,
                              MixtralConfig, Olmo2Config, OlmoeConfig, PixtralVisionConfig, Qwen2_5_VLConfig,
                              Qwen3VLConfig, Phi3Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig,
                              SiglipVisionConfig, SmolLM3Config)

    types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    return {
        "qwen3": Qwen3Config(**COMMON, tie_word_embeddings=False, rope_theta=10000.0),
        # mixtures of experts: Mixtral's (4 experts, 2 a token, their weights renormalized) and Qwen3-MoE's
        # (8 narrower experts, 2 a token, not renormalized: norm_topk_prob false, as OLMoE's)
        "mixtral": MixtralConfig(**COMMON, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2),
        "qwen3moe": Qwen3MoeConfig(**COMMON, tie_word_embeddings=False, moe_intermediate_size=32, num_experts=8,
                                   num_experts_per_tok=2, norm_topk_prob=False),
        # Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): beside 8 experts a shared one every token runs, weighed by a
        # sigmoid gate of its own; q/k/v biases
        "qwen2moe": Qwen2MoeConfig(**{k: v for k, v in COMMON.items() if k not in ("head_dim", "num_key_value_heads")},
                                        tie_word_embeddings=False,
                                   moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
                                   num_experts_per_tok=2, norm_topk_prob=False),
        # OLMo 2 (AllenAI's): norms after attention and after the MLP only, q and k normed over all their heads
        "olmo2": Olmo2Config(**{k: v for k, v in COMMON.items() if k not in ("head_dim", "num_key_value_heads")},
                                        tie_word_embeddings=False,
                             bos_token_id=1, eos_token_id=2, pad_token_id=None),
        # OLMoE (AllenAI's 1B-7B): Llama's norms, q and k normed whole (k over its 2 kv heads), 8 experts, 2 a token,
        # not renormalized
        "olmoe": OlmoeConfig(**{**{k: v for k, v in COMMON.items() if k != "head_dim"}, "intermediate_size": 32},
                             tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                             bos_token_id=1, eos_token_id=2, pad_token_id=None),
        # Granite MoE (IBM's 1B/3B): Granite's scalars, and each expert's gate and up projections in one tensor
        "granitemoe": GraniteMoeConfig(**{**COMMON, "intermediate_size": 32}, tie_word_embeddings=True,
                                       num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=6.0,
                                       residual_multiplier=0.3, attention_multiplier=0.1, logits_scaling=4.0,
                                       pad_token_id=None),
        # gpt-oss: attention sinks, biases on every projection and the router, 4 experts (2 a token) of a clamped
        # SwiGLU (a limit of 1, so that the clamps bite on these weights), sliding layers alternating with full
        # ones, YaRN on every layer (from 32 positions, untruncated: as released)
        "gpt-oss": GptOssConfig(**{**COMMON, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                                swiglu_limit=1.0, pad_token_id=None, bos_token_id=1, eos_token_id=2,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 32}),
        # Llama 4 (text): every layer 4 experts (1 a token: its sigmoid score scales the expert's input) beside a
        # shared expert; RoPE as complex pairs (interleaved) with Llama 3's scaling, every other layer without
        # it (NoPE), where queries are scaled by position (temperature tuning: floor_scale 4 so it bites at
        # these lengths), and the RoPE layers' q and k RMS-normed without weights; chunked attention past 256
        "llama4": Llama4TextConfig(**{**COMMON, "intermediate_size": 32}, intermediate_size_mlp=128, num_local_experts=4,
                                   num_experts_per_tok=1, no_rope_layer_interval=2, floor_scale=4, attn_scale=0.1,
                                   attention_chunk_size=256, tie_word_embeddings=False, pad_token_id=None,
                                   bos_token_id=1, eos_token_id=2, rope_parameters={
                                       "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 32}),
        # Llama 4 whose RoPE layers attend within chunks of 16 positions: the prompts and their decode cross several
        "llama4-chunked": Llama4TextConfig(**{**COMMON, "intermediate_size": 32}, intermediate_size_mlp=128,
                                           num_local_experts=4, num_experts_per_tok=1, no_rope_layer_interval=2,
                                           floor_scale=4, attn_scale=0.1, attention_chunk_size=16,
                                           tie_word_embeddings=False, pad_token_id=None, bos_token_id=1,
                                           eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        # Llama 4 Maverick's kind: dense MLPs (intermediate_size_mlp wide) in the layers between the experts' ones
        "llama4-maverick": Llama4TextConfig(**{**COMMON, "intermediate_size": 32}, intermediate_size_mlp=96,
                                            num_local_experts=4, num_experts_per_tok=1, no_rope_layer_interval=2,
                                            floor_scale=4, attn_scale=0.1, attention_chunk_size=16,
                                            interleave_moe_layer_step=2, tie_word_embeddings=False, pad_token_id=None,
                                            bos_token_id=1, eos_token_id=2,
                                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        # Qwen3-MoE with dense layers among the experts' (decoder_sparse_step 2: experts in every second layer;
        # mlp_only_layers takes layer 3's away too)
        "qwen3moe-dense": Qwen3MoeConfig(**COMMON, tie_word_embeddings=False, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2,
                                         mlp_only_layers=[3]),
        # GLM-4.5's kind (Glm4MoeForCausalLM): q/k/v biases, per-head q/k norms, half of each head rotated; the first
        # layer a dense MLP, the others 8 experts (2 a token) chosen by sigmoid scores plus a correction bias within
        # the best of 2 groups, weighed by their renormalized scores times 2.5, beside an always-on shared expert
        "glm4moe": Glm4MoeConfig(**COMMON, tie_word_embeddings=False, moe_intermediate_size=32, n_routed_experts=8,
                                 num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                                 first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                 attention_bias=True, use_qk_norm=True, pad_token_id=None, bos_token_id=1,
                                 eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                  "partial_rotary_factor": 0.5}),
        # DeepSeek-V3's kind: multi-head latent attention (queries through a rank-48 pair, keys and values from a
        # rank-32 latent beside an 8-wide rotated part, interleaved pairs), YaRN with DeepSeek's mscales (the
        # softmax scaled too); the first layer dense, then GLM-4.5's kind of experts
        "deepseek-v3": DeepseekV3Config(**MLA_COMMON,
                                        tie_word_embeddings=False, moe_intermediate_size=32, n_routed_experts=8,
                                        num_experts_per_tok=2,
                                        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                                        routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=48,
                                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, pad_token_id=None,
                                        bos_token_id=1, eos_token_id=2, rope_parameters={
                                            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 64, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}),
        # ... its queries through one matrix (q_lora_rank none: DeepSeek-V2-Lite's, Moonlight's), plain RoPE
        "deepseek-v3-q": DeepseekV3Config(**MLA_COMMON,
                                          tie_word_embeddings=False, moe_intermediate_size=32, n_routed_experts=8,
                                          num_experts_per_tok=2, n_shared_experts=2, n_group=1, topk_group=1,
                                          first_k_dense_replace=2, routed_scaling_factor=1.5, norm_topk_prob=False,
                                          kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                          v_head_dim=12, pad_token_id=None, bos_token_id=1, eos_token_id=2,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        # DeepSeek-V2's kind: latent attention with queries through one matrix (V2-Lite's), YaRN with V2's mscales;
        # a softmax router choosing within the 2 best of 4 groups (a group worth its best), weights times 2 unrenormalized
        "deepseek-v2": DeepseekV2Config(**MLA_COMMON,
                                        tie_word_embeddings=False, moe_intermediate_size=32,
                                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
                                        topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                        first_k_dense_replace=1, routed_scaling_factor=2.0, norm_topk_prob=False,
                                        kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                        v_head_dim=16, pad_token_id=None, bos_token_id=1, eos_token_id=2,
                                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                         "original_max_position_embeddings": 64, "mscale": 0.707,
                                                         "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0}),
        # MiniMax-M2's kind: q and k normed over all their heads, half of each head rotated (its config's rotary_dim, as
        # released), every layer 8 experts (2 a token) chosen by sigmoid score plus a correction bias, renormalized
        "minimax-m2": MiniMaxM2Config(**{**COMMON, "intermediate_size": 32}, tie_word_embeddings=False,
                                      num_local_experts=8, num_experts_per_tok=2, rotary_dim=8, pad_token_id=None,
                                      bos_token_id=1, eos_token_id=2),
        # Llama with attention_bias (as transformers builds it: q, k, v and the output projection biased)
        "llama-bias": LlamaConfig(**COMMON, tie_word_embeddings=False, attention_bias=True),
        "smollm3": SmolLM3Config(**COMMON, tie_word_embeddings=True, no_rope_layer_interval=2, pad_token_id=None,
                                 bos_token_id=1, eos_token_id=2),
        "phi3": Phi3Config(**COMMON, tie_word_embeddings=False, pad_token_id=None, bos_token_id=1, eos_token_id=2),
        # Phi-4-mini's kind: 3/4 of each head rotated, LongRoPE (its short factors up to the original 64 positions)
        "phi3-longrope": Phi3Config(**{**COMMON, "max_position_embeddings": 256}, tie_word_embeddings=False,
                                    pad_token_id=None, bos_token_id=1, eos_token_id=2,
                                    original_max_position_embeddings=64, rope_parameters={
                                        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                        "short_factor": [1.0, 1.3, 1.9, 2.6, 3.4, 4.0],
                                        "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
                                        "original_max_position_embeddings": 64}),
        "granite": GraniteConfig(**COMMON, tie_word_embeddings=True, embedding_multiplier=6.0, residual_multiplier=0.3,
                                 attention_multiplier=0.1, logits_scaling=4.0, pad_token_id=None),
        # Gemma 1 (and CodeGemma): Gemma's (1 + w) norms, GeGLU, scaled embeddings; hidden_act "gelu" as its released
        # configs say it (transformers runs the tanh approximation)
        "gemma": GemmaConfig(**COMMON, hidden_act="gelu"),
        "gemma2": Gemma2Config(**COMMON, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                               final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh",
                               layer_types=["sliding_attention", "full_attention"] * 2),
        "gemma3": Gemma3TextConfig(**COMMON, sliding_window=8, query_pre_attn_scalar=16, layer_types=types,
                                   hidden_activation="gelu_pytorch_tanh",
                                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        "llama3-rope": LlamaConfig(**COMMON, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        # YaRN from 32 positions (Qwen2.5/Qwen3 past 32K): transformers' defaults; and its knobs (as gpt-oss and
        # DeepSeek set them: no truncation of the ramp, other betas, an attention factor from two mscales)
        "qwen3-yarn": Qwen3Config(**COMMON, tie_word_embeddings=False, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}),
        "llama-yarn": LlamaConfig(**COMMON, tie_word_embeddings=False, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
            "truncate": False, "beta_fast": 4.0, "beta_slow": 0.25, "mscale": 1.0, "mscale_all_dim": 0.5}),
        "gemma3-linear": Gemma3TextConfig(**COMMON, sliding_window=8, query_pre_attn_scalar=16, layer_types=types,
                                          hidden_activation="gelu_pytorch_tanh", rope_parameters={
                                              "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        # Gemma 3 4B+ as released: the language model beside a (here tiny) vision tower and projector.
        "gemma3-mm": Gemma3Config(
            text_config=Gemma3TextConfig(**COMMON, sliding_window=8, query_pre_attn_scalar=16, layer_types=types,
                                         hidden_activation="gelu_pytorch_tanh").to_dict(),
            vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14).to_dict(),
            mm_tokens_per_image=4, boi_token_index=253, eoi_token_index=254, image_token_index=255),
        # Vision-language checkpoints, run on text (their language models' tensors beside tiny vision towers, in
        # the layouts the Hub's come in): Mistral Small 3.1+ (Mistral3: a Mistral beside Pixtral), Llava (a Llama),
        # Qwen2.5-VL (a Qwen2; M-RoPE sections, which on text all take the same position) and Qwen3-VL (a Qwen3)
        "mistral3-mm": Mistral3Config(
            text_config=MistralConfig(**COMMON).to_dict(), image_token_index=255, spatial_merge_size=2,
            vision_config=PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, image_size=28, patch_size=14, head_dim=16).to_dict()),
        "llava": LlavaConfig(
            text_config=LlamaConfig(**COMMON).to_dict(), image_token_index=255,
            vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                           image_size=28, patch_size=14, projection_dim=32).to_dict()),
        "qwen2.5-vl": Qwen2_5_VLConfig(
            text_config={**{k: v for k, v in COMMON.items() if k != "head_dim"}, "bos_token_id": 1, "eos_token_id": 2,
                         "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
            vision_config={"depth": 1, "hidden_size": 32, "out_hidden_size": 64, "num_heads": 2, "intermediate_size": 64,
                           "fullatt_block_indexes": [0]},
            image_token_id=255, video_token_id=254, vision_start_token_id=253, vision_end_token_id=252),
        "qwen3-vl": Qwen3VLConfig(
            text_config={**COMMON, "bos_token_id": 1, "eos_token_id": 2,
                         "rope_scaling": {"rope_type": "default", "mrope_section": [3, 3, 2], "mrope_interleaved": True}},
            vision_config={"depth": 1, "hidden_size": 32, "out_hidden_size": 64, "num_heads": 2, "intermediate_size": 64,
                           "deepstack_visual_indexes": [0]},
            image_token_id=255, video_token_id=254, vision_start_token_id=253, vision_end_token_id=252),
    }


def records_of(model, prompts) -> list[dict]:
    """Per prompt: its ids, the last prompt position's float32 logits, greedy ids for STEPS tokens from a plain
    loop over the forward pass with its KV cache, and each step's top-2 margin."""
    import torch

    records = []
    for ids in prompts:
        out = model(torch.tensor([ids]), use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
        prefill = logits.numpy().astype(np.float32).tolist()
        greedy, margins = [], []
        for _ in range(STEPS):
            top2 = torch.topk(logits, 2).values
            margins.append(float(top2[0] - top2[1]))
            greedy.append(int(torch.argmax(logits)))
            out = model(torch.tensor([[greedy[-1]]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
        records.append({"prompt_ids": ids, "prefill_logits": prefill, "greedy_ids": greedy, "margins": margins})
    return records


# Sequence classification checkpoints (transformers' *ForSequenceClassification: the base model under "model.", a
# `score` head [labels, hidden] on the final norm's output at the last token): name -> (the family's config,
# labels; one label is a cross-encoder's relevance score)
CLASSIFIERS = {"qwen3-cls": ("qwen3", ["negative", "neutral", "positive"]), "gemma3-cls": ("gemma3", ["relevant"])}


def write_classifiers(family_configs: dict) -> None:
    """tests/golden/tiny_hf/<name>/ per CLASSIFIERS: the checkpoint and golden_classify.json, per prompt (PROMPTS)
    the head's float32 logits as transformers' model gives them."""
    import torch
    from transformers import AutoModelForSequenceClassification

    for name, (family, labels) in CLASSIFIERS.items():
        config = family_configs[family]
        config.num_labels = len(labels)
        config.id2label = dict(enumerate(labels))
        config.label2id = {v: k for k, v in config.id2label.items()}
        config._attn_implementation = "eager"
        torch.manual_seed(1)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.add_(torch.randn_like(p) * 0.3)
                elif p.dim() == 2:
                    p.mul_(4.0 if "embed" in n or "score" in n else 2.0)
        folder = os.path.join(OUT, name)
        model.save_pretrained(folder, safe_serialization=True)
        records = [{"prompt_ids": ids, "logits": model(torch.tensor([ids])).logits[0].tolist()} for ids in PROMPTS]
        with open(os.path.join(folder, "golden_classify.json"), "w") as f:
            json.dump({"family": family, "labels": labels, "records": records}, f)
        print(name, type(model).__name__, [[round(x, 3) for x in r["logits"]] for r in records])


def main():
    import sys

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.set_grad_enabled(False)
    wanted = sys.argv[1:]
    if wanted[:1] == ["--long"]:
        for family in wanted[1:]:
            folder = os.path.join(OUT, family)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
            records = records_of(model, LONG_PROMPTS)
            with open(os.path.join(folder, "golden_long.json"), "w") as f:
                json.dump({"family": family, "steps": STEPS, "records": records}, f)
            print(family, "long", [r["greedy_ids"][:6] for r in records], "min margin",
                  min(min(r["margins"]) for r in records))
        return
    if wanted[:1] == ["--hidden"]:
        for family in wanted[1:]:
            folder = os.path.join(OUT, family)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
            records = [{"prompt_ids": ids, "hidden": model.model(torch.tensor([ids])).last_hidden_state[0].tolist()}
                       for ids in PROMPTS]
            with open(os.path.join(folder, "golden_hidden.json"), "w") as f:
                json.dump({"family": family, "records": records}, f)
            print(family, "hidden", [len(r["hidden"]) for r in records])
        return
    if wanted[:1] == ["--classify"]:
        write_classifiers(configs())
        return
    for family, config in configs().items():
        if wanted and family not in wanted:
            continue
        torch.manual_seed(0)
        config._attn_implementation = "eager"
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        except ValueError:  # (a vision-language model that is not a causal LM class: Mistral3, Llava, Qwen-VL)
            model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():  # norms away from their init, so a (1 + w) vs w mix-up shows
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.3)
                elif p.dim() == 2:
                    p.mul_(4.0 if "embed" in name else 2.0)
                if family.startswith("llama4") and "experts" in name:  # (small at the start: made to matter)
                    p.mul_(8.0)
                if family in ("llama-bias", "glm4moe") and "bias" in name:  # (zero at the start)
                    p.copy_(torch.randn_like(p) * 0.5)
                if family == "gpt-oss":  # (its biases start at zero, its sinks and experts small: all made to matter)
                    if "bias" in name or "sinks" in name:
                        p.copy_(torch.randn_like(p) * (1.0 if "sinks" in name else 0.1))
                    elif "experts" in name:
                        p.mul_(2.0)
            for name, b in model.named_buffers():  # (GLM's correction biases: a buffer, zero at the start)
                if "e_score_correction_bias" in name:  # (DeepSeek's too)
                    b.copy_(torch.rand_like(b) * 0.5)
        folder = os.path.join(OUT, family)
        model.save_pretrained(folder, safe_serialization=True)
        records = records_of(model, PROMPTS)
        with open(os.path.join(folder, "golden.json"), "w") as f:
            json.dump({"family": family, "steps": STEPS, "records": records}, f)
        print(family, [r["greedy_ids"][:6] for r in records], "min margin", min(min(r["margins"]) for r in records))


if __name__ == "__main__":
    main()
