"""Gemma 3 270M next to SmolLM2-135M on this machine, same run: decode tokens/s at batch 1 and 32, and
the KV memory a Gemma 3 sequence holds at context 4,096 with its sliding layers' pages freed as they
leave the window, against what it would hold if those layers kept every page.

    .venv/bin/python -m bench.families [--trials 3] [--json out.json]

Decode speed: B prompts of 128 random token ids, generated twice, to 1 token and to 1 + 64 tokens (EOS
ignored, greedy); decode tokens/s = B * 64 / (difference in wall time), so prefill is left out.
Trials alternate the models (these machines are noisy); the median is printed.
Memory: one request of 4,000 prompt tokens decoding to 4,096; the engine's held pages of each group at
the end, in bytes of the engine's dtype.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench.common import machine, write_result

MODELS = ("smollm2-135m", "gemma3-270m")


def engine_config(max_context=4224):
    from jaxcb.host.engine_config import make_config

    return make_config(num_pages=1200, page_size=16, max_context=max_context, decode_batch=(1, 32),
                       prefill_tokens=(128, 512), max_prefill_tokens=512)


def decode_rate(llm, batch: int, vocab: int, seed: int) -> float:
    from jaxcb.host.request import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, vocab - 100, size=128).tolist() for _ in range(batch)]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    t1 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=65, ignore_eos=True))
    t2 = time.perf_counter()
    return batch * 64 / ((t2 - t1) - (t1 - t0))


def window_memory(llm) -> dict:
    """Held pages of one sequence at context 4,096 (4,000 prompt tokens + 96 decoded)."""
    from jaxcb.host.request import SamplingParams

    engine, c = llm.engine, llm.model_config
    rng = np.random.default_rng(7)
    engine.add_request(rng.integers(100, c.vocab_size - 100, size=4000).tolist(),
                       SamplingParams(max_tokens=96, ignore_eos=True))
    held = None
    while engine.has_work():
        engine.step()
        for r in engine.scheduler.running:
            if r.num_computed == 4096 - 1:
                held = (len(r.page_ids), engine.window_group.held(r))
    full_pages, window_pages = held
    page_layer_bytes = engine.config.page_size * 2 * c.num_kv_heads * c.head_dim * np.dtype(engine.runner.dtype).itemsize
    freed = (full_pages * c.num_full_layers + window_pages * c.num_sliding_layers) * page_layer_bytes
    kept = full_pages * c.num_layers * page_layer_bytes
    return {"context": 4096, "full_pages": full_pages, "sliding_pages": window_pages, "bytes_freeing": int(freed),
            "bytes_keeping_all": int(kept), "ratio": kept / freed, "dtype": str(np.dtype(engine.runner.dtype))}


def main():
    from jaxcb.llm import LLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(machine())
    llms = {}
    for name in MODELS:
        t0 = time.perf_counter()
        llms[name] = LLM(name, config=engine_config())
        llms[name].engine.warmup()
        print(f"{name}: loaded and warmed up in {time.perf_counter() - t0:.0f}s", flush=True)
    rates = {(m, b): [] for m in MODELS for b in (1, 32)}
    for trial in range(args.trials):
        for b in (1, 32):
            for m in MODELS:
                rates[m, b].append(decode_rate(llms[m], b, llms[m].model_config.vocab_size, trial))
        print(f"trial {trial + 1}: " + ", ".join(f"{m} b{b} {v[-1]:.1f}" for (m, b), v in rates.items()), flush=True)
    result = {"machine": machine(), "decode_tokens_per_s": {}}
    for b in (1, 32):
        row = {m: statistics.median(rates[m, b]) for m in MODELS}
        result["decode_tokens_per_s"][f"batch{b}"] = row
        print(f"decode batch {b:2d}: " + "  ".join(f"{m} {v:7.1f} tok/s" for m, v in row.items())
              + f"  (gemma3 / smollm2 = {row['gemma3-270m'] / row['smollm2-135m']:.2f})")
    mem = window_memory(llms["gemma3-270m"])
    result["gemma3_kv_at_4096"] = mem
    print(f"Gemma 3 KV of one sequence at context 4096 ({mem['dtype']}): {mem['full_pages']} full pages x 3 layers + "
          f"{mem['sliding_pages']} sliding pages x 15 layers = {mem['bytes_freeing'] / 2**20:.1f} MiB; keeping every "
          f"sliding page: {mem['bytes_keeping_all'] / 2**20:.1f} MiB ({mem['ratio']:.2f}x)")
    write_result(result, args.json, echo=False)


if __name__ == "__main__":
    main()
