"""Where a decode step's device time goes: the engine step of an 8B-shaped model (random weights, bfloat16)
timed, then profiled (jax.profiler), its device ops summed by name.

    python -m bench.step_profile [--rows 1 32] [--context 1024] [--attention auto] [--top 8] [--quick]

For an accelerator (the first GPU run found two XLA:GPU problems this way: bench/results/gpu_h200.md);
on the CPU the trace holds no device lane and the table sums the host's ops. --quick shrinks the model
to 2 small layers, to check the script on the CPU.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import tempfile

from bench.common import decode_inputs, machine


def device_ops(trace_dir: str, steps: int) -> tuple[bool, float, list[tuple[str, float, float]]]:
    """(whether the trace has device lanes, their ms per step, [(op, ms per step, calls per step)]) from a
    perfetto trace; the device lanes are the processes named /device:..., or every lane where there is
    none (the CPU: host spans, nested and overlapping, so their sum is no time)."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:  # the profiler wrote nothing (a backend without one)
        return False, 0.0, []
    with gzip.open(paths[0]) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    # A device's summary lanes (TPU's and newer profilers' "XLA Modules", "Steps") span its ops: not summed.
    summary = {(e["pid"], e.get("tid")) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
               and e["args"]["name"] in ("XLA Modules", "Steps", "XLA TraceMe")}
    device = {pid for pid, n in names.items() if n.startswith("/device:")}
    lanes = device or set(names)
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e["pid"] in lanes and (e["pid"], e.get("tid")) not in summary:
            total[e["name"]] += e.get("dur", 0)
            calls[e["name"]] += 1
    ops = [(n, us / steps / 1e3, calls[n] / steps) for n, us in total.most_common()]
    return bool(device), sum(total.values()) / steps / 1e3, ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from bench.device import random_params, timed
    from jaxcb.host.engine_config import load_config
    from jaxcb.llm import build_engine, read_model_config

    here = os.path.dirname(os.path.abspath(__file__))
    model = read_model_config(os.path.join(here, "..", "configs", "models", "llama-3-8b"))
    if args.quick:
        model = dataclasses.replace(model, num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4,
                                    num_kv_heads=2, head_dim=64, vocab_size=1024)
    params = random_params(model, jnp.bfloat16)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    config = load_config().replace(attention=args.attention, num_pages=512 if args.quick else 4096)
    engine = build_engine(config=config, loaded=(model, params, None, ()))
    runner = engine.runner
    print(f"machine: {machine()}; 8B-shaped{' (cut down)' if args.quick else ''}, bfloat16, attention "
          f"{runner.attention.kernel}, context {args.context}")
    for rows in args.rows:
        inputs = decode_inputs(engine, rows, args.context)
        if inputs is None:
            print(f"rows {rows}: more pages than the pool holds, skipped")
            continue
        batch, sampling, shape = inputs
        seconds = timed(lambda: jax.device_get(runner.run(batch, sampling, shape)), 10)
        moved = weight_bytes + rows * args.context * runner.kv_bytes_per_token
        with tempfile.TemporaryDirectory() as trace:
            with jax.profiler.trace(trace, create_perfetto_trace=True):
                for _ in range(args.steps):
                    jax.device_get(runner.run(batch, sampling, shape))
            on_device, busy, ops = device_ops(trace, args.steps)
        where = f"device ops {busy:.2f} ms a step" if on_device else "no device lane: host spans (nested)"
        print(f"rows {rows}: step {seconds * 1e3:.2f} ms ({moved / seconds / 1e9:.0f} GB/s of weights + K/V); "
              f"{where}, the largest:")
        for name, ms, calls in ops[: args.top]:
            print(f"  {ms:8.3f} ms  x{calls:5.1f}  {name}")


if __name__ == "__main__":
    main()
