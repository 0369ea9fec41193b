"""Speculative decoding (jaxcb.host.speculative) against none, SmolLM2 on this machine, same process.

    python -m bench.speculative [--methods ngram draft] [--num-tokens 4] [--min-n N] [--draft-layers N]
        [--draft-weights W] [--draft-model M] [--trials 2] [--max-tokens 160] [--kinds grounded chat] [--quick]
        [--json PATH]

Engines on the same weights, each with its own KV pages: speculation off, n-gram proposals, and a draft
model's proposals (by default the target's first 8 layers, since no smaller model of its family is
embedded; jaxcb.host.draft).
Each runs, interleaved, `--trials` times:
1. Input-grounded chat tasks (rewrite, summarise or edit a given text; edit a given piece of code) and
   open chat questions, greedy, at batch 1 (one request at a time) and batch 4 (four at once): output
   tokens/s, acceptance rate, mean accepted length, p99 inter-token latency (the gap between a request's
   consecutive streamed events), and whether every output equals the other engine's token for token.
2. The engine benchmark's 32-request workload (bench.engine: all submitted at once, EOS ignored).
Also the compilations after warm-up (target 0). The median trial of each is reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from bench.common import machine, write_result

TEXTS = [
    "The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Several residents said the "
    "lanes made the street safer for children, while shop owners worried that the loss of parking spaces would "
    "hurt their business. The council agreed to count visitors to the shops for three months before deciding "
    "whether to keep the lanes.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide into "
    "glucose and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts, which "
    "contain the green pigment chlorophyll. The oxygen released is what most animals on Earth breathe.",
    "Our team will move to the new office on the fourth floor next Monday. Please pack your desk into the boxes "
    "provided by Friday afternoon and label each box with your name and new desk number. The IT department will "
    "reconnect all computers over the weekend, so you can start working as usual on Monday morning.",
    "The museum's new exhibition shows two hundred photographs taken by sailors during long voyages in the "
    "nineteenth century. Many pictures show daily life on board: cooking, repairing sails and playing cards. "
    "The exhibition is open every day except Monday until the end of March, and entry is free for students.",
]
CODE = [
    "def average(values):\n    total = 0\n    for v in values:\n        total = total + v\n    return total / len(values)\n",
    "def find_user(users, name):\n    for user in users:\n        if user['name'] == name:\n            return user\n"
    "    return None\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n"
    "        self.count = self.count + 1\n\n    def reset(self):\n        self.count = 0\n",
    "def read_lines(path):\n    f = open(path)\n    lines = f.readlines()\n    f.close()\n"
    "    return [line.strip() for line in lines]\n",
]
GROUNDED = ([f"Rewrite the following text in simpler words, keeping every fact:\n\n{t}" for t in TEXTS[:2]]
            + [f"Correct any mistakes and repeat the following text:\n\n{t}" for t in TEXTS[2:]]
            + [f"Summarise the following text in two sentences:\n\n{t}" for t in TEXTS[:2]]
            + [f"Add a docstring and type hints to this Python code and show the whole code:\n\n{c}" for c in CODE[:2]]
            + [f"Rename the variables of this Python code to clearer names and show the whole code:\n\n{c}"
               for c in CODE[2:]])
CHAT = [
    "What are three good habits for staying healthy?",
    "Explain why the sky is blue.",
    "Write a short poem about autumn.",
    "What should I pack for a weekend camping trip?",
    "How do I make a cup of tea?",
    "Give me some tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "Describe a typical day of a farmer.",
    "Why do cats purr?",
    "Suggest a name for a small coffee shop and explain it.",
    "How does a bicycle stay upright?",
    "What are the planets of the solar system?",
]


def run_tasks(engine, prompts, max_tokens: int, batch: int) -> dict:
    """`prompts` in groups of `batch` submitted together (each group after the last finished)."""
    from jaxcb.host.request import SamplingParams

    engine.reset_counters()
    compiled = engine.stats().compilations
    outputs, gaps, tokens = [], [], 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        times, ids = {}, {}
        for p in prompts[i:i + batch]:
            rid = engine.add_request(p, SamplingParams(max_tokens=max_tokens))
            times[rid], ids[rid] = [], []
        order = list(times)
        while engine.has_work():
            for ev in engine.step():
                if ev.token_ids:
                    times[ev.request_id].append(time.perf_counter())
                    ids[ev.request_id].extend(ev.token_ids)
        for rid in order:
            gaps.extend(b - a for a, b in zip(times[rid], times[rid][1:]))
            outputs.append(ids[rid])
            tokens += len(ids[rid])
    wall = time.perf_counter() - t0
    st = engine.stats()
    engine.pool.check_all_free()
    gaps.sort()
    return {"output_tokens_per_s": round(tokens / wall, 2), "output_tokens": tokens, "wall_s": round(wall, 2),
            "acceptance_rate": round(st.acceptance_rate, 3), "mean_accepted_length": round(st.mean_accepted_length, 3),
            "speculative_steps": st.speculative_steps, "steps": st.steps,
            "p99_itl_ms": round(1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 1) if gaps else None,
            "compilations_after_warmup": st.compilations - compiled, "outputs": outputs}


def run_workload(engine, prompts, output_lens) -> dict:
    from bench.engine import run

    engine.reset_counters()
    result = run(engine, prompts, output_lens)
    st = engine.stats()
    result.update(acceptance_rate=round(st.acceptance_rate, 3), mean_accepted_length=round(st.mean_accepted_length, 3),
                  speculative_steps=st.speculative_steps)
    return result


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["output_tokens_per_s"])[len(runs) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--config", default=None)
    ap.add_argument("--num-tokens", type=int, default=4)
    ap.add_argument("--min-n", type=int, default=None, help="the n-gram proposer's shortest suffix (default: its own)")
    ap.add_argument("--methods", nargs="+", default=["ngram", "draft"], help="speculation methods to run against off")
    ap.add_argument("--draft-model", default="", help="the draft model (default: the target's own weights)")
    ap.add_argument("--draft-layers", type=int, default=8, help="the draft keeps its first N layers (0 = all)")
    ap.add_argument("--draft-weights", default="auto", help="the draft's weights (auto, float32, bfloat16, int8, int4)")
    ap.add_argument("--fixed", action="store_true", help="keep every proposal (no adaptive back-off)")
    ap.add_argument("--kinds", nargs="+", default=["grounded", "chat"], help="task kinds to run")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4], help="requests submitted together")
    ap.add_argument("--no-workload", action="store_true", help="skip the engine workload")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32, help="the engine workload's requests")
    ap.add_argument("--quick", action="store_true", help="4 prompts of each kind, no engine workload")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from bench.engine import workload
    from jaxcb.device.factory import make_draft_runner
    from jaxcb.device.runner import ModelRunner
    from jaxcb.host.engine import Engine
    from jaxcb.host.speculative import SpeculativeConfig
    from jaxcb.llm import build_engine, load_draft

    first = build_engine(args.model, args.config)
    tok, config = first.tokenizer, first.config
    r = first.runner
    engines = {"off": first}
    specs = {}
    for method in args.methods:
        spec = SpeculativeConfig(method, num_tokens=args.num_tokens, adaptive=not args.fixed)
        if method == "ngram" and args.min_n is not None:
            spec = dataclasses.replace(spec, min_n=args.min_n)
        if method == "draft":
            spec = dataclasses.replace(spec, draft_model=args.draft_model, draft_layers=args.draft_layers,
                                       draft_weights=args.draft_weights)
        specs[method] = spec
        # a runner of its own on the same weights: each engine's KV pages and prefix cache are its own
        runner = ModelRunner(r.model_config, r.params, r.num_pages, r.page_size, r.dtype, attention=config.attention,
                             max_seqs=config.buckets.max_batch, kv_dtype=r.kv_dtype, compile=config.compile)
        draft = None
        if method == "draft":
            draft = make_draft_runner(runner, *load_draft(spec, r.model_config, r.params), config)
        engines[method] = Engine(runner, tok, config.replace(speculative=spec), eos_ids=first.scheduler.eos_ids,
                                 draft_runner=draft)
    t0 = time.perf_counter()
    for e in engines.values():
        e.warmup()
    print(f"warm-up: {time.perf_counter() - t0:.0f} s ({machine()}; {r.describe()})", flush=True)

    kinds = {k: v for k, v in {"grounded": GROUNDED, "chat": CHAT}.items() if k in args.kinds}
    if args.quick:
        kinds = {k: v[:4] for k, v in kinds.items()}
    prompts = {k: [tok.encode_chat([{"role": "user", "content": p}]) for p in v] for k, v in kinds.items()}
    results = {"machine": machine(), "speculative": {m: dataclasses.asdict(s) for m, s in specs.items()},
               "max_tokens": args.max_tokens,
               "trials": args.trials, "tasks": {}, "workload": {}}
    print(f"{'tasks':10} {'batch':>5} {'mode':6} {'tok/s':>7} {'ratio':>6} {'accept':>7} {'mean len':>8} "
          f"{'p99 ITL ms':>10} {'spec steps':>10} {'compiles':>8} {'exact':>5}")
    for kind, ps in prompts.items():
        for batch in args.batches:
            runs = {name: [] for name in engines}
            for _ in range(args.trials):
                for name, e in engines.items():
                    runs[name].append(run_tasks(e, ps, args.max_tokens, batch))
            med = {name: median_run(r) for name, r in runs.items()}
            exact = all(r["outputs"] == runs["off"][0]["outputs"] for rs in runs.values() for r in rs)
            for name, m in med.items():
                ratio = m["output_tokens_per_s"] / med["off"]["output_tokens_per_s"]
                print(f"{kind:10} {batch:5d} {name:6} {m['output_tokens_per_s']:7.1f} {ratio:6.2f} "
                      f"{m['acceptance_rate']:7.3f} {m['mean_accepted_length']:8.2f} {m['p99_itl_ms']:10.1f} "
                      f"{m['speculative_steps']:4d}/{m['steps']:<5d} "
                      f"{m['compilations_after_warmup']:8d} {str(exact):>5}", flush=True)
                m = {k: v for k, v in m.items() if k != "outputs"}
                results["tasks"].setdefault(kind, {}).setdefault(f"batch_{batch}", {})[name] = dict(m, ratio=round(ratio, 3))
            results["tasks"][kind][f"batch_{batch}"]["exact"] = exact

    if not args.quick and not args.no_workload:
        w_prompts, w_lens = workload(args.requests, 0, first.model_config.vocab_size)
        runs = {name: [] for name in engines}
        for _ in range(args.trials):
            for name, e in engines.items():
                runs[name].append(run_workload(e, w_prompts, w_lens))
        med = {name: median_run(r) for name, r in runs.items()}
        for name, m in med.items():
            ratio = m["output_tokens_per_s"] / med["off"]["output_tokens_per_s"]
            trials = " ".join(f"{r['output_tokens_per_s']:.1f}" for r in runs[name])
            print(f"workload {args.requests} requests, {name:6}: {m['output_tokens_per_s']:7.1f} tok/s (trials {trials})  "
                  f"ratio {ratio:.3f}  "
                  f"accept {m['acceptance_rate']:.3f}  mean len {m['mean_accepted_length']:.2f}  "
                  f"speculative steps {m['speculative_steps']}/{m['steps']}  compiles {m['compilations_after_warmup']}")
            results["workload"][name] = dict(m, ratio=round(ratio, 3),
                                             trials=[r["output_tokens_per_s"] for r in runs[name]])
    write_result(results, args.json, echo=False)


if __name__ == "__main__":
    main()
