"""Warm-up and generation time of `model.compile = "optimized"` against `"fast"`, each in its own process.

    .venv/bin/python -m bench.compile_mode [--model tiny|smollm2] [--trials 1]

Each run builds an engine (buckets: decode 1 and 8, prefill 64), times `warmup()` (compiling 3 step
shapes, no persistent cache), then generates 32 tokens for 6 prompts and prints both times and a hash of
the tokens: the two modes must give the same hash.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.common import machine


def one(model: str, compile_mode: str) -> dict:
    import numpy as np

    from jaxcb.host.engine_config import make_config
    from jaxcb.host.request import SamplingParams
    from jaxcb.llm import LLM, load_model

    if model == "tiny":
        from jaxcb.model.config import tiny_config
        from tests.tiny_gguf import write_tiny_gguf

        path = os.path.join(tempfile.mkdtemp(), "tiny.gguf")
        write_tiny_gguf(path, tiny_config())
        loaded = load_model(path)
    else:
        loaded = load_model()
    cfg, params, tok, eos = loaded
    config = make_config(num_pages=64, max_context=256, decode_batch=(1, 8), prefill_tokens=(64,), compile=compile_mode)
    llm = LLM.from_params(cfg, params, tok, config=config, eos_ids=eos)
    t = time.perf_counter()
    llm.warmup()
    warmup = time.perf_counter() - t
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 40, 17, 90, 33, 1)]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    generate = time.perf_counter() - t
    llm.close()
    tokens = hashlib.md5(str([o.token_ids for o in outs]).encode()).hexdigest()[:12]
    return {"warmup_s": round(warmup, 2), "generate_s": round(generate, 2), "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--one", choices=("optimized", "fast"), help=argparse.SUPPRESS)  # a child process
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.model, args.one)))
        return
    print(f"# {machine()}; model {args.model}")
    print(f"{'compile':10} {'warm-up s':>10} {'generate s':>11}  tokens")
    for _ in range(args.trials):
        for mode in ("optimized", "fast"):  # interleaved, each in a fresh process (no compile cache)
            out = subprocess.run([sys.executable, "-m", "bench.compile_mode", "--model", args.model, "--one", mode],
                                 capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            r = json.loads(out)
            print(f"{mode:10} {r['warmup_s']:10.2f} {r['generate_s']:11.2f}  {r['tokens']}", flush=True)


if __name__ == "__main__":
    main()
