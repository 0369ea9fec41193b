"""RoPE scaling schemes that stretch a model's context, as ModelConfig fields: each scheme comes down to what
each rotary frequency is divided by (`rope_freq_factors`) and a factor on cos and sin (`rope_attention_factor`),
computed once on the host as transformers computes them, so the step runs every scheme the same way.

`from_dict` reads transformers' `rope_scaling` / `rope_parameters` layout (config.json, or `--rope-scaling`);
the GGUF loader calls the schemes with llama.cpp's metadata.
"""

from __future__ import annotations

import math

import numpy as np

from jaxcb.host.engine_config import parse_rope_scaling
from jaxcb.host.errors import InvalidConfig


def frequencies(theta: float, rotary_dim: int) -> np.ndarray:
    """The plain RoPE frequencies (radians per position) of `rotary_dim` rotated dimensions, float64 from
    float32 as the step computes them."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    return (1.0 / (np.float32(theta) ** exponents)).astype(np.float64)


def llama3(theta: float, rotary_dim: int, factor: float, low: float, high: float, original: float) -> dict:
    """Llama 3.1+'s per-frequency scaling: frequencies whose wavelength exceeds original / low divided by
    `factor`, those under original / high kept, a smooth blend between."""
    factors = []
    for wavelength in 2 * math.pi / frequencies(theta, rotary_dim):
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return {"rope_freq_factors": tuple(factors)}


def mscale(factor: float, scale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 * scale * ln(factor) + 1 (1 for no stretch)."""
    return 1.0 if factor <= 1.0 else 0.1 * scale * math.log(factor) + 1.0


def yarn(theta: float, rotary_dim: int, factor: float, original: int, beta_fast: float = 32.0,
         beta_slow: float = 1.0, truncate: bool = True, attention_factor: float | None = None) -> dict:
    """YaRN (Qwen2.5/Qwen3 past 32K, gpt-oss, DeepSeek): frequencies that turn fewer than `beta_slow` times
    over the original context are divided by `factor` (interpolated), those turning more than `beta_fast`
    times kept (extrapolated), a linear ramp between over the dimensions; cos and sin times the attention
    factor (default mscale(factor)). Static: every position, as vLLM and llama.cpp run it."""
    def dim_for(rotations):  # the rotated dimension whose frequency turns `rotations` times over the original context
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    kept = 1.0 - ramp  # the share of each frequency extrapolated (kept as it is)
    factors = 1.0 / (kept + (1.0 - kept) / factor)
    attention = mscale(factor) if attention_factor is None else attention_factor
    return {"rope_freq_factors": tuple(float(f) for f in factors), "rope_attention_factor": float(attention)}


def kind(scaling) -> str | None:
    """A rope scaling's kind (transformers 5's rope_type, 4's type)."""
    return scaling.get("rope_type", scaling.get("type")) if scaling else None


def from_dict(scaling, theta: float, rotary_dim: int, max_position: int, where: str = "config.json") -> dict:
    """A full-attention layer's `rope_scaling` in transformers' layout as ModelConfig fields: linear
    (`factor`), Llama 3's ("llama3") and YaRN ("yarn", with the context it stretches to as `max_context`:
    original_max_position_embeddings times the factor (vLLM's rule), or `max_position` if longer); LongRoPE is read by the caller
    (hf_loader._longrope); other kinds are refused by name. `max_position`: the model's
    max_position_embeddings (YaRN's original context when the dict lacks one)."""
    name = kind(scaling)
    # ("su": LongRoPE's first name, in Phi-3's first configs; "mrope": Qwen2-VL's multimodal RoPE, whose sections
    # all take a text token's one position: plain RoPE on text)
    if name in (None, "default", "longrope", "su", "mrope"):
        return {}
    if name not in ("linear", "llama3", "yarn"):
        raise InvalidConfig(f"{where}: rope_scaling {scaling!r} is not supported (default, linear, llama3 and yarn are)")
    try:
        factor = float(scaling["factor"])
        if not 1.0 <= factor < 1e6:
            raise ValueError(f"factor {factor} is not between 1 and a million")
        if name == "linear":
            return {"rope_linear_factor": factor} if factor != 1.0 else {}
        original = int(scaling.get("original_max_position_embeddings") or max_position)
        if name == "llama3":
            return llama3(theta, rotary_dim, factor, float(scaling["low_freq_factor"]),
                          float(scaling["high_freq_factor"]), float(original))
        attention = scaling.get("attention_factor")  # (given, it wins over DeepSeek's pair: transformers' order)
        if attention is None and scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention = mscale(factor, float(scaling["mscale"])) / mscale(factor, float(scaling["mscale_all_dim"]))
        fields = yarn(theta, rotary_dim, factor, original, float(scaling.get("beta_fast") or 32.0),
                      float(scaling.get("beta_slow") or 1.0), bool(scaling.get("truncate", True)),
                      None if attention is None else float(attention))
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidConfig(f"{where}: rope_scaling {scaling!r} lacks a number it needs ({e})") from None
    return {**fields, "max_context": max(max_position, int(original * factor))}


def override(config, text: str, where: str = "model.rope_scaling"):
    """`config` (a ModelConfig) with its full-attention layers' RoPE scaling replaced by `text` (EngineConfig's,
    read by jaxcb.host.engine_config.parse_rope_scaling): "default" for none, or linear / llama3 / yarn from the
    base and context the model file gives (YaRN's original context, if the dict names none: the model's context
    as read). "" leaves it as it is."""
    import dataclasses

    if not text:
        return config
    fields = from_dict(parse_rope_scaling(text, where), config.rope_theta, config.rope_dim, config.max_context, where)
    plain = {"rope_freq_factors": (), "rope_linear_factor": 1.0, "rope_attention_factor": 1.0,
             "max_context": config.max_context}
    return dataclasses.replace(config, **{**plain, **fields})
