"""Converted checkpoints: the dequantized weights saved with orbax, next to the config and tokenizer.

    OUT_DIR/jaxcb_model.json     format, ModelConfig, dtype
    OUT_DIR/params/              orbax checkpoint of the weights (the Params pytree's arrays)
    OUT_DIR/tokenizer.json, tokenizer_config.json

Loading restores the arrays straight into their dtype on the device: no file parsing, no
dequantization, which is what makes it several times faster than reading the GGUF.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.model.config import ModelConfig

FORMAT = "jaxcb-orbax-1"
MANIFEST = "jaxcb_model.json"


def is_checkpoint_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def _expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    e, f, l, q, kv = c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"embed": (c.vocab_size, e), "final_norm": (e,), "attn_norm": (l, e), "wq": (l, e, q), "wk": (l, e, kv),
              "wv": (l, e, kv), "wo": (l, q, e), "mlp_norm": (l, e), "w_gate": (l, e, f), "w_up": (l, e, f),
              "w_down": (l, f, e)}
    if c.attention_bias:
        shapes.update(bq=(l, q), bk=(l, kv), bv=(l, kv))
    if c.qk_norm:
        shapes.update(q_norm=(l, c.head_dim), k_norm=(l, c.head_dim))
    if c.post_norms:
        shapes.update(post_attn_norm=(l, e), post_mlp_norm=(l, e))
    if not c.tie_embeddings:
        shapes["lm_head"] = (e, c.vocab_size)
    return shapes


def save(path: str, config: ModelConfig, weights: dict[str, np.ndarray], tokenizer, dtype) -> None:
    import orbax.checkpoint as ocp

    dtype = jnp.dtype(dtype)
    shapes = _expected_shapes(config)
    missing = sorted(set(shapes) - set(weights))
    assert not missing, f"weights missing: {missing}"
    os.makedirs(path, exist_ok=True)
    params_dir = os.path.join(os.path.abspath(path), "params")
    if os.path.exists(params_dir):
        raise ValueError(f"OUT_DIR: {path} already holds a converted checkpoint; choose an empty directory")
    arrays = {k: jnp.asarray(weights[k], dtype) for k in shapes}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(params_dir, arrays)
        ckpt.wait_until_finished()
    if tokenizer is not None:
        tokenizer.save(path)
    # The manifest last: a directory without it is an interrupted conversion.
    with open(os.path.join(path, MANIFEST), "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "dtype": dtype.name, "config": dataclasses.asdict(config)}, f, indent=1)


def read_config(path: str) -> tuple[ModelConfig, str]:
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model: {path}/{MANIFEST} is not readable ({e})") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"model: {path} is format {manifest.get('format')!r}; this jaxcb reads {FORMAT!r}")
    try:
        raw = dict(manifest["config"])
        raw["sliding_layers"] = tuple(raw.get("sliding_layers", ()))  # JSON has lists; the config is hashable
        return ModelConfig(**raw), manifest["dtype"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"model: {path}/{MANIFEST} has a bad config ({e})") from None


def load(path: str, dtype=None):
    """(ModelConfig, weights dict of device arrays) from a converted checkpoint."""
    import orbax.checkpoint as ocp

    config, stored = read_config(path)
    dtype = jnp.dtype(dtype or stored)
    params_dir = os.path.join(os.path.abspath(path), "params")
    if not os.path.isdir(params_dir):
        raise ValueError(f"model: incomplete checkpoint: {params_dir} is missing")
    shapes = _expected_shapes(config)
    with ocp.StandardCheckpointer() as ckpt:
        try:
            meta = ckpt.metadata(params_dir)
            meta = getattr(meta, "item_metadata", meta)  # newer orbax wraps the tree
            found = {k: tuple(v.shape) for k, v in dict(meta).items()}
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds
            raise ValueError(f"model: incomplete checkpoint: cannot read {params_dir} ({type(e).__name__}: {e})") from None
        missing = sorted(set(shapes) - set(found))
        if missing:
            raise ValueError(f"model: incomplete checkpoint: {params_dir} lacks {', '.join(missing)}")
        wrong = {k: (found[k], s) for k, s in shapes.items() if found[k] != s}
        if wrong:
            k, (got, want) = next(iter(wrong.items()))
            raise ValueError(f"model: the checkpoint in {path} is from another model: {k} has shape {got}, "
                             f"its config says {want}")
        target = {k: jax.ShapeDtypeStruct(s, jnp.dtype(stored)) for k, s in shapes.items()}
        try:
            arrays = ckpt.restore(params_dir, target)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"model: incomplete checkpoint: restoring {params_dir} failed ({type(e).__name__}: {e})") from None
    if dtype != jnp.dtype(stored):
        arrays = {k: v.astype(dtype) for k, v in arrays.items()}
    return config, arrays
