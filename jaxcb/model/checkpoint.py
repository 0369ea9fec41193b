"""Converted checkpoints: the dequantized weights saved with orbax, next to the config and tokenizer.

    OUT_DIR/jaxcb_model.json     format, ModelConfig, dtype, weights (float32 | bfloat16 | int8 | int4)
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

from jaxcb.host.errors import InvalidConfig
from jaxcb.model.config import ModelConfig

FORMAT = "jaxcb-orbax-1"
MANIFEST = "jaxcb_model.json"


def is_checkpoint_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def _stored(config: ModelConfig, mode: str, dtype, group: int = 0) -> dict[str, jax.ShapeDtypeStruct]:
    """What the checkpoint holds, flat: a float array per weight, or for a quantized weight "NAME__q",
    "NAME__scale" (and int4's "NAME__offset") in jaxcb.model.quant's layout."""
    from jaxcb.model.quant import EXPERTS, GROUP, MATRICES

    out = {}
    for name, shape in config.weight_shapes().items():
        if mode in ("int8", "int4") and (name in MATRICES + EXPERTS or name == "lm_head"):
            *lead, rows, cols = shape
            if mode == "int4" and name != "lm_head":
                g = group or GROUP
                out[name + "__q"] = jax.ShapeDtypeStruct((*lead, rows // 2, cols), jnp.uint8)
                out[name + "__scale"] = jax.ShapeDtypeStruct((*lead, rows // g, cols), jnp.float16)
                out[name + "__offset"] = jax.ShapeDtypeStruct((*lead, rows // g, cols), jnp.float16)
            else:
                g = group if mode == "int8" and name != "lm_head" and group else rows
                out[name + "__q"] = jax.ShapeDtypeStruct(shape, jnp.int8)
                out[name + "__scale"] = jax.ShapeDtypeStruct((*lead, rows // g, cols), dtype)
        elif mode in ("int8", "int4") and name == "embed":
            from jaxcb.model.quant import ROW_GROUP

            out["embed__q"] = jax.ShapeDtypeStruct(shape, jnp.int8)
            groups = shape[1] // ROW_GROUP if shape[1] % ROW_GROUP == 0 else 1
            out["embed__scale"] = jax.ShapeDtypeStruct((shape[0], groups), dtype)
        else:
            out[name] = jax.ShapeDtypeStruct(shape, dtype)
    return out


def _flatten(weights: dict) -> dict:
    from jaxcb.model.quant import is_quantized

    flat = {}
    for k, v in weights.items():
        if is_quantized(v):
            flat[k + "__q"], flat[k + "__scale"] = v.q, v.scale
            if getattr(v, "offset", None) is not None:
                flat[k + "__offset"] = v.offset
        else:
            flat[k] = v
    return flat


def _unflatten(flat: dict) -> dict:
    from jaxcb.model.quant import QuantRows, QuantWeight

    out = {k: v for k, v in flat.items() if "__" not in k}
    for k in {k.split("__")[0] for k in flat if "__" in k}:
        q, scale = flat[k + "__q"], flat[k + "__scale"]
        if k == "embed":
            out[k] = QuantRows(q, scale)
        else:
            out[k] = QuantWeight(q, scale, flat.get(k + "__offset"), 4 if q.dtype == jnp.uint8 else 8)
    return out


def compute_dtype(weights: dict):
    """The dtype of a loaded checkpoint's float arrays (the norms, or the scales)."""
    return jnp.dtype(weights["final_norm"].dtype)


def save(path: str, config: ModelConfig, weights: dict, tokenizer, dtype, mode: str | None = None,
         group: int = 0) -> None:
    """`weights`: the loader layout (params_to_weights), quantized entries as they are; `mode`: the
    weights mode they are in (default: float in `dtype`), `group` their input rows per scale."""
    import orbax.checkpoint as ocp

    dtype = jnp.dtype(dtype)
    mode = mode or dtype.name
    stored = _stored(config, mode, dtype, group)
    flat = _flatten(weights)
    missing = sorted(set(stored) - set(flat))
    assert not missing, f"weights missing: {missing}"
    os.makedirs(path, exist_ok=True)
    params_dir = os.path.join(os.path.abspath(path), "params")
    if os.path.exists(params_dir):
        raise InvalidConfig(f"OUT_DIR: {path} already holds a converted checkpoint; choose an empty directory")
    arrays = {k: jnp.asarray(flat[k], s.dtype) for k, s in stored.items()}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(params_dir, arrays)
        ckpt.wait_until_finished()
    if tokenizer is not None:
        tokenizer.save(path)
    # The manifest last: a directory without it is an interrupted conversion.
    with open(os.path.join(path, MANIFEST), "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "dtype": dtype.name, "weights": mode, "weight_group": group,
                   "config": dataclasses.asdict(config)}, f,
                  indent=1)


def read_weights_mode(path: str) -> tuple[str, int]:
    """(weights mode, input rows per scale) a converted checkpoint was saved in (older ones: their
    float dtype)."""
    with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
        manifest = json.load(f)
    return manifest.get("weights") or manifest["dtype"], int(manifest.get("weight_group", 0))


def read_config(path: str) -> tuple[ModelConfig, str]:
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidConfig(f"model: {path}/{MANIFEST} is not readable ({e})") from None
    if manifest.get("format") != FORMAT:
        raise InvalidConfig(f"model: {path} is format {manifest.get('format')!r}; this jaxcb reads {FORMAT!r}")
    try:
        raw = dict(manifest["config"])
        for key, value in raw.items():  # (JSON has lists; the config is hashable: tuples)
            if isinstance(value, list):
                raw[key] = tuple(value)
        return ModelConfig(**raw), manifest["dtype"]
    except (KeyError, TypeError) as e:
        raise InvalidConfig(f"model: {path}/{MANIFEST} has a bad config ({e})") from None


def load(path: str, dtype=None, shardings=None):
    """(ModelConfig, weights dict of device arrays) from a converted checkpoint, restored onto the default device, or
    each weight straight into its shardings(name, value) (jaxcb.device.parallel.Placement.shardings)."""
    import orbax.checkpoint as ocp

    config, stored = read_config(path)
    dtype = jnp.dtype(dtype or stored)
    params_dir = os.path.join(os.path.abspath(path), "params")
    if not os.path.isdir(params_dir):
        raise InvalidConfig(f"model: incomplete checkpoint: {params_dir} is missing")
    mode, group = read_weights_mode(path)
    expected = _stored(config, mode, jnp.dtype(stored), group)
    with ocp.StandardCheckpointer() as ckpt:
        try:
            meta = ckpt.metadata(params_dir)
            meta = getattr(meta, "item_metadata", meta)  # newer orbax wraps the tree
            found = {k: tuple(v.shape) for k, v in dict(meta).items()}
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds
            raise InvalidConfig(f"model: incomplete checkpoint: cannot read {params_dir} ({type(e).__name__}: {e})") from None
        missing = sorted(set(expected) - set(found))
        if missing:
            raise InvalidConfig(f"model: incomplete checkpoint: {params_dir} lacks {', '.join(missing)}")
        wrong = {k: (found[k], tuple(s.shape)) for k, s in expected.items() if found[k] != tuple(s.shape)}
        if wrong:
            k, (got, want) = next(iter(wrong.items()))
            raise InvalidConfig(f"model: the checkpoint in {path} is from another model: {k} has shape {got}, "
                             f"its config says {want}")
        if shardings is not None:  # (each part of a quantized weight split as its matrix)
            placed = _flatten({name: shardings(name, value) for name, value in _unflatten(expected).items()})
            expected = {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=placed[k]) for k, s in expected.items()}
        try:
            arrays = ckpt.restore(params_dir, expected)
        except Exception as e:  # noqa: BLE001
            raise InvalidConfig(f"model: incomplete checkpoint: restoring {params_dir} failed ({type(e).__name__}: {e})") from None
    if dtype != jnp.dtype(stored):  # floats (and scales) into the asked dtype; quantized values as they are
        arrays = {k: v if k.endswith("__q") or v.dtype == jnp.float16 else v.astype(dtype) for k, v in arrays.items()}
    arrays = _unflatten(arrays)
    return config, arrays
