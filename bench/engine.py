"""Continuous vs static batching on a mixed workload, SmolLM2 on this machine.

    .venv/bin/python -m bench.engine [--requests 32] [--max-batch 32] [--trials 3] [--sweep] [--plot bench/results/throughput.png]
        [--peer BIN [--peer-slots 8]]

Workload: prompt lengths log-normal (median 75, clipped to 8..384), output lengths log-normal (median 45,
clipped to 4..192), EOS ignored, all requests submitted at once. Both modes run on the same engine,
after one warm-up that compiles every bucket, in the same process. Prints useful output tokens/s for
each mode and their ratio next to the ideal ratio (static slot-steps over useful tokens), the share of
the compute limit, compilations after warm-up, padding fraction, page utilisation and host-wait fraction.

With --peer (llama.cpp's `llama-server`, built by ../shared/peers/build-llama-server.sh), each trial also
sends the same requests (token ids, greedy, EOS ignored, all at once) to that server through
../shared/peers/llama_server_bench.py, interleaved with jaxcb's runs, and prints the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.common import machine, matmul_flops_per_s, read_rate, write_result
from serve.benchmark import workload  # the workload of every benchmark here (and of `jaxcb bench serve`)


def run(engine, prompts, output_lens):
    from jaxcb.host.request import SamplingParams

    engine.reset_counters()
    engine.step_log = []  # every step's tokens, rows and context: the roofline below
    compiled = engine.stats().compilations
    t0 = time.perf_counter()
    for p, n in zip(prompts, output_lens):
        engine.add_request(p, SamplingParams(max_tokens=int(n), ignore_eos=True))
    useful = 0
    while engine.has_work():
        useful += sum(len(ev.token_ids) for ev in engine.step())
    wall = time.perf_counter() - t0
    st = engine.stats()
    engine.pool.check_all_free()
    return {
        "wall_s": round(wall, 2), "useful_output_tokens": useful,
        "output_tokens_per_s": round(useful / wall, 2),
        "prompt_tokens_per_s": round(sum(map(len, prompts)) / wall, 2),
        "compilations_after_warmup": st.compilations - compiled,
        "padding_fraction": round(st.padding_fraction, 4), "page_utilization": round(st.page_utilization, 4),
        "host_wait_fraction": round(st.host_wait_fraction, 4), "preemptions": st.preemptions, "steps": st.steps,
        "step_log": engine.step_log,
    }


def roofline_s(runner, step_log, flops_per_s: float, bytes_per_s: float) -> float:
    """The least time these steps could take on this machine: each step at least its FLOPs at the
    matmul rate and at least its bytes (every matmul weight once, plus the live K/V its attention reads)
    at the read rate, whichever is longer. A workload whose steps mostly have few rows is bound by the
    weights' bytes, not by the matmul rate: this is the share of the compute limit that a perfect engine
    would reach on it. The output head's FLOPs count for the rows that sample (a step's rows), not for
    every prompt token; attention and K/V bytes span each sequence's whole context in every layer (for a
    model with sliding-window layers that overstates both, and the bound is looser)."""
    import jax

    cfg, params = runner.model_config, runner.params
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    if params.lm_head is not None:  # the embedding is only gathered from, a row a token
        weight_bytes -= params.embed.nbytes
    kv_bytes_per_token = sum(x.nbytes for x in jax.tree_util.tree_leaves(runner.kv_pages)) / (
        runner.num_pages * runner.page_size)
    head = 2 * cfg.hidden_size * cfg.vocab_size
    total = 0.0
    for rec in step_log:
        flops = (rec.tokens * (cfg.flops_per_token(0) - head) + rec.rows * head
                 + 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers * rec.attention_pairs)
        moved = weight_bytes + kv_bytes_per_token * rec.context
        total += max(flops / flops_per_s, moved / bytes_per_s)
    return total


PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "peers",
                           "llama_server_bench.py")


def run_peer(server: str, script: str, prompts, output_lens, slots: int) -> dict:
    """The same requests through llama.cpp's server: useful output tokens/s (its own JSON line)."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for p, n in zip(prompts, output_lens):
            f.write(json.dumps({"prompt_token_ids": p, "max_tokens": int(n)}) + "\n")
    try:
        out = subprocess.run([sys.executable, script, "--server", server, "--input", f.name, "--slots", str(slots)],
                             capture_output=True, text=True, check=True, timeout=3600)
    finally:
        os.unlink(f.name)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_s"] = result["seconds"]
    return result


def ideal_ratio(output_lens, max_batch):
    """Static slot-steps over useful tokens: each batch of max_batch decodes as long as its longest."""
    slot_steps = sum(len(output_lens[i:i + max_batch]) * max(output_lens[i:i + max_batch])
                     for i in range(0, len(output_lens), max_batch))
    return slot_steps / sum(output_lens)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--config", default=None)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trials", type=int, default=1,
                    help="run each mode this many times, interleaved, and report the median run (the CPU is noisy)")
    ap.add_argument("--sweep", action="store_true", help="also measure continuous throughput per max batch size")
    ap.add_argument("--plot", default=None, help="PNG of throughput against batch size (needs --sweep)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--peer", default=None, help="llama-server binary: run the same requests through it, interleaved")
    ap.add_argument("--peer-script", default=PEER_SCRIPT)
    ap.add_argument("--peer-slots", type=int, default=8)
    ap.add_argument("--baseline-attention", default=None, choices=["xla", "native"],
                    help="also run continuous batching with this attention (a second runner on the same weights), "
                         "interleaved: the engine-level gain of the attention the config picks")
    args = ap.parse_args()

    from jaxcb.host.engine import Engine
    from jaxcb.llm import build_engine

    first = build_engine(args.model, args.config)
    model_config, config = first.model_config, first.config
    assert config.scheduler.max_running >= args.max_batch, "the config must allow --max-batch running requests"

    def engine(max_running=None, **changes):  # engines over the first one's runner (its weights and pages)
        eng = Engine(first.runner, first.tokenizer, config.replace(**changes) if changes else config,
                     eos_ids=first.scheduler.eos_ids)
        if max_running is not None:  # below the largest bucket: a running limit, like the latency target's
            eng.scheduler.running_limit = max_running
        return eng

    t0 = time.perf_counter()
    shapes = engine().warmup()
    warmup_s = time.perf_counter() - t0
    first.runner.wait_for_huge_pages()  # timed once the weights and pages are in huge pages, as a server's are
    baseline = None
    if args.baseline_attention:
        from jaxcb.device.runner import ModelRunner

        r = first.runner
        runner = ModelRunner(r.model_config, r.params, r.num_pages, r.page_size, r.dtype, attention=args.baseline_attention,
                             max_seqs=config.buckets.max_batch, kv_dtype=r.kv_dtype)

        def baseline():
            eng = Engine(runner, first.tokenizer, config, eos_ids=first.scheduler.eos_ids)
            eng.scheduler.running_limit = args.max_batch
            return eng

        baseline().warmup()
    print(f"attention: {first.runner.attention.kernel}" + (f"; baseline {args.baseline_attention}" if baseline else ""),
          flush=True)
    prompts, output_lens = workload(args.requests, args.seed, model_config.vocab_size)

    trials = {"continuous": [], "static": []} | ({"peer": []} if args.peer else {}) | (
        {"baseline": []} if baseline else {})
    for _ in range(args.trials):
        trials["continuous"].append(run(engine(max_running=args.max_batch), prompts, output_lens))
        if baseline:
            trials["baseline"].append(run(baseline(), prompts, output_lens))
        trials["static"].append(run(engine(max_running=args.max_batch, static=True), prompts, output_lens))
        if args.peer:
            trials["peer"].append(run_peer(args.peer, args.peer_script, prompts, output_lens, args.peer_slots))
    median = lambda runs: sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]  # noqa: E731
    cont, stat = median(trials["continuous"]), median(trials["static"])
    rate = matmul_flops_per_s()
    read_bytes_per_s = read_rate()
    bound_s = roofline_s(first.runner, cont["step_log"], rate, read_bytes_per_s)
    for runs in trials.values():
        for r in runs:
            r.pop("step_log", None)
    tokens = sum(map(len, prompts)) + sum(output_lens)
    mean_context = np.mean([len(p) + n / 2 for p, n in zip(prompts, output_lens)])
    limit_tokens_per_s = rate / model_config.flops_per_token(int(mean_context))
    result = {
        "machine": machine(), "model": model_config.name, "attention": first.runner.attention.kernel, "requests": args.requests, "max_batch": args.max_batch,
        "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(output_lens),
        "warmup_shapes": shapes, "warmup_s": round(warmup_s, 1),
        "continuous": cont, "static": stat, "trials": args.trials,
        "walls_s": {k: [r["wall_s"] for r in v] for k, v in trials.items()},
        "ratio": round(cont["output_tokens_per_s"] / stat["output_tokens_per_s"], 3),
        "ideal_ratio": round(ideal_ratio(output_lens, args.max_batch), 3),
        "matmul_gflops_f32": round(rate / 1e9, 1),
        "compute_limit_tokens_per_s": round(limit_tokens_per_s, 1),
        "fraction_of_compute_limit": round(tokens / cont["wall_s"] / limit_tokens_per_s, 3),
        "read_gb_per_s": round(read_bytes_per_s / 1e9, 2), "roofline_s": round(bound_s, 2),
        "roofline_fraction_of_compute_limit": round(tokens / bound_s / limit_tokens_per_s, 3),
        "fraction_of_roofline": round(bound_s / cont["wall_s"], 3),
    }
    print(f"machine: {result['machine']}; model {model_config.name}; warm-up {shapes} shapes in {warmup_s:.0f} s")
    print(f"workload: {args.requests} requests, {result['prompt_tokens']} prompt + {result['output_tokens']} output tokens")
    for name in ("continuous", "static"):
        r = result[name]
        print(f"{name:>10}: {r['output_tokens_per_s']:7.1f} useful output tokens/s  wall {r['wall_s']:.1f} s  "
              f"padding {r['padding_fraction']:.1%}  pages used {r['page_utilization']:.1%}  "
              f"host wait {r['host_wait_fraction']:.1%}  compilations after warm-up {r['compilations_after_warmup']}  "
              f"preemptions {r['preemptions']}")
    print(f"continuous / static: {result['ratio']:.2f}x (ideal {result['ideal_ratio']:.2f}x); "
          f"median of {args.trials} interleaved runs each, walls {result['walls_s']}")
    if baseline:
        b = median(trials["baseline"])
        result["baseline"] = b | {"attention": args.baseline_attention}
        result["ratio_to_baseline"] = round(cont["output_tokens_per_s"] / b["output_tokens_per_s"], 3)
        print(f"{'baseline':>10}: {b['output_tokens_per_s']:7.1f} useful output tokens/s  wall {b['wall_s']:.1f} s  "
              f"(continuous, attention {args.baseline_attention}); continuous / baseline: {result['ratio_to_baseline']:.2f}x")
    if args.peer:
        peer = median(trials["peer"])
        result["peer"] = peer
        result["ratio_to_peer"] = round(cont["output_tokens_per_s"] / peer["output_tokens_per_s"], 3)
        print(f"{'peer':>10}: {peer['output_tokens_per_s']:7.1f} useful output tokens/s  wall {peer['wall_s']:.1f} s  "
              f"({peer['peer']}, its GGUF as shipped)")
        print(f"continuous / peer: {result['ratio_to_peer']:.2f}x (medians of {args.trials} interleaved runs)")
    print(f"compute limit: {rate / 1e9:.0f} GFLOP/s / {model_config.flops_per_token(int(mean_context)) / 1e9:.3f} GFLOP per "
          f"token = {limit_tokens_per_s:.0f} tokens/s; continuous ran (prompt + output) tokens at "
          f"{result['fraction_of_compute_limit']:.1%} of it")
    print(f"roofline (each step at least its FLOPs at {rate / 1e9:.0f} GFLOP/s and its weights + live K/V at the read "
          f"rate {read_bytes_per_s / 1e9:.1f} GB/s): {bound_s:.2f} s for the continuous run's {cont['steps']} "
          f"steps, i.e. at most {result['roofline_fraction_of_compute_limit']:.1%} of the compute limit on this workload; "
          f"continuous ran at {result['fraction_of_roofline']:.1%} of the roofline")

    if args.sweep:
        sweep = []
        for b in [x for x in config.buckets.decode_batch if x <= args.max_batch]:
            r = run(engine(max_running=b), prompts, output_lens)
            sweep.append({"max_batch": b, "output_tokens_per_s": r["output_tokens_per_s"],
                          "total_tokens_per_s": round(tokens / r["wall_s"], 1)})
            print(f"  max batch {b:3d}: {r['output_tokens_per_s']:7.1f} output tokens/s, "
                  f"{tokens / r['wall_s']:7.1f} prompt+output tokens/s")
        result["sweep"] = sweep
        if args.plot:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 4))
            xs = [s["max_batch"] for s in sweep]
            ax.plot(xs, [s["output_tokens_per_s"] for s in sweep], "o-", label="useful output tokens/s")
            ax.plot(xs, [s["total_tokens_per_s"] for s in sweep], "s--", label="prompt + output tokens/s")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("max running requests (batch)")
            ax.set_ylabel("tokens/s")
            ax.set_title(f"jaxcb continuous batching, {model_config.name.split()[0]}\n{result['machine']}", fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend()
            fig.tight_layout()
            fig.savefig(args.plot, dpi=120)
            print("wrote", args.plot)
    write_result(result, args.json)


if __name__ == "__main__":
    main()
