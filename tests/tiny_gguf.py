"""Build tiny Llama GGUF files for tests: random weights, a small byte-level BPE vocabulary, a chat
template. Written the way llama.cpp's converter writes them (Q/K rows permuted for its rotary layout,
weights as [out, in]), so the loader's whole path is exercised."""

from __future__ import annotations

import gguf
import numpy as np

from jaxcb.model.config import ModelConfig, tiny_config
from jaxcb.model.llama import random_weights

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t", "e n", "o r",
          "Ġ w", "Ġ o", "i s", "Ġ c", "Ġ b", "Ġ f", "e s", "a n", "l l", "Ġ h", "e d", "i t", "a r")


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    tokens = list(SPECIALS) + _byte_chars()
    for m in MERGES:
        tokens.append(m.replace(" ", ""))
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, list(MERGES), types


def tiny_model_config(**overrides) -> ModelConfig:
    tokens, _, _ = tiny_vocab()
    return tiny_config(vocab_size=len(tokens), **overrides)


def permute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of a [out, in] Q or K weight."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: str, config: ModelConfig | None = None, seed: int = 0, *, arch: str = "llama",
                    quant: str = "f32", broken_type: bool = False, rope_freqs=None,
                    rope_scaling: tuple[str, float] | None = None, extra_uint32: dict | None = None,
                    extra_float32: dict | None = None,
                    extra_tensors: dict | None = None, weights: dict | None = None,
                    block_count: int | None = None, latent_split: bool = True,
                    split_max_tensors: int = 0, add_bos: bool = False) -> dict[str, np.ndarray]:
    """Write a GGUF file; returns the weights in the project's layout (what loading must give back,
    exactly for f32, up to quantization error otherwise). `rope_freqs`: llama.cpp's per-frequency RoPE
    factors tensor (Llama 3.1+); `rope_scaling`: (rope.scaling.type, rope.scaling.factor); `weights`: these
    (the loaders' layout) instead of random ones; `block_count`: the file's, where it counts more blocks than the
    model's layers (GLM's multi-token prediction one). Arch "phi3" fuses Q/K/V and gate/up as its converter does;
    latent attention's kv_b goes as attn_k_b and attn_v_b, or not at all (`latent_split` False: an older file's
    attn_kv_b, given in `extra_tensors`). `split_max_tensors`: shards of that many tensors as llama.cpp's gguf-split
    writes them (the gguf library's writer: PATH's stem-00001-of-0000N.gguf beside it)."""
    config = config or tiny_model_config()
    w = weights if weights is not None else random_weights(config, seed)
    tokens, merges, types = tiny_vocab()
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    writer.add_name("tiny-random")
    writer.add_block_count(block_count or config.num_layers)
    writer.add_context_length(config.max_context)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.dense_size if config.mixed_mlp else config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    if config.rotary_dim:
        writer.add_rope_dimension_count(config.rotary_dim)
    if config.num_experts:  # (Mixtral: arch llama; Qwen3-MoE's own keys name the experts' width too)
        writer.add_uint32(f"{arch}.expert_count", config.num_experts)
        writer.add_uint32(f"{arch}.expert_used_count", config.experts_per_token)
        if arch in ("qwen3moe", "qwen2moe", "gpt-oss", "llama4", "glm4moe", "deepseek2", "minimax-m2"):
            writer.add_uint32(f"{arch}.expert_feed_forward_length", config.intermediate_size)
        first = config.moe_layers.index(True) if config.mixed_mlp else 0  # (the first layer with experts)
        if arch == "llama4":  # (Maverick's: every second layer)
            writer.add_uint32(f"{arch}.interleave_moe_layer_step", first + 1)
        elif arch in ("glm4moe", "deepseek2"):  # the first layers dense; DeepSeek-V3's router (V2's: softmax); shared
            writer.add_uint32(f"{arch}.leading_dense_block_count", first)  # experts as wide as one each
            writer.add_uint32(f"{arch}.expert_shared_count", config.shared_expert_size // config.intermediate_size)
            if config.router_sigmoid or arch != "deepseek2":  # (DeepSeek-V2's softmax: left out, as its older files
                writer.add_uint32(f"{arch}.expert_gating_func", 2 if config.router_sigmoid else 1)  # have it)
            writer.add_float32(f"{arch}.expert_weights_scale", config.routed_scale)
            writer.add_bool(f"{arch}.expert_weights_norm", config.norm_topk)
            if config.expert_groups > 1:
                writer.add_uint32(f"{arch}.expert_group_count", config.expert_groups)
                writer.add_uint32(f"{arch}.expert_group_used_count", config.expert_groups_used)
        elif arch == "minimax-m2":  # (its converter names the sigmoid gating; llama.cpp renormalizes for it)
            writer.add_uint32(f"{arch}.expert_gating_func", 2)
        elif config.shared_expert_size:
            writer.add_uint32(f"{arch}.expert_shared_feed_forward_length", config.shared_expert_size)
    if config.mla:  # latent attention as llama.cpp's converter writes it (one KV head of rope + latent)
        writer.add_uint32(f"{arch}.attention.key_length", config.head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", config.kv_lora_rank)
        writer.add_uint32(f"{arch}.attention.key_length_mla", config.qk_nope_dim + config.rotary_dim)
        writer.add_uint32(f"{arch}.attention.value_length_mla", config.v_head_dim)
        writer.add_uint32(f"{arch}.attention.kv_lora_rank", config.kv_lora_rank)
        if config.q_lora_rank:
            writer.add_uint32(f"{arch}.attention.q_lora_rank", config.q_lora_rank)
    for key, value in (extra_uint32 or {}).items():  # more metadata (what the loader must refuse)
        writer.add_uint32(key, value)
    for key, value in (extra_float32 or {}).items():
        writer.add_float32(key, value)
    if rope_scaling is not None:
        writer.add_string(f"{arch}.rope.scaling.type", rope_scaling[0])
        writer.add_float32(f"{arch}.rope.scaling.factor", rope_scaling[1])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHATML)

    def put(name: str, array: np.ndarray, linear: bool):
        array = np.ascontiguousarray(array, dtype=np.float32)
        if config.norm_plus_one and name.endswith("norm.weight"):  # (Gemma's: llama.cpp's converter stores 1 + w)
            array = array + 1.0
        if broken_type and name == "blk.0.attn_v.weight":
            qtype = gguf.GGMLQuantizationType.Q8_1  # the gguf library cannot dequantize this one
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            writer.add_tensor(name, np.zeros((array.shape[0], array.shape[1] // block * size), np.uint8),
                              raw_dtype=qtype)
            return
        if linear and quant == "q8_0":
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        elif linear and quant == "f16":
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, array)

    put("token_embd.weight", w["embed"], True)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, np.asarray(array, np.float32))
    put("output_norm.weight", w["final_norm"], False)
    if not config.tie_embeddings:
        put("output.weight", w["lm_head"].T, True)
    names = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
             "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
    if config.attention_bias:  # Qwen2's q/k/v biases
        names.update(bq="attn_q.bias", bk="attn_k.bias", bv="attn_v.bias")
    if config.out_bias:
        names.update(bo="attn_output.bias")
    if config.qk_norm:
        names.update(q_norm="attn_q_norm", k_norm="attn_k_norm")
    if not config.pre_norms:  # OLMo 2: norms after attention and the MLP only
        del names["attn_norm"], names["mlp_norm"]
        names.update(post_attn_norm="post_attention_norm", post_mlp_norm="post_ffw_norm")
    if config.num_experts:  # the router and each layer's experts in one tensor each, [X, out, in]
        for key in ("w_gate", "w_up", "w_down"):
            del names[key]
        names.update(router="ffn_gate_inp", experts_gate="ffn_gate_exps", experts_up="ffn_up_exps",
                     experts_down="ffn_down_exps")
        if config.mixed_mlp:  # the dense layers' MLP, the dense names
            names.update(dense_gate="ffn_gate", dense_up="ffn_up", dense_down="ffn_down")
        if config.router_choice_bias:
            names.update(router_choice_bias="exp_probs_b.bias")
        if config.shared_expert_size:  # Qwen2-MoE's shared expert and its gate ([1, E], as its converter writes it)
            names.update(w_gate="ffn_gate_shexp", w_up="ffn_up_shexp", w_down="ffn_down_shexp")
            if config.shared_expert_gated:
                names.update(shared_gate="ffn_gate_inp_shexp")
    if arch == "gpt-oss":  # its MLP's norm named by place, sinks, the router's and experts' biases
        names.update(mlp_norm="post_attention_norm", sinks="attn_sinks", router_bias="ffn_gate_inp.bias",
                     experts_gate_bias="ffn_gate_exps.bias", experts_up_bias="ffn_up_exps.bias",
                     experts_down_bias="ffn_down_exps.bias")
    if config.mla:  # its matrices for q/k/v; kv_b as attn_k_b [H, C, N] and attn_v_b [H, V, C] (transposed below)
        del names["wk"], names["wv"]
        if config.q_lora_rank:
            del names["wq"]
            names.update(wq_a="attn_q_a", q_a_norm="attn_q_a_norm", wq_b="attn_q_b")
        names.update(wkv_a="attn_kv_a_mqa", kv_a_norm="attn_kv_a_norm")
        if latent_split:
            names.update(w_uk="attn_k_b", w_uv="attn_v_b")
    if arch == "phi3":  # fused: attn_qkv = [q; k; v] rows, ffn_up = [gate; up] rows
        for i in range(config.num_layers):
            put(f"blk.{i}.attn_qkv.weight", np.concatenate([w["wq"][i].T, w["wk"][i].T, w["wv"][i].T]), True)
            put(f"blk.{i}.ffn_up.weight", np.concatenate([w["w_gate"][i].T, w["w_up"][i].T]), True)
        names = {k: v for k, v in names.items() if k not in ("wq", "wk", "wv", "w_gate", "w_up")}
    stacked = {key: config.stacked_over(key) for key in names}  # (with dense layers among the experts': each kind's)
    for i in range(config.num_layers):
        for key, gname in names.items():
            if i not in stacked[key]:
                continue
            a = w[key][stacked[key].index(i)]
            r = config.rotary_dim
            if config.mla and key in ("wq", "wq_b", "wkv_a"):  # the rotated parts back to interleaved pairs, as stored
                back = np.argsort(np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)]))
                a = a.reshape(a.shape[0], -1, a.shape[-1] // (config.num_heads if key != "wkv_a" else 1)).copy()
                a[..., -r:] = a[..., -r:][..., back]
                a = a.reshape(a.shape[0], -1)
            linear = a.ndim >= 2 and not gname.endswith(".bias")
            if linear:
                a = np.swapaxes(a, -1, -2)  # to [out, in] (each expert's)
            permuted = arch in ("llama", "smollm3", "granite", "granitemoe")  # llama.cpp permutes Q and K for these only
            if permuted and key in ("wq", "bq"):
                a = permute_rotary(a, config.num_heads)
            elif permuted and key in ("wk", "bk"):
                a = permute_rotary(a, config.num_kv_heads)
            elif arch == "llama4" and key in ("wq", "wk"):  # (the checkpoint's complex-pair order: [out, in] rows)
                d = config.head_dim
                back = np.argsort(np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)]))
                a = a.reshape(-1, d, a.shape[-1])[:, back].reshape(a.shape)
            put(f"blk.{i}.{gname}" + ("" if gname.endswith(".bias") else ".weight"), a, linear)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return w
