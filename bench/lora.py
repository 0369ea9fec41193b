"""Many LoRA adapters in one batch against the base model alone, SmolLM2 on this machine, same process.

    python -m bench.lora [--rank 16] [--slots 8] [--requests 32] [--trials 2] [--spread 4 8 16] [--json PATH]

Adapters: random rank-`--rank` PEFT adapters on all seven projections, written to a temporary directory
and loaded as a user's would be (jaxcb.model.lora). Two engines on the same weights, each with its own KV
pages: the base model (no slots), and one with `--slots` adapter slots. Measured, interleaved:
1. The engine benchmark's workload (bench.engine: all submitted at once, EOS ignored) with every request on
   one of `--slots` adapters (round robin), against the base engine: output tokens/s and the ratio.
2. The decode step at 32 rows (context 128): the base runner, and the LoRA runner with the rows spread
   over the slots (median of 20 steps).
3. The workload with the requests spread over each of `--spread` adapter counts (more adapters than slots
   swap in from host memory): output tokens/s and slot loads.
4. Loading one adapter while the engine serves (read and checked, then its slot filled), and unloading it.
Also compilations after warm-up (target 0).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time

import numpy as np

from bench.common import machine, write_result

HF = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
      "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def random_adapter(path: str, config, rank: int, seed: int) -> None:
    """A PEFT adapter directory: random A and B (small) on every projection of every layer."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    shapes = config.weight_shapes()
    tensors = {}
    for target, module in HF.items():
        _, n_in, n_out = shapes[target]
        for i in range(config.num_layers):
            prefix = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * 0.01).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                   "target_modules": sorted(m.split(".")[1] for m in HF.values())}, f)


def run_workload(engine, prompts, output_lens, names) -> dict:
    from jaxcb.host.request import SamplingParams

    engine.reset_counters()
    compiled = engine.stats().compilations
    swaps = engine.adapters.num_swaps if engine.adapters is not None else 0
    t0 = time.perf_counter()
    for p, n, name in zip(prompts, output_lens, names):
        engine.add_request(p, SamplingParams(max_tokens=int(n), ignore_eos=True, lora=name))
    useful = 0
    while engine.has_work():
        useful += sum(len(ev.token_ids) for ev in engine.step())
    wall = time.perf_counter() - t0
    engine.pool.check_all_free()
    st = engine.stats()
    return {"output_tokens_per_s": round(useful / wall, 2), "wall_s": round(wall, 2), "steps": st.steps,
            "compilations_after_warmup": st.compilations - compiled,
            "slot_loads": (engine.adapters.num_swaps - swaps) if engine.adapters is not None else 0}


def decode_step_s(runner, config, rows: int, context: int, slots: int) -> float:
    """Median seconds of a decode step of `rows` rows at `context` tokens (rows spread over `slots`)."""
    from jaxcb.host.batch import SamplingRow, SeqSpec, pack, pack_sampling
    from jaxcb.host.request import SamplingParams

    pages = -(-(context + 1) // config.page_size)
    specs = [SeqSpec([7], context, list(range(1 + i * pages, 1 + (i + 1) * pages)),
                     lora_slot=i % slots if slots else -1) for i in range(rows)]
    shape = config.buckets.step_shape(rows, config.page_size, config.scheduler.max_context)
    batch = pack(specs, shape, config.page_size)
    sampling = pack_sampling([SamplingRow(SamplingParams(), 0, [], []) for _ in specs], shape,
                             runner.model_config.vocab_size)
    times = []
    for _ in range(23):
        t0 = time.perf_counter()
        runner.fetch(runner.run(batch, sampling, shape))
        times.append(time.perf_counter() - t0)
    return float(np.median(times[3:]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--config", default=None)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--spread", nargs="*", type=int, default=[4, 8, 16], help="adapter counts to spread over")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from bench.engine import workload
    from jaxcb.device.runner import ModelRunner
    from jaxcb.host.engine import Engine
    from jaxcb.host.lora import LoraConfig
    from jaxcb.llm import adapter_reader, build_engine

    base = build_engine(args.model, args.config)
    config, r = base.config, base.runner
    lora_config = config.replace(lora=LoraConfig(max_loras=args.slots, max_rank=args.rank))
    runner = ModelRunner(r.model_config, r.params, r.num_pages, r.page_size, r.dtype, attention=config.attention,
                         max_seqs=config.buckets.max_batch, kv_dtype=r.kv_dtype, compile=config.compile,
                         lora=(lora_config.lora.targets, args.slots, args.rank))
    engine = Engine(runner, base.tokenizer, lora_config, eos_ids=base.scheduler.eos_ids)
    engine.adapters.reader = adapter_reader(r.model_config, lora_config.lora)
    count = max([args.slots, *args.spread])
    tmp = tempfile.mkdtemp(prefix="jaxcb-lora-")
    t0 = time.perf_counter()
    for i in range(count + 1):
        random_adapter(os.path.join(tmp, f"a{i}"), r.model_config, args.rank, seed=i)
    for i in range(count):
        engine.load_lora(f"a{i}", os.path.join(tmp, f"a{i}"))
    print(f"{count + 1} rank-{args.rank} adapters written and {count} loaded in {time.perf_counter() - t0:.1f} s "
          f"({engine.adapters.entries['a0'].adapter.num_params / 1e6:.1f}M parameters each)", flush=True)
    t0 = time.perf_counter()
    base.warmup()
    engine.warmup()
    print(f"warm-up: {time.perf_counter() - t0:.0f} s ({machine()}; {r.describe()}; slots {args.slots} x rank "
          f"{args.rank}: {runner.lora.nbytes / 2**20:.0f} MiB)", flush=True)
    results = {"machine": machine(), "rank": args.rank, "slots": args.slots, "requests": args.requests}

    prompts, lens = workload(args.requests, 0, r.model_config.vocab_size)
    on_slots = [f"a{i % args.slots}" for i in range(args.requests)]
    runs = {"base": [], "lora": []}
    for _ in range(args.trials):
        runs["base"].append(run_workload(base, prompts, lens, [""] * args.requests))
        runs["lora"].append(run_workload(engine, prompts, lens, on_slots))
    med = {k: sorted(v, key=lambda x: x["output_tokens_per_s"])[len(v) // 2] for k, v in runs.items()}
    ratio = med["lora"]["output_tokens_per_s"] / med["base"]["output_tokens_per_s"]
    print(f"workload, {args.requests} requests: base {med['base']['output_tokens_per_s']:.1f} tok/s, every request "
          f"on one of {args.slots} adapters {med['lora']['output_tokens_per_s']:.1f} tok/s: {ratio:.3f}x "
          f"(trials base {[x['output_tokens_per_s'] for x in runs['base']]}, lora "
          f"{[x['output_tokens_per_s'] for x in runs['lora']]}); compilations after warm-up "
          f"{max(x['compilations_after_warmup'] for x in runs['lora'])}", flush=True)
    results["workload"] = {"base": runs["base"], "lora": runs["lora"], "ratio": round(ratio, 3)}

    step_base = decode_step_s(r, config, 32, 128, 0)
    step_lora = decode_step_s(runner, lora_config, 32, 128, args.slots)
    print(f"decode step, 32 rows at context 128: base {1000 * step_base:.1f} ms, rows over {args.slots} adapters "
          f"{1000 * step_lora:.1f} ms ({step_lora / step_base:.2f}x)", flush=True)
    results["decode_step_ms"] = {"base": round(1000 * step_base, 2), "lora": round(1000 * step_lora, 2)}

    results["spread"] = {}
    for n in args.spread:
        names = [f"a{i % n}" for i in range(args.requests)]
        res = run_workload(engine, prompts, lens, names)
        print(f"spread over {n} adapters ({args.slots} slots): {res['output_tokens_per_s']:.1f} tok/s, "
              f"{res['slot_loads']} slot loads, compilations after warm-up {res['compilations_after_warmup']}",
              flush=True)
        results["spread"][n] = res

    # Loading and unloading one adapter while the engine runs the workload on its own thread.
    done = threading.Event()

    def serve():
        run_workload(engine, prompts, lens, on_slots)
        done.set()

    th = threading.Thread(target=serve)
    th.start()
    time.sleep(2.0)
    name, path = f"a{count}", os.path.join(tmp, f"a{count}")
    t0 = time.perf_counter()
    engine.load_lora(name, path)
    load_s = time.perf_counter() - t0
    th.join()
    # its first request puts it in a slot (the least recently used): the fill, timed on its own
    import jax

    entry = engine.adapters.entries[name]
    t0 = time.perf_counter()
    engine.adapters.acquire(entry)
    jax.block_until_ready(engine.runner.lora.arrays)
    fill_s = time.perf_counter() - t0
    engine.adapters.release(entry)
    t0 = time.perf_counter()
    engine.unload_lora(name)
    unload_s = time.perf_counter() - t0
    print(f"while serving: load (read + check) {1000 * load_s:.0f} ms, slot fill {1000 * fill_s:.0f} ms, unload "
          f"{1000 * unload_s:.2f} ms", flush=True)
    results["load_ms"], results["fill_ms"], results["unload_ms"] = (round(1000 * load_s, 1), round(1000 * fill_s, 1),
                                                                    round(1000 * unload_s, 3))
    write_result(results, args.json, echo=False)


if __name__ == "__main__":
    main()
