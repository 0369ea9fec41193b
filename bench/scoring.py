"""Scoring prompts (prompt logprobs, lm-eval's loglikelihood calls) against plain prefill, SmolLM2 on this
machine.

    .venv/bin/python -m bench.scoring [--requests 48] [--min-len 64] [--max-len 384] [--trials 2] [--choices K]

Workload: `--requests` prompts cut from the held-out prose (tests/data/heldout_prose.txt) at lengths
spread over [--min-len, --max-len], all submitted at once, one output token each. Modes, interleaved on
one warmed-up runner: `plain` (no prompt logprobs: the prompt is prefilled in chunks of up to the prefill
budget), `scored` (SamplingParams(prompt_logprobs=1): every position but the last is sampled in the rows
the step's sequences leave spare, so at most max_running positions a step). Prints prompt tokens/s and
steps per mode, and checks the scores against jaxcb.device.evaluate.perplexity (a program that takes
every row's logits of one sequence, chunk by chunk): the largest difference of a prompt's mean NLL.

--choices K: lm-eval's multiple choice instead: each prompt is a context of --min-len..--max-len tokens and
one of K continuations of 8..24 tokens (--requests prompts in all), and a third mode, `scored, no cache`,
runs the scored prompts with prefix caching off (a scored page keeps its tokens' logprobs in the cache, so
with it each context is computed once).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import HELDOUT_PROSE, machine, warmed_engine, write_result


def workload(tokenizer, n: int, low: int, high: int, seed: int) -> list[list[int]]:
    ids = tokenizer.encode(open(HELDOUT_PROSE, encoding="utf-8").read())
    rng = np.random.default_rng(seed)
    out = []
    for length in np.linspace(low, high, n).astype(int):
        start = int(rng.integers(0, len(ids) - length))
        out.append(ids[start:start + length])
    return out


def choices_workload(tokenizer, n: int, k: int, low: int, high: int, seed: int) -> list[list[int]]:
    """n prompts: n // k contexts, each followed by k continuations from elsewhere in the text."""
    contexts = workload(tokenizer, max(1, n // k), low, high, seed)
    tails = workload(tokenizer, len(contexts) * k, 8, 24, seed + 1)
    return [c + tails[i * k + j] for i, c in enumerate(contexts) for j in range(k)]


def run(engine, prompts, scored: bool):
    from jaxcb.host.request import SamplingParams

    engine.reset_counters()
    compiled = engine.stats().compilations
    params = SamplingParams(max_tokens=1, prompt_logprobs=1 if scored else None)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    scores, steps = {}, 0
    while engine.has_work():
        steps += 1
        for ev in engine.step():
            if ev.prompt_logprobs is not None:
                scores[ev.request_id] = [lp for lp, _, _ in ev.prompt_logprobs]
    wall = time.perf_counter() - t0
    st = engine.stats()
    engine.pool.check_all_free()
    tokens = sum(map(len, prompts))
    return {"wall_s": round(wall, 2), "prompt_tokens_per_s": round(tokens / wall, 1), "steps": steps,
            "computed": st.prompt_tokens_computed, "compilations_after_warmup": st.compilations - compiled
            }, [scores.get(i) for i in ids]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--config", default=None)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--trials", type=int, default=2, help="runs per mode, interleaved; the fastest is shown")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--choices", type=int, default=0, help="lm-eval's multiple choice: K continuations a context")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from jaxcb.device.evaluate import perplexity
    from jaxcb.host.engine import Engine

    first, shapes, _ = warmed_engine(args.model, args.config)
    model_config, config, runner, tokenizer = first.model_config, first.config, first.runner, first.tokenizer
    eos = first.scheduler.eos_ids
    if args.choices:
        prompts = choices_workload(tokenizer, args.requests, args.choices, args.min_len, args.max_len, args.seed)
    else:
        prompts = workload(tokenizer, args.requests, args.min_len, args.max_len, args.seed)
    modes = ("plain", "scored") + (("scored, no cache",) if args.choices else ())
    trials, scores = {mode: [] for mode in modes}, None
    for _ in range(args.trials):
        for mode in modes:
            cfg = config.replace(prefix_caching=False) if mode.endswith("no cache") else config
            engine = Engine(runner, tokenizer, cfg, eos_ids=eos)
            figures, got = run(engine, prompts, mode != "plain")
            trials[mode].append(figures)
            scores = got if mode == "scored" else scores
    best = {mode: min(runs, key=lambda r: r["wall_s"]) for mode, runs in trials.items()}
    # The check: each prompt's mean NLL from its scores against evaluate.perplexity's (the runner's pages
    # are overwritten: no engine serves from it any more).
    diffs = []
    for p, s in zip(prompts, scores):
        want = perplexity(runner, p)["nll"]
        diffs.append(abs(-float(np.mean(s)) - want))
    result = {"machine": machine(), "model": model_config.name, "requests": args.requests,
              "prompt_tokens": sum(map(len, prompts)), "max_running": config.scheduler.max_running,
              "max_prefill_tokens": config.scheduler.max_prefill_tokens, "warmup_shapes": shapes, **best,
              "scored_over_plain": round(best["scored"]["prompt_tokens_per_s"] / best["plain"]["prompt_tokens_per_s"], 2),
              "max_mean_nll_difference": float(max(diffs)), "trials": trials}
    print(f"machine: {result['machine']}; model {model_config.name}; {args.requests} prompts of "
          f"{args.min_len}..{args.max_len} tokens ({result['prompt_tokens']} in all), one output token each, "
          f"max_running {result['max_running']}, prefill budget {result['max_prefill_tokens']}")
    if args.choices:
        print(f"multiple choice: {len(prompts) // args.choices} contexts x {args.choices} continuations of 8..24 tokens")
    print("| mode | prompt tokens/s | prompt tokens computed | steps | wall s | compilations after warm-up |")
    print("|---|---|---|---|---|---|")
    for mode in modes:
        r = best[mode]
        print(f"| {mode} | {r['prompt_tokens_per_s']:.1f} | {r['computed']} | {r['steps']} | {r['wall_s']:.2f} | "
              f"{r['compilations_after_warmup']} |")
    print(f"scored / plain prompt tokens/s: {result['scored_over_plain']:.2f}x; largest difference of a prompt's "
          f"mean NLL from evaluate.perplexity's: {result['max_mean_nll_difference']:.2e} nats")
    if args.choices:
        cached, uncached = best["scored"], best["scored, no cache"]
        result["scored_cache_speedup"] = round(cached["prompt_tokens_per_s"] / uncached["prompt_tokens_per_s"], 2)
        print(f"scored with the prefix cache / without: {result['scored_cache_speedup']:.2f}x prompt tokens/s, "
              f"{uncached['computed'] / cached['computed']:.2f}x fewer prompt tokens computed")
    write_result(result, args.json, echo=False)


if __name__ == "__main__":
    main()
