"""Everything a GPU (or TPU) should measure, in one command of at most 8 minutes; one JSON file.

    .venv/bin/python -m bench.device [--json bench/results/device.json] [--quick]

1. Kernel bandwidth: the engine's Pallas ragged kernel on a decode batch of an 8B-shaped cache
   (as Llama 3 8B: 8 KV heads, head dim 128, bfloat16), live K/V bytes read per second against a
   jitted copy of as many bytes on the same device (bytes copied per second).
2. The engine benchmark (bench/engine.py's workload, all requests at once) with SmolLM2 and with an
   8B-shaped model of random weights (configs/models/llama-3-8b, bfloat16), continuous batching.
3. MBU at batch 1 (weights + live K/V bytes a decode step reads, over the step time, against the
   datasheet's memory bandwidth, and against a 4 GiB copy's bytes read plus written) and MFU at the largest decode batch (the step's FLOPs over its time, against the datasheet's
   dense bfloat16 rate when the device is known, else the measured matmul rate).

--quick shrinks every size so that the script can be checked on the CPU (its figures mean nothing there).
tools/gpu_check.sh runs this after the GPU kernel and parity tests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench.common import copy_rate, decode_inputs, machine, matmul_flops_per_s, write_result

# Dense bfloat16 matrix rate by the vendors' datasheets (FLOP/s), for MFU.
# Memory bandwidth by the datasheets (bytes/s), for MBU.
PEAK_HBM = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA A100-SXM4-80GB": 2.039e12,
            "TPU v5 lite": 819e9, "TPU v6 lite": 1640e9}
PEAK_BF16 = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA A100-SXM4-80GB": 312e12,
             "TPU v5 lite": 197e12, "TPU v6 lite": 918e12}
HERE = os.path.dirname(os.path.abspath(__file__))


def timed(fn, repeats=5):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def kernel_bandwidth(quick: bool) -> dict:
    """The engine's ragged kernel on a decode batch over an 8B-shaped cache, against a copy."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxcb.device.runner import resolve_attention
    from jaxcb.host.batch import SeqSpec, StepShape, pack
    from kernels_pallas import engine_ragged_attention

    attention = resolve_attention("auto")
    rows, ctx, k, h, d, s = (4, 256, 2, 8, 64, 16) if quick else (64, 4096, 8, 32, 128, 16)
    pages_per_seq = ctx // s
    num_pages = rows * pages_per_seq + 1
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.standard_normal((1, 2, k, num_pages, s, d), np.float32), jnp.bfloat16)
    perm = rng.permutation(np.arange(1, num_pages))
    specs = [SeqSpec([0], ctx - 1, perm[i * pages_per_seq:(i + 1) * pages_per_seq].tolist()) for i in range(rows)]
    batch = pack(specs, StepShape(tokens=rows, seqs=rows, pages_per_seq=pages_per_seq, history=ctx), s)
    q = jnp.asarray(rng.standard_normal((rows, h, d), np.float32), jnp.bfloat16)
    args = [jnp.asarray(a) for a in (batch.kv_lens, batch.page_table, batch.cu_q_lens, batch.num_seqs)]
    if attention.kernel in ("gpu", "tpu"):
        fn = jax.jit(lambda q, kv, *a: engine_ragged_attention(q, kv, jnp.int32(0), *a, backend=attention.kernel))
    else:  # the CPU (--quick): the engine's own CPU attention
        from jaxcb.model.paged_attention import ragged_attention

        b = jax.tree.map(jnp.asarray, batch)
        fn = jax.jit(lambda q, kv, *a: ragged_attention(q, kv, jnp.int32(0), b, native=attention.kernel == "cpu"))
    seconds = timed(lambda: fn(q, kv, *args).block_until_ready(), repeats=10)
    live = rows * ctx * k * d * 2 * 2  # keys and values, bfloat16
    copy = copy_rate(live, "bfloat16", repeats=10)
    return {"kernel": attention.kernel, "rows": rows, "context": ctx, "kv_heads": k, "heads": h, "head_dim": d,
            "ms": round(seconds * 1e3, 3), "live_kv_gb_per_s": round(live / seconds / 1e9, 1),
            "copy_gb_per_s": round(copy / 1e9, 1), "fraction_of_copy": round(live / seconds / copy, 3)}


def random_params(config, dtype):
    """Random weights made on the device (an 8B model's weights would take minutes in numpy)."""
    import jax
    import jax.numpy as jnp

    from jaxcb.model.llama import LayerParams, Params

    key = jax.random.PRNGKey(0)
    weights = {}
    for i, (name, shape) in enumerate(config.weight_shapes().items()):
        if name.endswith("_norm"):
            weights[name] = jnp.ones(shape, dtype)
        else:
            weights[name] = (jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) * 0.02).astype(dtype)
    layers = LayerParams(**{n: weights.get(n) for n in LayerParams.__dataclass_fields__})
    return Params(embed=weights["embed"], final_norm=weights["final_norm"], lm_head=weights.get("lm_head"),
                  layers=layers)


def engine_run(name, model_config, params, tokenizer, eos, requests, quick) -> dict:
    import jax.numpy as jnp
    from bench.engine import run, workload

    from jaxcb.host.engine_config import load_config
    from jaxcb.llm import build_engine

    config = load_config()
    if quick:
        config = config.replace(num_pages=512)
    engine = build_engine(config=config, loaded=(model_config, params, tokenizer, eos))
    t0 = time.perf_counter()
    shapes = engine.warmup()
    warmup_s = time.perf_counter() - t0
    prompts, output_lens = workload(requests, 0, model_config.vocab_size)
    result = run(engine, prompts, output_lens)
    result.pop("step_log")  # per-step records: the roofline's input, not a figure
    step = decode_steps(engine, model_config, params, quick)
    del engine
    return {"model": name, "dtype": str(jnp.dtype(params.compute_dtype)), "warmup_shapes": shapes,
            "warmup_s": round(warmup_s, 1), "requests": requests, **result, **step}


def decode_steps(engine, model_config, params, quick) -> dict:
    """MBU at batch 1 and MFU at the largest decode batch, from timed decode steps at context 1024."""
    import jax

    runner, config = engine.runner, engine.config
    ctx = 128 if quick else 1024
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    out = {}
    for rows in (1, config.buckets.max_batch):
        inputs = decode_inputs(engine, rows, ctx)
        if inputs is None:
            continue
        batch, sampling, shape = inputs
        seconds = timed(lambda: jax.device_get(runner.run(batch, sampling, shape)))
        kv_bytes = rows * ctx * runner.kv_bytes_per_token
        flops = rows * model_config.flops_per_token(ctx)
        out[f"decode_{rows}_rows_ms"] = round(seconds * 1e3, 3)
        out[f"decode_{rows}_rows_bytes"] = weight_bytes + kv_bytes
        out[f"decode_{rows}_rows_flops"] = flops
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(HERE, "results", "device.json"))
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the script on the CPU")
    ap.add_argument("--requests", type=int, default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from jaxcb.host.errors import InvalidConfig
    from jaxcb.llm import load_model, read_model_config

    t_start = time.perf_counter()
    dev = jax.devices()[0]
    result = {"machine": machine(), "device_kind": dev.device_kind, "platform": dev.platform}
    result["kernel"] = kernel_bandwidth(args.quick)
    print("kernel:", result["kernel"], flush=True)
    # The memory's measured rate: a jitted copy of 4 GiB, bytes read plus bytes written per second.
    rate_memory = 2 * copy_rate((64 << 20) if args.quick else (4 << 30), "bfloat16")
    result["copy_read_plus_write_gb_per_s"] = round(rate_memory / 1e9, 1)
    peak_memory = PEAK_HBM.get(dev.device_kind)
    peak = PEAK_BF16.get(dev.device_kind) or matmul_flops_per_s(4096 if not args.quick else 256, "bfloat16")
    result["peak_bf16_flops"] = peak
    requests = args.requests or (8 if args.quick else 256)
    runs = []
    try:
        model_config, params, tokenizer, eos = load_model(None, dtype=jnp.bfloat16)
    except InvalidConfig as e:  # the embedded model is not installed here: the 8B-shaped run still goes
        print("smollm2: skipped:", e, flush=True)
    else:
        runs.append(engine_run("smollm2-135m", model_config, params, tokenizer, eos, requests, args.quick))
        print("smollm2:", runs[-1], flush=True)
        del params
    big = read_model_config(os.path.join(HERE, "..", "configs", "models", "llama-3-8b"))
    if args.quick:  # an 8B-shaped model cut to 2 layers and a small width
        import dataclasses

        big = dataclasses.replace(big, num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4,
                                  num_kv_heads=2, head_dim=64, vocab_size=1024)
    params = random_params(big, jnp.bfloat16)
    runs.append(engine_run("llama-3-8b-shaped (random weights)", big, params, None, (), requests, args.quick))
    print("8B-shaped:", runs[-1], flush=True)
    for r in runs:
        max_batch = max(int(k.split("_")[1]) for k in r if k.startswith("decode_") and k.endswith("_ms"))
        if "decode_1_rows_ms" in r:
            rate = r["decode_1_rows_bytes"] / (r["decode_1_rows_ms"] / 1e3)
            r["mbu_batch_1_of_copy"] = round(rate / rate_memory, 3)  # of the measured read + write rate
            if peak_memory:
                r["mbu_batch_1"] = round(rate / peak_memory, 3)  # of the datasheet's bandwidth
        r[f"mfu_batch_{max_batch}"] = round(
            r[f"decode_{max_batch}_rows_flops"] / (r[f"decode_{max_batch}_rows_ms"] / 1e3) / peak, 4)
    result["engine"] = runs
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    write_result(result, args.json)


if __name__ == "__main__":
    main()
