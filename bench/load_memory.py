"""Host memory and time of loading a model: each weights mode in a fresh process, until the weights are on their
devices (under --tensor-parallel N, host devices forced: each weight's slices).

    .venv/bin/python -m bench.load_memory --model PATH [--weights float32 bfloat16 int8] [--tensor-parallel 1]
        [--by-layer-above BYTES]

Reports per mode the seconds, the peak of the process's anonymous memory (RssAnon, sampled every 20 ms: the copies
the loader makes; a memory-mapped file's pages are RssFile, which the kernel can drop), the weights' bytes as
placed, and the peak over those bytes. The default model is the embedded SmolLM2 GGUF; a Hugging Face directory or
a converted checkpoint loads the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench.common import machine

_CHILD = r"""
import json, os, sys, threading, time
path, mode, tensor, by_layer = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
peak = {"RssAnon": 0, "RssFile": 0}
def watch():
    while True:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in peak:
                    peak[key] = max(peak[key], int(line.split()[1]) * 1024)
        time.sleep(0.02)
threading.Thread(target=watch, daemon=True).start()
import jax
from jaxcb.device.factory import float_weights_dtype
from jaxcb.llm import load_model
if by_layer != "default":
    from jaxcb.model import llama
    llama.LAYERWISE_BYTES = int(by_layer)
time.sleep(0.1)
base = dict(peak)
t0 = time.perf_counter()
mesh = None
if tensor > 1:
    from jaxcb.device.parallel import make_mesh
    mesh = make_mesh(tensor)
dtype = float_weights_dtype(mode) if mode in ("float32", "bfloat16") else None
path = None if path == "default" else path
try:
    params = load_model(path, dtype, weights=mode, **({"mesh": mesh} if mesh else {}))[1]
except TypeError:  # (a checkout from before the loader placed weights as it read them: onto one device, then split)
    from jaxcb.device.parallel import shard_params
    params = shard_params(load_model(path, dtype, weights=mode)[1], mesh)
jax.block_until_ready(params)
seconds = time.perf_counter() - t0
time.sleep(0.05)
placed = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
print(json.dumps({"seconds": seconds, "anon": peak["RssAnon"] - base["RssAnon"], "file": peak["RssFile"],
                  "placed": placed}))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--weights", nargs="+", default=["float32", "bfloat16", "int8"])
    ap.add_argument("--tensor-parallel", type=int, default=1)
    ap.add_argument("--by-layer-above", default="default",
                    help="build stacks larger than this many bytes (float32) a layer at a time (default: "
                         "jaxcb.model.llama.LAYERWISE_BYTES, 256 MiB)")
    args = ap.parse_args()
    env = dict(os.environ)
    if args.tensor_parallel > 1:
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.tensor_parallel}"
    print(f"# {machine()}; model {args.model}; tensor parallel {args.tensor_parallel}; stacks a layer at a time above "
          f"{args.by_layer_above} bytes")
    print("| weights | load s | peak anonymous MiB | weights placed MiB | peak / placed | file pages MiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode in args.weights:
        proc = subprocess.run([sys.executable, "-c", _CHILD, args.model, mode, str(args.tensor_parallel),
                               args.by_layer_above],
                              capture_output=True, text=True, env=env)
        if proc.returncode:
            print(f"| {mode} | failed: {proc.stderr.strip().splitlines()[-1]} |")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        mib = 1 << 20
        print(f"| {mode} | {r['seconds']:.1f} | {r['anon'] / mib:.0f} | {r['placed'] / mib:.0f} | "
              f"{r['anon'] / r['placed']:.2f} | {r['file'] / mib:.0f} |", flush=True)


if __name__ == "__main__":
    main()
