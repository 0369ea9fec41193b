"""LoRA adapters in PEFT's format: read, checked against the base model, merged.

A PEFT adapter directory holds `adapter_config.json` (`r`, `lora_alpha`, `target_modules`, optional
`rank_pattern` / `alpha_pattern`, `use_rslora`, `layers_to_transform`) and `adapter_model.safetensors`
with, per adapted projection of layer i, `...layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r] (torch's [out, in] order). The update of a projection W [in, out] (this
project's order) is

    x @ W + scale * (x @ A.T) @ B.T,    scale = alpha / r   (alpha / sqrt(r) with use_rslora)

Read here into this project's layout: per target (wq, wk, wv, wo, w_gate, w_up, w_down) a stacked
A [L, in, r] and B [L, r, out] with the scale folded into B, zeros for layers the adapter leaves alone
(layers_to_transform). jaxcb's layout of the attention projections is Hugging Face's (the GGUF loader
undoes llama.cpp's rotary permutation), so the adapter applies as it is. What is not supported (DoRA,
biases, modules_to_save, fan_in_fan_out, an embedding or head adapter) is refused naming the key.

Plain numpy (and `safetensors`' numpy reader), no JAX.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from jaxcb.host.errors import InvalidConfig
from jaxcb.host.lora import TARGETS

# Hugging Face module name -> this project's matrix
MODULES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
           "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
assert tuple(MODULES.values()) == TARGETS
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_ALPHA = 8  # LoraConfig's lora_alpha where a config gives none
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclasses.dataclass
class Adapter:
    """One adapter in this project's layout."""

    name: str
    path: str
    rank: int  # the largest rank of any target
    weights: dict[str, tuple[np.ndarray, np.ndarray]]  # target -> (A [L, in, r], B [L, r, out], scale folded in)

    @property
    def num_params(self) -> int:
        return sum(a.size + b.size for a, b in self.weights.values())


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that matches the module's
    full name at its end (keys are module names or regular expressions, an alternation as a whole: PEFT's
    get_pattern_key groups the key)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


# PEFT settings that change what an adapter computes in ways jaxcb does not run: refused by name rather than
# applied as plain LoRA (an adapter saved with one of these gives other tokens than PEFT's).
_NOT_RUN = {"alora_invocation_tokens": "activated LoRA (from its invocation tokens on)",
            "layer_replication": "layer replication (the base's layers stacked again)",
            "use_bdlora": "block-diagonal LoRA", "lora_bias": "a bias on lora_B",
            "trainable_token_indices": "trained token embeddings",
            "kasa_config": "KaSA (singular values beside lora_A and lora_B; the base's truncated on load)"}
# init_lora_weights that also rewrite the base weights where an adapter is loaded unconverted (saved without
# path_initial_model_for_weight_conversion: PEFT recomputes the base's residual on load)
_BASE_REWRITING = ("pissa", "olora", "corda", "loftq", "lora_ga")


def _check_settings(name: str, config: dict) -> None:
    """What the adapter's config asks for that jaxcb does not run, refused naming the key; rank_pattern and
    alpha_pattern of the right shape (module patterns that compile, numbers)."""
    for key, what in _NOT_RUN.items():
        if config.get(key) not in (None, False, [], {}):
            raise InvalidConfig(f"lora {name}: {key} = {json.dumps(config[key])[:60]} ({what}) is not supported")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING):
        raise InvalidConfig(f"lora {name}: init_lora_weights = {init!r}: an adapter saved unconverted changes the "
                            "base weights on load; save it with path_initial_model_for_weight_conversion (plain LoRA)")
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in patterns.items()):
            raise InvalidConfig(f"lora {name}: {key} must be an object of module patterns to numbers")
        for k in patterns:
            try:
                re.compile(k)
            except re.error as e:
                raise InvalidConfig(f"lora {name}: {key}: {k[:60]!r} is not a regular expression ({e})") from None


def _named(patterns, module: str) -> bool:
    """PEFT's reading of target_modules / exclude_modules: a string is a regular expression the module's full
    name matches whole; a list names modules by their full name or its last parts."""
    if isinstance(patterns, str):
        return re.fullmatch(patterns, module) is not None
    return any(module == p or module.endswith("." + p) for p in patterns or ())


def _adapted(config: dict, module: str, layer: int) -> bool:
    """Whether PEFT builds the adapter's layer for `module` (its full name in the base model, in layer `layer`):
    named by target_modules ("all-linear": every projection here) or target_parameters, not by exclude_modules,
    in layers_to_transform. A tensor for a module it does not build is left out, as PEFT leaves it; a config that
    names no targets takes every tensor."""
    targets, parameters = config.get("target_modules"), config.get("target_parameters")
    if targets is not None or parameters:
        named = targets == "all-linear" or (targets is not None and _named(targets, module))
        if not (named or _named(parameters, module + ".weight")):
            return False
    if config.get("exclude_modules") and _named(config["exclude_modules"], module):
        return False
    layers = config.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    return not isinstance(layers, list) or layer in layers


def read_adapter(path: str, model, name: str | None = None, max_rank: int | None = None) -> Adapter:
    """The PEFT adapter in directory `path` for base model `model` (a ModelConfig), checked: every key
    known, every shape the base's, the rank within `max_rank`."""
    from safetensors.numpy import load_file

    name = name or os.path.basename(os.path.normpath(path))
    config_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(config_path):
        raise InvalidConfig(f"lora {name}: {path} has no {CONFIG_FILE} (a PEFT adapter directory)")
    if not os.path.isfile(weights_path):
        raise InvalidConfig(f"lora {name}: {path} has no {WEIGHTS_FILE}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidConfig(f"lora {name}: {config_path} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise InvalidConfig(f"lora {name}: {CONFIG_FILE} is not a JSON object")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False)):
        if config.get(key, ok) not in (ok, None):
            raise InvalidConfig(f"lora {name}: {key} = {config[key]!r} is not supported")
    if config.get("bias", "none") not in ("none", None):
        raise InvalidConfig(f"lora {name}: bias = {config['bias']!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise InvalidConfig(f"lora {name}: modules_to_save = {config['modules_to_save']!r} is not supported")
    if config.get("peft_type", "LORA") not in ("LORA", None):
        raise InvalidConfig(f"lora {name}: peft_type = {config['peft_type']!r} is not supported (only LORA)")
    try:
        r, alpha = int(config["r"]), float(config.get("lora_alpha", PEFT_ALPHA))
    except (KeyError, TypeError, ValueError):
        raise InvalidConfig(f"lora {name}: {CONFIG_FILE} needs an integer r (and a number lora_alpha)") from None
    rslora = bool(config.get("use_rslora", False))
    _check_settings(name, config)
    try:
        tensors = load_file(weights_path)
    except Exception as e:  # noqa: BLE001 - the library raises its own error types
        raise InvalidConfig(f"lora {name}: {weights_path} is not a readable safetensors file ({e})") from None

    shapes = model.weight_shapes()
    found: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise InvalidConfig(f"lora {name}: tensor {key} is not a LoRA A/B weight of a layer's projection "
                                f"(supported: {', '.join(MODULES)})")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULES:
            raise InvalidConfig(f"lora {name}: tensor {key} adapts {module}, which is not supported "
                                f"(supported: {', '.join(MODULES)})")
        if layer >= model.num_layers:
            raise InvalidConfig(f"lora {name}: tensor {key} is for layer {layer}; the model has {model.num_layers}")
        if not _adapted(config, key[:key.index(f".lora_{which}")].split("base_model.model.")[-1], layer):
            continue
        found.setdefault((MODULES[module], layer), {})[which] = np.asarray(value, np.float32)
        found[(MODULES[module], layer)]["module"] = key[:key.index(f".lora_{which}")]
    if not found:
        raise InvalidConfig(f"lora {name}: {WEIGHTS_FILE} holds no LoRA weights")

    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    rank = 0
    for target in TARGETS:
        layers = {i: ab for (t, i), ab in found.items() if t == target}
        if not layers:
            continue
        _, n_in, n_out = shapes[target]
        ranks = set()
        for i, ab in sorted(layers.items()):
            if "A" not in ab or "B" not in ab:
                raise InvalidConfig(f"lora {name}: {ab['module']} has lora_{'A' if 'A' not in ab else 'B'} missing")
            a, b = ab["A"], ab["B"]
            if a.ndim != 2 or b.ndim != 2 or a.shape[1] != n_in or b.shape[0] != n_out or a.shape[0] != b.shape[1]:
                raise InvalidConfig(f"lora {name}: {ab['module']}: lora_A {a.shape} and lora_B {b.shape} do not "
                                    f"fit the base's [{n_out}, {n_in}] projection")
            ranks.add(a.shape[0])
        r_max = max(ranks)
        stack_a = np.zeros((model.num_layers, n_in, r_max), np.float32)
        stack_b = np.zeros((model.num_layers, r_max, n_out), np.float32)
        for i, ab in layers.items():
            a, b = ab["A"], ab["B"]
            r_i = a.shape[0]
            module = ab["module"].split("base_model.model.")[-1]
            alpha_i = float(_pattern_value(config.get("alpha_pattern"), module, alpha))
            scale = alpha_i / (math.sqrt(r_i) if rslora else r_i)
            stack_a[i, :, :r_i] = a.T
            stack_b[i, :r_i, :] = b.T * scale
        if model.family == "llama4" and target in ("wq", "wk"):  # (the base's columns are reordered so)
            from jaxcb.model.hf_loader import halves_from_pairs

            stack_b = halves_from_pairs(stack_b, model)
        weights[target] = (stack_a, stack_b)
        rank = max(rank, r_max)
    del r
    if max_rank is not None and rank > max_rank:
        raise InvalidConfig(f"lora {name}: rank {rank} is above lora.max_rank {max_rank}")
    return Adapter(name, path, rank, weights)


def merge(weights: dict[str, np.ndarray], adapter: Adapter) -> dict[str, np.ndarray]:
    """The base weights (the loader layout, float) with the adapter merged in: W + A @ B per layer."""
    out = dict(weights)
    for target, (a, b) in adapter.weights.items():
        if not isinstance(weights[target], np.ndarray):
            raise InvalidConfig(f"lora {adapter.name}: merging needs float weights; {target} is quantized")
        out[target] = (weights[target].astype(np.float32) + np.einsum("lir,lro->lio", a, b)).astype(weights[target].dtype)
    return out


def parse_spec(text: str) -> tuple[str, str]:
    """'NAME=PATH' (--lora) -> (NAME, PATH)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise InvalidConfig(f"lora: {text!r} is not NAME=PATH")
    return name, path
