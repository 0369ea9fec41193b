"""Prefix caching on and off, on a workload that shares one system prompt, SmolLM2 on this machine.

    .venv/bin/python -m bench.prefix [--requests 64] [--system 256] [--output 32] [--trials 1]

Workload: `--requests` prompts, each the same `--system`-token system prompt followed by a distinct
question of 16..64 tokens, `--output` tokens each (EOS ignored), all submitted at once. Both modes run
in the same process on the same warmed-up runner. Prints, per mode: prompt tokens actually computed,
mean and p90 time to first token, output tokens/s, and how many copies of the system prompt's pages
were held at once (the most distinct pages at any system-prompt page position, over all steps).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import machine, warmed_engine, write_result


def workload(n: int, system_len: int, seed: int, vocab: int):
    rng = np.random.default_rng(seed)
    system = rng.integers(100, vocab - 100, size=system_len).tolist()
    return [system + rng.integers(100, vocab - 100, size=int(rng.integers(16, 65))).tolist() for _ in range(n)]


def run(engine, prompts, output_len: int, system_pages: int):
    from jaxcb.host.request import SamplingParams

    engine.reset_counters()
    compiled = engine.stats().compilations
    t0 = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(max_tokens=output_len, ignore_eos=True)) for p in prompts]
    first_token: dict[str, float] = {}
    copies = 0
    tokens = 0
    while engine.has_work():
        for ev in engine.step():
            tokens += len(ev.token_ids)
            if ev.token_ids and ev.request_id not in first_token:
                first_token[ev.request_id] = time.perf_counter() - t0
        held = [set() for _ in range(system_pages)]
        for r in engine.scheduler.running:
            for i, page in enumerate(r.page_ids[:system_pages]):
                held[i].add(page)
        copies = max(copies, max(len(h) for h in held))
    wall = time.perf_counter() - t0
    st = engine.stats()
    engine.pool.check_all_free()
    ttft = np.array([first_token[i] for i in ids])
    return {
        "prompt_tokens_computed": st.prompt_tokens_computed, "prefix_cache_hits": st.prefix_cache_hits,
        "ttft_mean_s": round(float(ttft.mean()), 3), "ttft_p90_s": round(float(np.percentile(ttft, 90)), 3),
        "output_tokens_per_s": round(tokens / wall, 1), "wall_s": round(wall, 2),
        "system_prompt_copies_held": copies, "compilations_after_warmup": st.compilations - compiled,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--config", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system", type=int, default=256, help="tokens of the shared system prompt")
    ap.add_argument("--output", type=int, default=32, help="output tokens per request")
    ap.add_argument("--trials", type=int, default=1, help="runs per mode, interleaved; the median run is shown")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from jaxcb.host.engine import Engine

    first, shapes, warmup_s = warmed_engine(args.model, args.config)
    model_config, config, runner, tokenizer = first.model_config, first.config, first.runner, first.tokenizer
    eos = first.scheduler.eos_ids
    prompts = workload(args.requests, args.system, args.seed, model_config.vocab_size)
    system_pages = args.system // config.page_size

    trials = {"on": [], "off": []}
    for _ in range(args.trials):
        for mode in ("off", "on"):
            engine = Engine(runner, tokenizer, config.replace(prefix_caching=mode == "on"), eos_ids=eos)
            trials[mode].append(run(engine, prompts, args.output, system_pages))
    median = lambda runs: sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]  # noqa: E731
    on, off = median(trials["on"]), median(trials["off"])
    result = {
        "machine": machine(), "model": model_config.name, "requests": args.requests,
        "system_tokens": args.system, "prompt_tokens": sum(map(len, prompts)), "output_tokens": args.output,
        "max_running": config.scheduler.max_running, "warmup_shapes": shapes, "warmup_s": round(warmup_s, 1),
        "on": on, "off": off, "trials": args.trials,
        "computed_ratio": round(off["prompt_tokens_computed"] / on["prompt_tokens_computed"], 2),
        "ttft_mean_ratio": round(off["ttft_mean_s"] / on["ttft_mean_s"], 2),
        "throughput_ratio": round(on["output_tokens_per_s"] / off["output_tokens_per_s"], 2),
    }
    print(f"machine: {result['machine']}; model {model_config.name}; warm-up {shapes} shapes in {warmup_s:.0f} s")
    print(f"workload: {args.requests} requests = {args.system}-token shared system prompt + 16..64-token question, "
          f"{args.output} output tokens each; {result['prompt_tokens']} prompt tokens in all")
    print("| prefix cache | prompt tokens computed | mean TTFT s | p90 TTFT s | output tokens/s | system prompt copies held |")
    print("|---|---|---|---|---|---|")
    for name, r in (("off", off), ("on", on)):
        print(f"| {name} | {r['prompt_tokens_computed']} | {r['ttft_mean_s']:.2f} | {r['ttft_p90_s']:.2f} | "
              f"{r['output_tokens_per_s']:.1f} | {r['system_prompt_copies_held']} |")
    print(f"off/on prompt tokens computed: {result['computed_ratio']:.2f}x fewer; mean TTFT {result['ttft_mean_ratio']:.2f}x "
          f"lower; output tokens/s {result['throughput_ratio']:.2f}x; compilations after warm-up: "
          f"{on['compilations_after_warmup']} (on), {off['compilations_after_warmup']} (off)")
    write_result(result, args.json, echo=False)


if __name__ == "__main__":
    main()
