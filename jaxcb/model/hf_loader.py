"""Hugging Face checkpoint directories: config.json, *.safetensors and tokenizer.json.

Llama-family architectures that differ from Llama only in small ways load into the same model:
Llama and Mistral as they are, Qwen2 with its q/k/v biases; a separate output head when the
embeddings are not tied. Weights are read with `safetensors` (no framework) and transposed from
torch's [out, in] to this project's [in, out].
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from jaxcb.model.config import ModelConfig

ARCHITECTURES = {"LlamaForCausalLM": False, "MistralForCausalLM": False, "Qwen2ForCausalLM": True}  # -> biases

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
_BIASES = {"bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias"}


def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def read_config(path: str) -> ModelConfig:
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model: {path}/config.json is not readable JSON ({e})") from None
    arch = (raw.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"config.json: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    scaling = raw.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"config.json: rope_scaling {scaling!r} is not supported (plain RoPE only)")
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        return ModelConfig(
            vocab_size=int(raw["vocab_size"]), hidden_size=hidden, intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_context=int(raw.get("max_position_embeddings", 2048)),
            rope_theta=float(raw.get("rope_theta", 10000.0)), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            name=os.path.basename(os.path.normpath(path)),
            attention_bias=ARCHITECTURES[arch] or bool(raw.get("attention_bias", False)),
        )
    except KeyError as e:
        raise ValueError(f"config.json: {e.args[0]} is missing") from None


def load_weights(path: str, config: ModelConfig) -> dict[str, np.ndarray]:
    """The weights in the loader layout of jaxcb.model.llama (float32)."""
    from safetensors.numpy import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model: {path} has no *.safetensors files")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            tensors.update(load_file(f))
        except Exception as e:  # noqa: BLE001 - the library raises its own error types
            raise ValueError(f"model: {f} is not a readable safetensors file ({e})") from None

    def get(name: str, transpose: bool = False) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"model: tensor {name} is missing from {path}")
        w = np.asarray(tensors[name], dtype=np.float32)
        return np.ascontiguousarray(w.T) if transpose else w

    layer = "model.layers.{i}."
    weights = {"embed": get("model.embed_tokens.weight"), "final_norm": get("model.norm.weight")}
    names = dict(_LAYER)
    if config.attention_bias:
        names.update({k: (v, False) for k, v in _BIASES.items()})
    for key, (name, transpose) in names.items():
        weights[key] = np.stack([get(layer.format(i=i) + name, transpose) for i in range(config.num_layers)])
    if not config.tie_embeddings:
        weights["lm_head"] = get("lm_head.weight", transpose=True)
    expected = {"embed": (config.vocab_size, config.hidden_size),
                "wq": (config.num_layers, config.hidden_size, config.num_heads * config.head_dim),
                "wk": (config.num_layers, config.hidden_size, config.num_kv_heads * config.head_dim),
                "w_down": (config.num_layers, config.intermediate_size, config.hidden_size)}
    for key, shape in expected.items():
        if weights[key].shape != shape:
            raise ValueError(f"model: tensor {key} has shape {weights[key].shape}, expected {shape} from config.json")
    return weights
