"""Operator commands: `jaxcb warmup`, `convert`, `plan` and `buckets`.

    jaxcb warmup [--config C] [--model M] [--compile-cache DIR]    compile every bucket into the cache
    jaxcb convert MODEL OUT_DIR [--dtype bfloat16|float32]         orbax checkpoint of the weights
    jaxcb plan --model M --memory 80GiB [--max-context N] [--tensor-parallel N]   what fits, per device
    jaxcb buckets --lengths FILE --max-buckets N [--out F]         buckets from recorded lengths
    jaxcb simulate --trace FILE [--policy P] [--step-model F | --device NAME --model-shape M]
                                                                   a trace on a simulated clock
"""

from __future__ import annotations

import os
import sys
import time


def add_parsers(sub, add_model_args) -> None:
    from jaxcb.cli.args import add_lora_args, add_rope_scaling_arg, add_speculative_args

    w = sub.add_parser("warmup", help="compile every configured bucket into the persistent compile cache")
    add_model_args(w)

    c = sub.add_parser("convert", help="save a model's dequantized weights as an orbax checkpoint (loads faster)")
    c.add_argument("model", help="GGUF file or model directory; 'default' for the embedded SmolLM2")
    c.add_argument("out_dir")
    c.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="stored float dtype (default: float32 on CPU, bfloat16 on GPU/TPU)")
    c.add_argument("--weights", choices=("int8", "int4"), default=None,
                   help="store the weight matrices quantized (jaxcb.model.quant); scales in --dtype")
    c.add_argument("--weight-group", type=int, default=0, metavar="G",
                   help="input rows per scale (default 0: per output column for int8, 32 for int4)")
    c.add_argument("--lora", action="append", default=None, metavar="PATH",
                   help="merge this PEFT LoRA adapter into the weights (repeatable: merged in order)")

    p = sub.add_parser("plan", help="what fits in a memory budget: weights, KV pages, batch per context")
    p.add_argument("--model", default=None, help="a GGUF file or a Hugging Face or converted directory, or an embedded "
                   "model: smollm2-135m (default), gemma3-270m")
    p.add_argument("--memory", required=True, help="the device memory, e.g. 80GiB")
    p.add_argument("--config", default=None)
    p.add_argument("--max-context", type=int, default=None, help="tokens per request (default: the config's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--weights", choices=("float32", "bfloat16", "int8", "int4"), default=None,
                   help="how the weights are stored (default: the config's model.weights; auto = --dtype)")
    p.add_argument("--kv-dtype", choices=("float32", "bfloat16", "int8"), default=None,
                   help="KV pages (default: the config's cache.kv_dtype; auto = --dtype)")
    p.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="split the model over N devices of --memory each (default: the config's parallel.tensor)")
    add_rope_scaling_arg(p)  # (YaRN's context)
    add_speculative_args(p)  # a draft model's weights and KV count too
    add_lora_args(p)  # and LoRA adapter slots

    s = sub.add_parser("simulate", help="run a request trace through the real scheduler on a simulated clock")
    s.add_argument("--trace", required=True, help="JSONL: arrival_s, prompt_tokens, output_tokens[, priority, client, "
                   "prefix_id, prefix_tokens | hash_ids, block_tokens] per line; or a public trace as published: "
                   "Mooncake's JSONL, Azure's or BurstGPT's CSV")
    s.add_argument("--requests", type=int, default=None, help="the trace's first N requests only (default: all)")
    s.add_argument("--time-scale", type=float, default=1.0,
                   help="arrival times multiplied by this (0.5: the same requests in half the time; default 1)")
    s.add_argument("--policy", default=None, help="scheduling policy (default: the config's)")
    s.add_argument("--config", default=None, help="engine config TOML (buckets, limits, pages)")
    s.add_argument("--step-model", default=None, help="a fitted step-time model (JSON, bench/policies.py "
                   "writes one); default: the built-in SmolLM2-on-a-2-core-CPU model")
    s.add_argument("--device", default=None, help="a roofline of an accelerator instead: "
                   "h200, h100, a100, tpu-v5e, tpu-v6e")
    s.add_argument("--model-shape", default="llama-3-8b",
                   help="with --device: llama-3-8b (default), smollm2-135m, qwen3-0.6b")
    s.add_argument("--num-pages", type=int, default=None,
                   help="KV pages (default: the config's; with --device, what the device holds)")
    s.add_argument("--max-wait-ms", type=float, default=None)
    s.add_argument("--target-p99-tpot-ms", type=float, default=None)
    s.add_argument("--max-running", type=int, default=None, help="a fixed running limit below max_running")

    b = sub.add_parser("buckets", help="choose bucket boundaries from recorded lengths (--record-lengths)")
    b.add_argument("--lengths", required=True, help="JSONL of {prompt, context} lines, or one number per line")
    b.add_argument("--max-buckets", type=int, required=True,
                   help="buckets per list (each bucket is a compiled shape per batch size)")
    b.add_argument("--config", default=None, help="config whose maxima the largest buckets must equal")
    b.add_argument("--out", default=None, help="write the [buckets] config fragment here")

    bench = sub.add_parser("bench", help="benchmarks: `jaxcb bench serve` measures a running server")
    kinds = bench.add_subparsers(dest="bench", required=True)
    from serve.benchmark import add_args as add_benchmark_args  # no JAX: it measures from the outside

    add_benchmark_args(kinds.add_parser(
        "serve", help="Poisson arrivals against any running server (OpenAI, jaxcb gRPC or JetStream API): "
                      "throughput, TTFT, TPOT, ITL, E2E latency and goodput per request rate"))


def _bar(i: int, total: int, shape, t0: float) -> None:
    width = 30
    done = width * i // total
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{total} step of {shape.tokens} tokens, "
                     f"{shape.seqs} sequences  {time.perf_counter() - t0:.0f}s   ")
    if i == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def cmd_warmup(args) -> int:
    from jaxcb.cli.args import dtype as _dtype
    from jaxcb.cli.args import engine_config as _engine_config
    from jaxcb.device import compile_cache
    from jaxcb.llm import build_engines

    config = _engine_config(args)
    cache_dir = compile_cache.enable(args.compile_cache)
    engines = build_engines(args.model, config, _dtype(args))  # every replica: each has its own devices
    t0 = time.perf_counter()
    for engine in engines:
        shapes = engine.warmup(lambda i, total, shape: _bar(i, total, shape, t0))
    print(f"jaxcb warmup: {shapes} bucket shapes in {time.perf_counter() - t0:.1f}s; "
          f"compile cache: {cache_dir or 'off (nothing kept)'}")
    return 0


def _read_lengths(path: str) -> tuple[list[int], list[int]]:
    """(prompt lengths, context lengths) from a --record-lengths file (plain numbers: both)."""
    import json

    prompts, contexts = [], []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                line = line.strip()
                if not line:
                    continue
                try:
                    obj = json.loads(line)
                    p, c = (obj, obj) if isinstance(obj, int) else (obj["prompt"], obj["context"])
                    if not (isinstance(p, int) and isinstance(c, int)) or p < 1 or c < p:
                        raise ValueError
                except (ValueError, KeyError, TypeError):
                    raise ValueError(f"--lengths: {path} line {lineno}: expected {{\"prompt\": N, \"context\": M}} "
                                     f"with 1 <= N <= M, got {line[:80]!r}") from None
                prompts.append(p)
                contexts.append(c)
    except OSError as e:
        raise ValueError(f"--lengths: {e}") from None
    if not prompts:
        raise ValueError(f"--lengths: {path} holds no lengths")
    return prompts, contexts


def cmd_buckets(args) -> int:
    from jaxcb.host.engine_config import load_config
    from jaxcb.sim import bucket_plan

    config = load_config(args.config)
    s = config.scheduler
    prompts, contexts = _read_lengths(args.lengths)
    too_long = max(contexts)
    if too_long > s.max_context:
        raise ValueError(f"--lengths: a context of {too_long} tokens exceeds the config's max_context {s.max_context}")
    # Only the prefill chunk sizes shape the step (each is a token bucket of max_running + it); a sequence's
    # page table is as long as the context whatever pages_per_seq lists below its largest, so that is not chosen.
    chunks = bucket_plan.prefill_chunks(prompts, s.max_chunk)
    top_pages = s.max_context // s.page_size
    print(f"{len(prompts)} requests; the largest prefill chunk from the config: {s.max_chunk} tokens")
    ours = bucket_plan.plan(chunks, args.max_buckets, s.max_chunk)
    current = list(config.buckets.prefill_tokens)
    pow2 = bucket_plan.powers_of_two(s.max_chunk, 16)
    print(f"prefill_tokens: {ours}  expected chunk padding {bucket_plan.padding_fraction(chunks, ours):.1%}; "
          f"the config's {current}: {bucket_plan.padding_fraction(chunks, current):.1%}; powers of two {pow2} "
          f"({len(pow2)} buckets): {bucket_plan.padding_fraction(chunks, pow2):.1%} (the chunks' own padding: a step "
          "also holds decode rows, whose padding `jaxcb simulate` measures)")
    fragment = ("[buckets]\n"
                f"decode_batch = {list(config.buckets.decode_batch)}\n"
                f"pages_per_seq = [{top_pages}]\n"
                f"prefill_tokens = {ours}\n")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(fragment)
        print(f"wrote {args.out}")
    else:
        print(fragment, end="")
    return 0


def cmd_convert(args) -> int:
    import numpy as np

    from jaxcb.cli.args import dtype as _dtype
    from jaxcb.device.factory import default_dtype
    from jaxcb.llm import load_classifier, load_model
    from jaxcb.model import checkpoint
    from jaxcb.model.embedded import resolve_model
    from jaxcb.model.llama import params_to_weights

    if os.path.exists(os.path.join(args.out_dir, checkpoint.MANIFEST)):
        raise ValueError(f"out_dir: {args.out_dir} already holds a converted checkpoint")
    t0 = time.perf_counter()
    dtype = _dtype(args) or default_dtype()
    mode = args.weights or np.dtype(dtype).name
    config, params, tokenizer, _ = load_model(None if args.model == "default" else args.model, dtype,
                                              weights="auto" if args.lora else mode, group=args.weight_group)
    if args.lora:  # merged into the float weights, then stored as asked
        from jaxcb.model.llama import params_from_numpy
        from jaxcb.model.lora import merge, read_adapter

        weights = {k: np.asarray(v) for k, v in params_to_weights(params).items()}
        for path in args.lora:
            weights = merge(weights, read_adapter(path, config))
        params = params_from_numpy(weights, dtype, mode, args.weight_group)
    loaded = time.perf_counter() - t0
    checkpoint.save(args.out_dir, config, params_to_weights(params), tokenizer, dtype, mode, args.weight_group)
    head = load_classifier(resolve_model(None if args.model == "default" else args.model), config, params, tokenizer)
    if head is not None:  # (a sequence classifier's score head, beside the weights)
        head.save(args.out_dir)
    print(f"jaxcb convert: {config.name} ({config.num_params / 1e6:.1f}M parameters, {mode}) "
          f"loaded in {loaded:.1f}s, written to {args.out_dir} in {time.perf_counter() - t0 - loaded:.1f}s; "
          f"serve it with --model {args.out_dir}")
    return 0


def cmd_plan(args) -> int:
    from jaxcb.device.parallel import check_tensor_parallel
    from jaxcb.host import memory_plan
    from jaxcb.host.engine_config import load_config
    from jaxcb.cli.args import lora_config, speculative_config
    from jaxcb.llm import draft_model_config, read_model_config

    config = load_config(args.config)
    spec = speculative_config(args, config.scheduler.speculative)
    config = config.replace(speculative=spec, lora=lora_config(args, config.lora),
                            rope_scaling=args.rope_scaling or config.rope_scaling)
    model = read_model_config(args.model, config.rope_scaling)
    draft = draft_model_config(spec, model) if spec.method == "draft" else None
    max_context = args.max_context or config.max_context_for(model)
    if max_context < 1:
        raise ValueError(f"--max-context: must be >= 1, got {max_context}")
    dtype_bytes = {"float32": 4, "bfloat16": 2}[args.dtype]
    tensor = config.tensor_parallel if args.tensor_parallel is None else args.tensor_parallel
    weights = args.weights or config.weights
    check_tensor_parallel(model, tensor, weights, config.weight_group)
    # What the config asks for, except the page count: the plan says how many fit.
    if args.kv_dtype:
        config = config.replace(kv_dtype=args.kv_dtype)
    plan = memory_plan.plan_for_model(model, config.replace(num_pages=0), budget_bytes=memory_plan.parse_bytes(args.memory),
                                      dtype_bytes=dtype_bytes, max_context=max_context, tensor=tensor, weights=weights,
                                      draft=draft)
    stored = args.dtype if weights == "auto" else weights
    if weights in ("int8", "int4") and config.weight_group:
        stored += f" (groups of {config.weight_group})"
    print(f"model {model.name} ({model.family}): {model.num_params / 1e6:.1f}M parameters, weights {stored}, "
          f"compute {args.dtype}, KV {args.dtype if config.kv_dtype == 'auto' else config.kv_dtype}; memory {args.memory} "
          f"{'per device ' if tensor > 1 else ''}x {config.memory_fraction:g}; largest batch bucket "
          f"{config.buckets.max_batch}")
    if draft is not None:
        print(f"speculative decoding: draft model {spec.draft_model or model.name}, {draft.num_layers} of its layers, "
              f"weights {spec.draft_weights}; {spec.num_tokens} tokens proposed per step")
    print(plan.describe(sorted({512, 2048, max_context})))
    from jaxcb.model.llama import largest_host_piece

    name, size, layer = largest_host_piece(model)
    print(f"host memory while loading: about {memory_plan.fmt_bytes(size)} beside the file's pages (the largest piece "
          f"built at once, in float32: {'a layer of ' if layer else ''}{name})")
    return 0




def cmd_simulate(args) -> int:
    import json

    from jaxcb.host.engine_config import AUTO_PAGES, load_config
    from jaxcb.sim.simulate import DEVICES, MODELS, RooflineStepModel, load_step_model, simulate
    from jaxcb.sim.trace import load_trace

    if args.step_model and args.device:
        raise ValueError("--step-model and --device: give one of them")
    config = load_config(args.config)
    changes = {}
    if args.policy:
        changes["policy"] = args.policy
    if args.max_wait_ms is not None:
        changes["max_wait_ms"] = args.max_wait_ms
    if args.target_p99_tpot_ms is not None:
        changes["target_p99_tpot_ms"] = args.target_p99_tpot_ms
    if args.device:
        if args.device not in DEVICES:
            raise ValueError(f"--device: {args.device!r} is not one of {', '.join(DEVICES)}")
        if args.model_shape not in MODELS:
            raise ValueError(f"--model-shape: {args.model_shape!r} is not one of {', '.join(MODELS)}")
        model = RooflineStepModel(DEVICES[args.device], MODELS[args.model_shape])
        vocab = MODELS[args.model_shape].vocab
        pages = args.num_pages or (config.num_pages if config.num_pages != AUTO_PAGES and args.config
                                   else model.num_pages(config.page_size))
    else:
        model = load_step_model(args.step_model)
        vocab = 49152
        pages = args.num_pages or (config.num_pages if config.num_pages != AUTO_PAGES else 4096)
    config = config.replace(num_pages=pages, **changes)
    if args.max_running is not None:
        if not 1 <= args.max_running <= config.scheduler.max_running:
            raise ValueError(f"--max-running: must be in [1, {config.scheduler.max_running}], got {args.max_running}")
    if args.requests is not None and args.requests < 1:
        raise ValueError(f"--requests: must be at least 1, got {args.requests}")
    trace = load_trace(args.trace, args.requests, args.time_scale)
    print(f"simulating {len(trace)} requests, policy {config.scheduler.policy}, {pages} pages of "
          f"{config.page_size} tokens, step model: {json.dumps(model.to_json())[:200]}", file=sys.stderr)

    def progress(clock, arrived, total):
        print(f"  simulated {clock:.0f} s, {arrived}/{total} arrived", file=sys.stderr)

    result = simulate(trace, config, model, vocab=vocab, progress=progress, max_running=args.max_running)
    for k, v in result.items():
        print(f"{k:>22}: {v}")
    print(json.dumps(result))
    return 0


def cmd_bench(args) -> int:
    from serve.benchmark import run

    run(args)
    return 0


COMMANDS = {"warmup": cmd_warmup, "convert": cmd_convert, "plan": cmd_plan, "buckets": cmd_buckets,
            "simulate": cmd_simulate, "bench": cmd_bench}
