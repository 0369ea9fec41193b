"""SmolLM2 on this machine: load time, prefill and single-request decode speed, against the compute limit.

    .venv/bin/python -m bench.foundation [--model PATH.gguf] [--prompt-tokens 256] [--decode-tokens 128]

Prints each figure next to the machine's measured float32 matmul rate and the model's FLOPs per token,
so it also reads as a fraction of what the hardware could do.
"""

from __future__ import annotations

import argparse
import json
import time

from bench.common import machine, matmul_flops_per_s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from jaxcb.host.engine_config import make_config
    from jaxcb.host.request import SamplingParams
    from jaxcb.llm import LLM, load_model

    t0 = time.perf_counter()
    loaded = load_model(args.model)
    load_s = time.perf_counter() - t0
    cfg = loaded[0]
    p = args.prompt_tokens
    config = make_config(num_pages=256, max_context=1024, decode_batch=(1,), prefill_tokens=(p,))
    llm = LLM.from_params(*loaded[:3], config=config, eos_ids=loaded[3])
    prompt = [(i * 7919) % (cfg.vocab_size - 100) + 50 for i in range(p)]

    def timed(max_tokens):
        best = float("inf")
        for _ in range(args.repeats):
            t = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            best = min(best, time.perf_counter() - t)
        return best

    llm.warmup()
    prefill_s = timed(1)
    total_s = timed(args.decode_tokens + 1)
    decode_s = (total_s - prefill_s) / args.decode_tokens
    rate = matmul_flops_per_s()
    prefill_flops = sum(cfg.flops_per_token(i) for i in range(p)) / p
    decode_flops = cfg.flops_per_token(p + args.decode_tokens // 2)
    prefill_tps = p / prefill_s
    decode_tps = 1 / decode_s
    fig = {
        "machine": machine(),
        "model": cfg.name, "params": cfg.num_params,
        "load_s": round(load_s, 2),
        "matmul_gflops_f32": round(rate / 1e9, 1),
        "flops_per_token_g": round(cfg.flops_per_token(0) / 1e9, 3),
        "prefill_tokens_per_s": round(prefill_tps, 1),
        "prefill_fraction_of_limit": round(prefill_tps * prefill_flops / rate, 3),
        "decode_tokens_per_s": round(decode_tps, 1),
        "decode_fraction_of_limit": round(decode_tps * decode_flops / rate, 3),
        # Decoding one request reads every weight once per token: memory bound, not compute bound.
        "decode_weight_read_gb_s": round(decode_tps * cfg.num_params * 4 / 1e9, 1),
    }
    print(f"machine: {fig['machine']}")
    print(f"model: {cfg.name} ({cfg.num_params / 1e6:.1f}M params), {fig['flops_per_token_g']} GFLOP per token")
    print(f"measured float32 matmul: {fig['matmul_gflops_f32']} GFLOP/s")
    print(f"model load (GGUF read + dequantize): {load_s:.2f} s")
    print(f"prefill, {p}-token prompt: {prefill_tps:.1f} tokens/s = {fig['prefill_fraction_of_limit']:.1%} of the compute limit")
    print(f"decode, one request: {decode_tps:.1f} tokens/s = {fig['decode_fraction_of_limit']:.1%} of the compute limit")
    print(f"  (reads the float32 weights at {fig['decode_weight_read_gb_s']} GB/s: one request's decode is memory bound)")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
