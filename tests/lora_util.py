"""PEFT-format LoRA adapters written by the tests, and the merged weights computed independently."""

import json
import os

import numpy as np

HF = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
      "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def write_adapter(path, config, rank=4, targets=tuple(HF), alpha=8.0, seed=0, scale=0.3, layers=None,
                  rank_pattern=None, alpha_pattern=None, extra_config=None):
    """A PEFT adapter directory for a model of `config` (a ModelConfig): random A and B (B nonzero, unlike
    a fresh PEFT init, so that it changes the outputs). Returns {(target, layer): (A [r, in], B [out, r],
    scale)} as PEFT holds them."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    shapes = config.weight_shapes()
    tensors, raw = {}, {}
    for t in targets:
        _, n_in, n_out = shapes[t]
        module = HF[t].split(".")[1]
        r = (rank_pattern or {}).get(module, rank)
        a_ = (alpha_pattern or {}).get(module, alpha)
        for i in range(config.num_layers) if layers is None else layers:
            a = (rng.standard_normal((r, n_in)) * scale / np.sqrt(n_in)).astype(np.float32)
            b = (rng.standard_normal((n_out, r)) * scale).astype(np.float32)
            prefix = f"base_model.model.model.layers.{i}.{HF[t]}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            raw[(t, i)] = (a, b, a_ / r)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none", "fan_in_fan_out": False,
           "target_modules": sorted({HF[t].split(".")[1] for t in targets}), "task_type": "CAUSAL_LM",
           "rank_pattern": rank_pattern or {}, "alpha_pattern": alpha_pattern or {}}
    cfg.update(extra_config or {})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return raw


def merged_weights(weights, raw):
    """The base weights (loader layout, [in, out] per layer) with each W += scale * A.T @ B.T."""
    out = {k: np.array(v, np.float32, copy=True) for k, v in weights.items()}
    for (t, i), (a, b, s) in raw.items():
        out[t][i] += s * (a.T @ b.T)
    return out
