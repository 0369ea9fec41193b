"""The arguments every model command shares (`jaxcb generate`, `serve`, and the operator commands of
jaxcb.cli.tools) and what they turn into: the engine config and the compute dtype. Its own module so
that the CLI and its tools both import it, neither the other."""

from __future__ import annotations

import argparse
import dataclasses

from jaxcb.host.engine_config import (ACTIVATION_CHOICES, COMPILE_CHOICES, CPU_DOTS_CHOICES, JSON_WHITESPACE_CHOICES,
                                      KV_CHOICES, LOGPROBS_MODES, WEIGHT_CHOICES)
from jaxcb.host.policies import POLICIES


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a GGUF file or a Hugging Face or converted directory of a supported family (README: "
                        "Model families), or an embedded model: smollm2-135m (the default), gemma3-270m")
    p.add_argument("--config", default=None, help="engine config TOML (default: configs/default.toml)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="compute (activations and KV) dtype, and the weights' unless --weights says otherwise "
                        "(default: float32 on CPU, bfloat16 on GPU/TPU)")
    p.add_argument("--weights", choices=WEIGHT_CHOICES[1:], default=None,
                   help="how the weight matrices are stored: a float dtype, int8 per output channel or int4 in "
                        "groups of 32, dequantized inside the step (default: the config's model.weights, auto)")
    p.add_argument("--activations", choices=ACTIVATION_CHOICES, default=None,
                   help="int8: quantize each row entering a layer matrix to int8 per 32 values and sum integer "
                        "products (w8a8 with --weights int8, w4a8 with --weights int4; the config's model.activations "
                        "by default, float)")
    p.add_argument("--kv-dtype", choices=KV_CHOICES[1:], default=None,
                   help="KV pages: a float dtype, or int8 with a scale per token and head (default: the config's "
                        "cache.kv_dtype, auto = the compute dtype)")
    p.add_argument("--cpu-dots", choices=CPU_DOTS_CHOICES, default=None,
                   help="XLA:CPU's dot library: auto (chosen for this CPU, see `python -m jaxcb.device.cpu_dots`), "
                        "jaxlib's default, YNNPACK, XNNPACK, oneDNN or XLA's own emitter (default: the config's "
                        "model.cpu_dots, auto)")
    p.add_argument("--compile", choices=COMPILE_CHOICES, default=None,
                   help="how XLA compiles each step: optimized, or fast (a fraction of the compile time, slower "
                        "steps: for development) (default: the config's model.compile, optimized)")
    p.add_argument("--json-whitespace", choices=JSON_WHITESPACE_CHOICES, default=None,
                   help="whitespace in JSON output (response_format, structured_outputs): flexible, as pretty-printed "
                        "JSON writes it, bounded (vLLM's default), or compact, none (vLLM's disable_any_whitespace "
                        "for every request) (default: the config's model.json_whitespace, flexible)")
    p.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default=None,
                   help="what a sampled token's logprobs are of (vLLM's): raw_logprobs, the model's own distribution, "
                        "or processed_logprobs, the one the token was drawn from (after logit_bias, penalties, "
                        "grammars, temperature, top-k/top-p/min-p) (default: the config's model.logprobs_mode, raw)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="the Jinja chat template to write conversations with instead of the model file's (a "
                        "base model's file may have none): a file, or the template itself (default: the config's "
                        "model.chat_template, else the model's)")
    add_rope_scaling_arg(p)
    p.add_argument("--classifier-from-tokens", default=None, metavar="TOKENS",
                   help="serve a causal LM as a classifier by its logits of these comma-separated tokens (vLLM's "
                        "classifier_from_token): no,yes makes Qwen3-Reranker a cross-encoder for /score and /rerank, "
                        "P(yes) between the two (default: the config's model.classifier_from_tokens, else none)")
    p.add_argument("--classifier-method", choices=("auto", "from_2_way_softmax", "no_post_processing"), default=None,
                   help="how --classifier-from-tokens reads them (vLLM's names): two tokens as one label, or a label "
                        "per token (default: the config's model.classifier_method, auto: the first for two tokens)")
    p.add_argument("--hf-overrides", "--hf_overrides", default=None, metavar="JSON",
                   help="vLLM's flag as written to serve a causal LM as a reranker, e.g. Qwen3-Reranker's "
                        "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": "
                        "[\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}': its classifier_from_token and "
                        "method (other keys are refused)")
    p.add_argument("--policy", default=None, help=f"scheduling policy: {', '.join(POLICIES)}")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="persistent XLA compilation cache (default: $JAXCB_COMPILE_CACHE or ~/.cache/jaxcb/xla; "
                        "'off' for none)")
    p.add_argument("--record-lengths", default=None, metavar="FILE",
                   help="append each finished request's prompt and context length to FILE (for `jaxcb buckets`)")
    p.add_argument("--prefix-cache", choices=("on", "off"), default=None,
                   help="share the pages of common prompt prefixes (default: the config's cache.prefix_caching, on)")
    p.add_argument("--attention", choices=("xla", "native", "pallas", "auto"), default=None,
                   help="attention: plain JAX, the native CPU kernels, the Pallas kernels, or auto (Pallas "
                        "on GPU/TPU, native on the CPU when it builds; the config's model.attention by default)")
    add_speculative_args(p)
    add_lora_args(p)
    p.add_argument("--lora", action="append", default=None, metavar="NAME=PATH",
                   help="serve the PEFT LoRA adapter in directory PATH as model NAME (repeatable; implies "
                        "--max-loras 1 if the config has no slots); more are loaded while serving; generate runs "
                        "with the one given alone, or as --adapter and the lines' \"lora\" say")
    p.add_argument("--tensor-parallel", "--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="split each step over N devices by attention heads (default: the config's parallel.tensor, 1)")
    p.add_argument("--data-parallel", "--data-parallel-size", type=int, default=None, metavar="M",
                   help="M engine replicas on disjoint devices behind one router (default: the config's "
                        "parallel.data, 1); each replica takes --tensor-parallel devices")


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding's flags (generate, serve, warmup, plan)."""
    p.add_argument("--speculative", choices=("ngram", "draft", "off"), default=None,
                   help="speculative decoding: ngram proposes what followed the sequence's latest suffix match in "
                        "its own prompt and output, draft what a draft model (--draft-model, --draft-layers) "
                        "decodes greedily; the step scores the proposals and keeps what greedy or seeded "
                        "sampling would have produced (default: the config's speculative.method, off)")
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="the draft model (implies --speculative draft): a GGUF, converted checkpoint, Hugging Face "
                        "directory or embedded model name with the target's vocabulary (default: the config's "
                        "speculative.draft_model; none = the target's own weights)")
    p.add_argument("--draft-layers", type=int, default=None, metavar="N",
                   help="the draft keeps the first N layers of its model (implies --speculative draft; default: "
                        "the config's speculative.draft_layers, 0 = all)")
    p.add_argument("--draft-weights", choices=("auto", "float32", "bfloat16", "int8", "int4"), default=None,
                   help="the draft's weight format (implies --speculative draft; default: the config's "
                        "speculative.draft_weights, auto)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="tokens proposed per speculating step, at most (default: the config's "
                        "speculative.num_tokens, 4)")


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """LoRA adapter slots (generate, serve, warmup, plan)."""
    p.add_argument("--max-loras", type=int, default=None, metavar="S",
                   help="LoRA adapters resident on the device at once, each a slot of the step (default: the "
                        "config's lora.max_loras, 0 = none)")
    p.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                   help="the largest adapter rank the slots hold (default: the config's lora.max_rank, 16)")
    p.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                   help="adapters registered at once, in host memory (default: the config's lora.max_cpu_loras, 64; "
                        "0 = no limit)")


def lora_config(args, lora):
    """The config's LoraConfig with the LoRA flags applied."""
    changes = {}
    if getattr(args, "max_loras", None) is not None:
        changes["max_loras"] = args.max_loras
    if getattr(args, "max_lora_rank", None) is not None:
        changes["max_rank"] = args.max_lora_rank
    if getattr(args, "max_cpu_loras", None) is not None:
        changes["max_cpu_loras"] = args.max_cpu_loras
    if getattr(args, "lora", None):
        changes["adapters"] = tuple(lora.adapters) + tuple(args.lora)
        if not changes.get("max_loras", lora.max_loras):
            changes["max_loras"] = 1
    return dataclasses.replace(lora, **changes) if changes else lora


def speculative_config(args, spec):
    """The config's SpeculativeConfig with the speculative flags applied."""
    if getattr(args, "speculative", None):
        spec = dataclasses.replace(spec, method="" if args.speculative == "off" else args.speculative)
    if getattr(args, "num_speculative_tokens", None) is not None:
        spec = dataclasses.replace(spec, num_tokens=args.num_speculative_tokens)
    draft = {name: getattr(args, name, None) for name in ("draft_model", "draft_layers", "draft_weights")}
    draft = {name: v for name, v in draft.items() if v is not None}
    if draft:
        if not getattr(args, "speculative", None) and spec.method != "draft":
            draft["method"] = "draft"  # naming a draft asks for it
        spec = dataclasses.replace(spec, **draft)
    return spec


def add_rope_scaling_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rope-scaling", default=None, metavar="JSON",
                   help="RoPE scaling in place of the model file's, as transformers' rope_scaling (vLLM's flag), e.g. "
                        "'{\"rope_type\":\"yarn\",\"factor\":4.0,\"original_max_position_embeddings\":32768}' "
                        "to serve Qwen3 past 32K; {\"rope_type\":\"default\"} for none (default: the config's "
                        "model.rope_scaling, else the model's)")


def engine_config(args):
    from jaxcb.host.engine_config import load_config

    config = load_config(args.config)
    changes = {}
    if args.policy:
        changes["policy"] = args.policy
    if getattr(args, "static", False):
        changes["static"] = True
    if args.attention:
        changes["attention"] = args.attention
    if args.prefix_cache:
        changes["prefix_caching"] = args.prefix_cache == "on"
    if getattr(args, "tensor_parallel", None) is not None:
        changes["tensor_parallel"] = args.tensor_parallel
    if getattr(args, "data_parallel", None) is not None:
        changes["data_parallel"] = args.data_parallel
    if getattr(args, "weights", None):
        changes["weights"] = args.weights
    if getattr(args, "kv_dtype", None):
        changes["kv_dtype"] = args.kv_dtype
    if getattr(args, "activations", None):
        changes["activations"] = args.activations
    if getattr(args, "served_model_name", None):
        changes["served_model_name"] = tuple(args.served_model_name)
    if getattr(args, "chat_template", None):
        changes["chat_template"] = args.chat_template
    if getattr(args, "rope_scaling", None):
        changes["rope_scaling"] = args.rope_scaling
    if getattr(args, "classifier_from_tokens", None):
        from jaxcb.host.classifier import parse_tokens

        changes["classifier_from_tokens"] = parse_tokens(args.classifier_from_tokens)
    if getattr(args, "classifier_method", None):
        changes["classifier_method"] = args.classifier_method
    if getattr(args, "hf_overrides", None):
        from jaxcb.host.classifier import hf_overrides

        tokens, method = hf_overrides(args.hf_overrides)
        if tokens:
            changes["classifier_from_tokens"], changes["classifier_method"] = tokens, method
    if getattr(args, "cpu_dots", None):
        changes["cpu_dots"] = args.cpu_dots
    if getattr(args, "compile", None):
        changes["compile"] = args.compile
    if getattr(args, "json_whitespace", None):
        changes["json_whitespace"] = args.json_whitespace
    if getattr(args, "logprobs_mode", None):
        changes["logprobs_mode"] = args.logprobs_mode
    spec = speculative_config(args, config.scheduler.speculative)
    if spec != config.scheduler.speculative:
        changes["speculative"] = spec
    lora = lora_config(args, config.lora)
    if lora != config.lora:
        changes["lora"] = lora
    return config.replace(**changes) if changes else config


def dtype(args):
    """--dtype as a JAX dtype, or None for the backend's default."""
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}.get(args.dtype)
