"""Model load time: the GGUF (read + dequantize) against its `jaxcb convert` orbax checkpoint.

    .venv/bin/python -m bench.load [--model M] [--dtype float32] [--repeats 3]

Converts the model into a temporary directory, then loads each form `--repeats` times (alternating,
file cache warm for both) until the weights are on the device, and reports the medians. Then checks
that greedy generation from both is identical on a few prompts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from bench.common import machine


def timed_load(path, dtype):
    import jax

    from jaxcb.llm import load_model

    t0 = time.perf_counter()
    loaded = load_model(path, dtype)
    jax.block_until_ready(jax.tree_util.tree_leaves(loaded[1]))
    return time.perf_counter() - t0, loaded


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import jax.numpy as jnp

    from jaxcb.cli import main as cli
    from jaxcb.host.engine_config import make_config
    from jaxcb.host.request import SamplingParams
    from jaxcb.llm import LLM
    from jaxcb.model.gguf_loader import default_model_path

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    gguf = args.model or default_model_path()
    with tempfile.TemporaryDirectory(prefix="jaxcb-convert-") as tmp:
        out = os.path.join(tmp, "model")
        assert cli(["convert", gguf, out, "--dtype", args.dtype]) == 0
        times = {"gguf": [], "orbax": []}
        loaded = {}
        for _ in range(args.repeats):
            for name, path in (("gguf", gguf), ("orbax", out)):
                t, loaded[name] = timed_load(path, dtype)
                times[name].append(t)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
        config = make_config(num_pages=512, max_context=512, decode_batch=(1, 2, 4), prefill_tokens=(32, 64, 128))
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        outs = {name: [o.token_ids for o in LLM(config=config, _loaded=loaded[name]).generate(prompts, params)]
                for name in loaded}
    g, o = statistics.median(times["gguf"]), statistics.median(times["orbax"])
    print(f"machine: {machine()}; model {os.path.basename(gguf)}, {args.dtype}")
    print(f"GGUF read + dequantize + to device: {g:.2f} s (runs {[round(t, 2) for t in times['gguf']]})")
    print(f"orbax checkpoint ({size / 2**20:.0f} MiB) restore to device: {o:.2f} s (runs "
          f"{[round(t, 2) for t in times['orbax']]})")
    print(f"converted loads {g / o:.1f}x faster; greedy outputs identical on {len(prompts)} prompts x 24 tokens: "
          f"{outs['gguf'] == outs['orbax']}")


if __name__ == "__main__":
    main()
