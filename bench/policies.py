"""Every scheduling policy on the same arrival traces, SmolLM2 on this machine; then the simulator
checked against those runs.

    .venv/bin/python -m bench.policies [--requests 32] [--out bench/results/policies] [--plot] [--save-step-model]
    .venv/bin/python -m bench.policies --sweep [--out bench/results/policies]
    .venv/bin/python -m bench.policies --simulate-device h200 [--sim-requests 100000] [--sim-rate 50]

Traces (written to OUT/traces/*.jsonl in `jaxcb simulate`'s format): prompts from three length classes
(60% 16-127 tokens, 30% 128-512, 10% 513-768; 30% of them start with one of two shared 64-token
prefixes), output lengths log-normal (median 32, 8-192, EOS ignored), 20% of requests at priority 5.
Arrivals: Poisson at 0.5x, 0.9x and 1.3x the capacity measured first (every request at once, FCFS),
and a bursty trace (bursts of 8 within about a second, 0.8x capacity on average).

Runs, one engine's weights and pages, warmed up once (no compilation after): every policy on every
trace with a running limit of 8 (--policy-limit: with more slots than requests in the system, nobody
waits for a slot and the policies differ only in who prefills first); FCFS with a batching window
(max_wait_ms 10 and 50: new prefills wait until 4 are queued or the oldest has waited that long) on
the near-capacity and bursty traces; on the near and above-capacity traces, FCFS at fixed running
limits 4, 8, 16 and 32 and the latency controller (max 32) with a TPOT target just above what the
limit-8 run achieved. Per run: output
tokens/s, requests/s, TTFT p50/p99, TPOT p50/p99, end-to-end p99, the longest wait for a first slot,
preemptions, round-robin switches and recomputed tokens, padding.

Then the step-time model: fitted to the FCFS runs' steps (Engine.step_log), its error on every run's
steps, written to OUT/step_model.json (and, with --save-step-model, to the built-in
jaxcb/sim/step_models/smollm2-135m-cpu.json); and every run simulated (jaxcb.sim.simulate) on the same trace
and configuration, with the error of throughput and p99 latencies against the real run.

--simulate-device: the same kind of trace (N requests, Poisson at R/s) through `jaxcb.sim.simulate` with a
roofline of the device serving an 8B Llama (configs/sim-h200-llama8b.toml): every policy, the window,
and latency targets; no JAX, no model.

--sweep: the running limit at 1, 4, 8, 16, 32, 64, 128 on a closed batch (2 x limit requests, at least
8, all at once, prompts 64-128 tokens, 64 output tokens): throughput, TPOT and end-to-end p50/p99,
peak KV memory (pages in use x page bytes) and the largest step's temporaries (the memory plan).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import os
import random
import time

from bench.common import machine
from jaxcb.sim.trace import RequestRecord, TraceRequest, prompt_ids, summarize, write_trace

POLICIES = ("fcfs", "sjf", "priority", "length-buckets", "round-robin")
CLASSES = ((0.6, 16, 127), (0.3, 128, 512), (0.1, 513, 768))
VOCAB_SEED = 11


def draw_request(rng: random.Random, arrival: float) -> TraceRequest:
    u, acc = rng.random(), 0.0
    for p, lo, hi in CLASSES:
        acc += p
        if u <= acc:
            break
    prompt = rng.randint(lo, hi)
    output = int(min(192, max(8, round(math.exp(rng.gauss(math.log(32), 0.8))))))
    prefix = rng.choice((0, 1)) if rng.random() < 0.3 else None
    return TraceRequest(arrival, prompt, output, priority=5 if rng.random() < 0.2 else 0, prefix_id=prefix,
                        prefix_tokens=min(64, prompt) if prefix is not None else 0)


def poisson_trace(n: int, rate: float, seed: int) -> list[TraceRequest]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(draw_request(rng, t))
        t += rng.expovariate(rate)
    return out


def bursty_trace(n: int, rate: float, seed: int, burst: int = 8) -> list[TraceRequest]:
    """Bursts of `burst` requests (gaps of ~0.1 s inside), the bursts Poisson: `rate` requests/s on average."""
    rng, start, out = random.Random(seed), 0.0, []
    while len(out) < n:
        t = start
        for _ in range(min(burst, n - len(out))):
            out.append(draw_request(rng, t))
            t += rng.expovariate(10.0)
        start += rng.expovariate(rate / burst)
    return out


def replay(engine, trace: list[TraceRequest], ids: list[list[int]], record_steps: bool = True) -> dict:
    """Run a trace on an engine in real time (this thread drives the engine, as the server's engine
    thread does): each request is submitted at its arrival time; returns summarize()'s figures."""
    from jaxcb.host.request import SamplingParams

    records = [RequestRecord(t.arrival_s) for t in trace]
    engine.reset_counters()
    engine.step_log = [] if record_steps else None
    compiled = engine.stats().compilations
    t0 = time.monotonic()

    def callback(k):
        def on_event(ev):
            now, rec = time.monotonic() - t0, records[k]
            if ev.queue_s is not None:
                rec.scheduled = rec.arrival + ev.queue_s
            if rec.first_token is None and ev.token_ids:
                rec.first_token = now
            if ev.finished:
                rec.finished, rec.output_tokens = now, ev.num_output_tokens
        return on_event

    i, n = 0, len(trace)
    while i < n or engine.has_work():
        now = time.monotonic() - t0
        while i < n and trace[i].arrival_s <= now:
            t = trace[i]
            engine.add_request(ids[i], SamplingParams(max_tokens=t.output_tokens, ignore_eos=True),
                               priority=t.priority, arrival_time=t0 + t.arrival_s, callback=callback(i))
            i += 1
        if not engine.has_work():
            time.sleep(max(0.0, trace[i].arrival_s - (time.monotonic() - t0)))
            continue
        engine.step()
        if engine.last_step_idle:  # a batching window is closed: wait for it or for the next arrival
            nxt = trace[i].arrival_s - (time.monotonic() - t0) if i < n else 0.05
            time.sleep(max(0.0005, min(engine.scheduler.admission_wait_s(), nxt, 0.05)))
    engine.pool.check_all_free()
    st, sched = engine.stats(), engine.scheduler
    out = summarize(records, preemptions=sched.num_preemptions, switches=sched.num_switches,
                    recomputed_tokens=sched.num_recomputed_tokens,
                    padding_fraction=round(st.padding_fraction, 4),
                    compilations_after_warmup=st.compilations - compiled)
    if sched.controller is not None:
        out["controller"] = {"final_running_limit": sched.running_limit,
                             "final_prefill_budget": sched.controller.prefill_budget,
                             "adjustments": sched.controller.num_adjustments}
    out["_steps"] = None if engine.step_log is None else [dataclasses.asdict(s) for s in engine.step_log]
    engine.step_log = None
    return out


def real_runs(args, first, make_engine, traces, ids) -> list[dict]:
    runs = []

    def run(trace_name, label, changes=None, max_running=None):
        eng = make_engine(max_running=max_running, **(changes or {}))
        r = replay(eng, traces[trace_name], ids[trace_name])
        r.update(trace=trace_name, run=label, changes=changes or {}, max_running=max_running)
        runs.append(r)
        print(f"  {trace_name:>6} {label:<24} {r['output_tokens_per_s']:7.1f} tok/s  TTFT p99 {r['ttft_p99_s']:6.2f} s  "
              f"TPOT p99 {r['tpot_p99_s'] * 1000:6.1f} ms  e2e p99 {r['e2e_p99_s']:6.2f} s  max wait "
              f"{r['max_wait_s']:6.2f} s  preempt {r['preemptions']} switch {r['switches']}", flush=True)
        return r

    limit = args.policy_limit
    for name in traces:
        for policy in POLICIES:
            run(name, policy, {"policy": policy}, max_running=limit)
    for name in ("near", "bursty"):
        for wait in (10.0, 50.0):
            run(name, f"fcfs window {wait:g} ms", {"max_wait_ms": wait, "min_batch": 4}, max_running=limit)
    for name in ("near", "above"):
        fixed = {limit: next(r for r in runs if r["trace"] == name and r["run"] == "fcfs")}
        for fixed_limit in (4, 8, 16, 32):
            if fixed_limit not in fixed:
                fixed[fixed_limit] = run(name, f"fcfs fixed limit {fixed_limit}", max_running=fixed_limit)
        target_ms = round(fixed[8]["tpot_p99_s"] * 1000 * 1.05, 1)
        run(name, f"fcfs target {target_ms:g} ms", {"target_p99_tpot_ms": target_ms})
    return runs


def fit_and_simulate(args, config, runs, traces, vocab):
    """Fit the step-time model to the FCFS runs' steps, write it, and simulate every run with it."""
    from jaxcb.sim.simulate import FittedStepModel

    fcfs_steps = [s for r in runs if r["run"] == "fcfs" for s in r["_steps"]]
    model = FittedStepModel.fit(fcfs_steps, info={"machine": machine(), "model": "SmolLM2-135M-Instruct float32",
                                                  "fitted_on": "bench/policies.py FCFS runs"})
    fit = {"in_sample_fcfs": model.error(fcfs_steps),
           "out_of_sample_other_runs": model.error([s for r in runs if r["run"] != "fcfs" for s in r["_steps"]]),
           "per_context_token_s": model.per_context_token, "per_extra_pair_s": model.per_extra_pair,
           "intercepts_s": dict(zip(model.buckets, model.intercepts))}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "step_model.json"), "w") as f:
        json.dump(model.to_json(), f, indent=1)
    if args.save_step_model:
        from jaxcb.sim.simulate import BUILTIN_STEP_MODEL

        with open(BUILTIN_STEP_MODEL, "w") as f:
            json.dump(model.to_json(), f, indent=1)
    return fit, [simulate_run(r, traces[r["trace"]], config, model, vocab) for r in runs]


def simulate_run(r: dict, trace, config, model, vocab) -> dict:
    """One real run's twin on the simulator (same trace, settings and running limit) and its errors."""
    from jaxcb.sim.simulate import simulate

    s = simulate(trace, config.replace(**r["changes"]), model, vocab=vocab, seed=VOCAB_SEED,
                 max_running=r["max_running"])
    return {"trace": r["trace"], "run": r["run"], "sim": s, "error": errors(s, r)}


ERROR_KEYS = ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "e2e_p99_s")


def errors(sim: dict, real: dict) -> dict:
    return {k: round(sim[k] / real[k] - 1, 4) if real[k] else None for k in ERROR_KEYS}


def error_summary(sims: list[dict], limit: float = 0.15) -> dict:
    """Per figure: runs within `limit`, median and worst absolute error."""
    out = {}
    for k in ERROR_KEYS:
        v = sorted(abs(x["error"][k]) for x in sims if x["error"].get(k) is not None)
        if v:
            out[k] = {"within": sum(e <= limit for e in v), "runs": len(v), "median": round(v[len(v) // 2], 4),
                      "worst": round(v[-1], 4)}
    return out


def save_steps(out_dir: str, runs: list[dict]) -> None:
    """Every real run's recorded steps (Engine.step_log), for refitting the step model offline."""
    steps = {f"{r['trace']}/{r['run']}": r["_steps"] for r in runs if r.get("_steps") is not None}
    with gzip.open(os.path.join(out_dir, "steps.json.gz"), "wt") as f:
        json.dump(steps, f)


def load_steps(out_dir: str, runs: list[dict]) -> None:
    with gzip.open(os.path.join(out_dir, "steps.json.gz"), "rt") as f:
        steps = json.load(f)
    for r in runs:
        r["_steps"] = steps[f"{r['trace']}/{r['run']}"]


def resimulate(args):
    """No JAX: refit the step model to the saved steps, simulate every saved run (and the validation
    runs, if any) again, and rewrite the simulated part of the results."""
    from jaxcb.host.engine_config import load_config
    from jaxcb.sim.simulate import load_step_model, simulate
    from jaxcb.sim.trace import read_trace

    path = os.path.join(args.out, "results.json")
    with open(path) as f:
        res = json.load(f)
    runs = res["runs"]
    load_steps(args.out, runs)
    config = load_config(None).replace(num_pages=res["num_pages"])
    traces = {r["trace"]: read_trace(os.path.join(args.out, "traces", f"{r['trace']}.jsonl")) for r in runs}
    res["step_model_fit"], res["simulated"] = fit_and_simulate(args, config, runs, traces, res["vocab"])
    res["simulator_error"] = error_summary(res["simulated"])
    for r in runs:
        del r["_steps"]
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"step model: in-sample {res['step_model_fit']['in_sample_fcfs']}, other runs "
          f"{res['step_model_fit']['out_of_sample_other_runs']}")
    print_errors(res["simulated"])
    model = load_step_model(os.path.join(args.out, "step_model.json"))
    for name in sorted(os.listdir(args.out)):
        if not (name.startswith("validate-") and name.endswith(".json")):
            continue
        vpath = os.path.join(args.out, name)
        with open(vpath) as f:
            val = json.load(f)
        for v in val["runs"]:
            trace = read_trace(os.path.join(args.out, "traces", f"validate-{v['trace']}-{v['requests']}.jsonl"))
            v["sim"] = simulate(trace, config, model, vocab=res["vocab"], seed=VOCAB_SEED,
                                max_running=val["policy_limit"])
            compare_validation(v)
        with open(vpath, "w") as f:
            json.dump(val, f, indent=1)
        print(name)
        print_validation(val["runs"])


def print_errors(sims: list[dict]) -> None:
    for s in sims:
        print(f"  sim {s['trace']:>6} {s['run']:<24} error: " + "  ".join(f"{k} {v:+.1%}" for k, v in s["error"].items()
                                                                       if v is not None))
    for k, v in error_summary(sims).items():
        print(f"  {k:<20} within 15% on {v['within']}/{v['runs']} runs, median {v['median']:.1%}, worst {v['worst']:.1%}")


def sweep(args):
    from jaxcb.host.engine import Engine
    from jaxcb.host.engine_config import make_config
    from jaxcb.host.memory_plan import plan
    from jaxcb.llm import build_engine

    limits = (1, 4, 8, 16, 32, 64, 128)
    config = make_config(num_pages=4096, max_context=1024, decode_batch=limits, prefill_tokens=(64, 128, 256, 512))
    first = build_engine(None, config)
    t0 = time.perf_counter()
    first.warmup()
    print(f"warm-up {time.perf_counter() - t0:.0f} s", flush=True)
    c = first.model_config
    rng = random.Random(5)
    out = []
    for limit in limits:
        n = max(8, 2 * limit)
        trace = [TraceRequest(0.0, rng.randint(64, 128), 64) for _ in range(n)]
        ids = prompt_ids(trace, c.vocab_size, seed=limit)
        eng = Engine(first.runner, first.tokenizer, config.replace(prefix_caching=False), eos_ids=first.scheduler.eos_ids)
        eng.scheduler.running_limit = limit
        peak = [0]
        step = eng.step

        def counting_step(step=step, eng=eng, peak=peak):
            events = step()
            peak[0] = max(peak[0], eng.pool.num_in_use)
            return events

        eng.step = counting_step
        r = replay(eng, trace, ids, record_steps=True)
        steps = r.pop("_steps")
        e2e = r["e2e_p99_s"]
        mp = plan(budget_bytes=1 << 40, fraction=1.0, weight_bytes=0, num_layers=c.num_layers,
                  num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, hidden_size=c.hidden_size,
                  intermediate_size=c.intermediate_size, vocab_size=c.vocab_size, dtype_bytes=4, page_size=16,
                  max_context=1024, max_batch=limit, max_prefill_tokens=512, num_heads=c.num_heads)
        row = {"running": limit, "requests": n, "output_tokens_per_s": r["output_tokens_per_s"],
               "tpot_p50_s": r["tpot_p50_s"], "tpot_p99_s": r["tpot_p99_s"], "e2e_p50_s": r["e2e_p50_s"], "e2e_p99_s": e2e,
               "peak_kv_bytes": peak[0] * mp.page_bytes, "step_temporaries_bytes": mp.reserve_bytes,
               "decode_step_s": _median([s["seconds"] for s in steps if s["seconds"] and s["decode_rows"] == s["rows"]
                                         and s["rows"] == limit])}
        out.append(row)
        print(f"  running {limit:>3}: {row['output_tokens_per_s']:7.1f} tok/s  TPOT p50 {row['tpot_p50_s'] * 1000:6.1f} ms "
              f"p99 {row['tpot_p99_s'] * 1000:6.1f} ms  e2e p99 {e2e:6.2f} s  peak KV {row['peak_kv_bytes'] / 2**20:7.1f} MiB  "
              f"step temporaries {row['step_temporaries_bytes'] / 2**20:6.1f} MiB", flush=True)
    # The knee: the first limit from which the next one adds less than a quarter of a proportional gain.
    knee = None
    for a, b in zip(out, out[1:]):
        gain = b["output_tokens_per_s"] / a["output_tokens_per_s"] - 1
        if knee is None and gain < 0.25 * (b["running"] / a["running"] - 1):
            knee = a["running"]
    result = {"machine": machine(), "rows": out, "knee_running": knee}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"knee: running {knee}")
    print(json.dumps(result))


def simulate_device(args):
    from jaxcb.host.engine_config import load_config
    from jaxcb.sim.simulate import DEVICES, MODELS, RooflineStepModel

    model = RooflineStepModel(DEVICES[args.simulate_device], MODELS["llama-3-8b"])
    config = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs",
                                      "sim-h200-llama8b.toml"))
    config = config.replace(num_pages=model.num_pages(config.page_size))
    trace = poisson_trace(args.sim_requests, args.sim_rate, args.seed + 10)
    os.makedirs(os.path.join(args.out, "traces"), exist_ok=True)
    write_trace(os.path.join(args.out, "traces", f"{args.simulate_device}-{args.sim_requests}.jsonl"), trace)
    runs = [(p, {"policy": p}) for p in POLICIES]
    runs += [(f"fcfs window {w:g} ms", {"max_wait_ms": w, "min_batch": 8}) for w in (10.0, 50.0)]
    runs += [(f"fcfs target {t:g} ms", {"target_p99_tpot_ms": t}) for t in args.sim_targets]
    print(f"{len(trace)} requests at {args.sim_rate} req/s on a simulated {model.device.name}, Llama 3 8B bfloat16, "
          f"{config.num_pages} pages of {config.page_size}", flush=True)
    import multiprocessing

    jobs = [(trace, config.replace(**changes), model, label) for label, changes in runs]
    with multiprocessing.get_context("fork").Pool(args.sim_jobs) as pool:
        table = pool.map(_simulate_job, jobs)
    for r in table:
        label = r["run"]
        print(f"  {label:<24} {r['output_tokens_per_s']:8.0f} tok/s  TTFT p50/p99 {r['ttft_p50_s'] * 1000:6.0f}/"
              f"{r['ttft_p99_s'] * 1000:6.0f} ms  TPOT p50/p99 {r['tpot_p50_s'] * 1000:5.1f}/{r['tpot_p99_s'] * 1000:5.1f} ms"
              f"  e2e p99 {r['e2e_p99_s']:6.2f} s  max wait {r['max_wait_s']:6.2f} s  preempt {r['preemptions']}"
              f"  switches {r['switches']}  wall {r['wall_s']:.0f} s", flush=True)
    result = {"device": model.to_json(), "config": "configs/sim-h200-llama8b.toml", "num_pages": config.num_pages,
              "requests": args.sim_requests, "rate": args.sim_rate, "runs": table}
    with open(os.path.join(args.out, f"simulated-{args.simulate_device}-{args.sim_rate:g}.json"), "w") as f:
        json.dump(result, f, indent=1)


def rerun(args, first, config, make_engine):
    from jaxcb.sim.simulate import load_step_model
    from jaxcb.sim.trace import read_trace

    path = os.path.join(args.out, "results.json")
    with open(path) as f:
        res = json.load(f)
    load_steps(args.out, res["runs"])
    model = load_step_model(os.path.join(args.out, "step_model.json"))
    vocab = first.model_config.vocab_size
    for i, old in enumerate(res["runs"]):
        if args.rerun not in old["run"]:
            continue
        trace = read_trace(os.path.join(args.out, "traces", f"{old['trace']}.jsonl"))
        r = replay(make_engine(max_running=old["max_running"], **old["changes"]), trace,
                   prompt_ids(trace, vocab, VOCAB_SEED))
        r.update(trace=old["trace"], run=old["run"], changes=old["changes"], max_running=old["max_running"])
        res["runs"][i] = r
        sim = simulate_run(r, trace, config, model, vocab)
        j = next(j for j, x in enumerate(res["simulated"]) if x["trace"] == old["trace"] and x["run"] == old["run"])
        res["simulated"][j] = sim
        print(f"  {old['trace']:>6} {old['run']:<24} {r['output_tokens_per_s']:7.1f} tok/s  TPOT p99 "
              f"{r['tpot_p99_s'] * 1000:6.1f} ms  TTFT p99 {r['ttft_p99_s']:6.2f} s  {r.get('controller')}  "
              f"(simulated: {sim['sim']['output_tokens_per_s']:.1f} tok/s, TPOT p99 "
              f"{sim['sim']['tpot_p99_s'] * 1000:.1f} ms)", flush=True)
    save_steps(args.out, res["runs"])
    res["runs"] = [_public(r) for r in res["runs"]]
    res["simulator_error"] = error_summary(res["simulated"])
    res["rerun"] = res.get("rerun", []) + [args.rerun]
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def validate(args, first, config, make_engine):
    """New, longer traces (FCFS at the policy runs' limit): the simulator against the real engine, and,
    with --repeat K, the real engine against itself (each trace run K times, interleaved): the noise
    floor any simulator's error sits on."""
    from jaxcb.sim.simulate import load_step_model, simulate

    with open(os.path.join(args.out, "results.json")) as f:
        res = json.load(f)
    capacity = res["capacity_requests_per_s"]
    model = load_step_model(os.path.join(args.out, "step_model.json"))
    vocab = first.model_config.vocab_size
    traces = {"near": poisson_trace(args.validate, 0.9 * capacity, args.seed + 21),
              "above": poisson_trace(args.validate, 1.3 * capacity, args.seed + 22),
              "bursty": bursty_trace(args.validate, 0.8 * capacity, args.seed + 23)}
    reals = {name: [] for name in traces}
    for _ in range(args.repeat):
        for name, trace in traces.items():
            write_trace(os.path.join(args.out, "traces", f"validate-{name}-{args.validate}.jsonl"), trace)
            r = replay(make_engine(max_running=args.policy_limit), trace, prompt_ids(trace, vocab, VOCAB_SEED))
            r.pop("_steps")
            reals[name].append(r)
            print(f"  real {name:>6} x{args.validate}: " + "  ".join(f"{k} {r[k]:.3f}" for k in ERROR_KEYS), flush=True)
    out = []
    for name, trace in traces.items():
        sim = simulate(trace, config, model, vocab=vocab, seed=VOCAB_SEED, max_running=args.policy_limit)
        v = {"trace": name, "requests": args.validate, "real": reals[name][0], "repeats": reals[name][1:], "sim": sim}
        out.append(compare_validation(v))
    print_validation(out)
    with open(os.path.join(args.out, f"validate-{args.validate}.json"), "w") as f:
        json.dump({"machine": machine(), "policy_limit": args.policy_limit, "runs": out}, f, indent=1)


def controller_trials(args, first, config, make_engine):
    """The latency controller against fixed running limits on the near-capacity trace, K times each,
    interleaved (one round of every setting, then the next): medians and spread of throughput and
    TPOT p99, and the controller's median against the best fixed limit whose median holds the target."""
    from jaxcb.sim.trace import read_trace

    with open(os.path.join(args.out, "results.json")) as f:
        res = json.load(f)
    name = "near"
    target = next(r["changes"]["target_p99_tpot_ms"] for r in res["runs"]
                  if r["trace"] == name and "target_p99_tpot_ms" in r["changes"])
    trace = read_trace(os.path.join(args.out, "traces", f"{name}.jsonl"))
    ids = prompt_ids(trace, first.model_config.vocab_size, VOCAB_SEED)
    settings = [(f"fixed limit {n}", {}, n) for n in (4, 8, 16, 32)]
    settings.append((f"target {target:g} ms", {"target_p99_tpot_ms": target}, None))
    trials = {label: [] for label, _, _ in settings}
    for k in range(args.controller_trials):
        for label, changes, limit in settings:
            r = replay(make_engine(max_running=limit, **changes), trace, ids, record_steps=False)
            r.pop("_steps")
            trials[label].append(r)
            print(f"  trial {k + 1} {label:<20} {r['output_tokens_per_s']:6.2f} tok/s  TPOT p99 "
                  f"{r['tpot_p99_s'] * 1000:6.1f} ms  TTFT p99 {r['ttft_p99_s']:6.2f} s", flush=True)
    rows = []
    for label, _, _ in settings:
        tps = [r["output_tokens_per_s"] for r in trials[label]]
        tpot = [r["tpot_p99_s"] * 1000 for r in trials[label]]
        rows.append({"setting": label, "tokens_per_s": tps, "tpot_p99_ms": tpot, "median_tokens_per_s": _median(tps),
                     "median_tpot_p99_ms": _median(tpot), "holds": sum(t <= target for t in tpot),
                     "median_ttft_p99_s": _median([r["ttft_p99_s"] for r in trials[label]])})
    ctl = rows[-1]
    holding = [r for r in rows[:-1] if r["median_tpot_p99_ms"] <= target]
    best = max(holding, key=lambda r: r["median_tokens_per_s"]) if holding else None
    for r in rows:
        print(f"  {r['setting']:<20} median {r['median_tokens_per_s']:6.2f} tok/s (trials {r['tokens_per_s']}), TPOT p99 "
              f"median {r['median_tpot_p99_ms']:.1f} ms (held in {r['holds']}/{len(r['tpot_p99_ms'])}), TTFT p99 "
              f"median {r['median_ttft_p99_s']:.2f} s")
    if best:
        print(f"controller {ctl['median_tokens_per_s']:.2f} vs best fixed holding the target ({best['setting']}) "
              f"{best['median_tokens_per_s']:.2f} tok/s: {ctl['median_tokens_per_s'] / best['median_tokens_per_s']:.3f}x")
    with open(os.path.join(args.out, "controller-trials.json"), "w") as f:
        json.dump({"machine": machine(), "trace": name, "target_ms": target, "trials": args.controller_trials,
                   "rows": rows, "best_fixed": best["setting"] if best else None}, f, indent=1)


def compare_validation(v: dict) -> dict:
    """The simulator against the first real run and, with repeats, against the real runs' mean; and
    each repeat against the first (the real engine's own spread)."""
    reals = [v["real"]] + v.get("repeats", [])
    v["error"] = errors(v["sim"], v["real"])
    if len(reals) > 1:
        mean = {k: sum(r[k] for r in reals) / len(reals) for k in ERROR_KEYS}
        v["real_mean"] = mean
        v["error_vs_real_mean"] = errors(v["sim"], mean)
        v["real_vs_real"] = [errors(r, v["real"]) for r in reals[1:]]
    return v


def print_validation(runs: list[dict]) -> None:
    for v in runs:
        print(f"  {v['trace']:>6} x{v['requests']}: " + "  ".join(
            f"{k} {v['real'][k]:.3f} real, {v['sim'][k]:.3f} sim ({v['error'][k]:+.1%})" for k in ERROR_KEYS))
        for e in v.get("real_vs_real", []):
            print("           real repeat vs first: " + "  ".join(f"{k} {e[k]:+.1%}" for k in ERROR_KEYS))
        if "error_vs_real_mean" in v:
            e = v["error_vs_real_mean"]
            print(f"           sim vs the mean of {1 + len(v['repeats'])} real runs: "
                  + "  ".join(f"{k} {e[k]:+.1%}" for k in ERROR_KEYS))


def markdown(runs, sims=None) -> str:
    """The policy table (README): one row per run; with `sims`, the simulator's error next to it."""
    head = ("| trace | run | out tok/s | req/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | e2e p99 (s) | "
            "longest wait (s) | preempt. | switches (recomputed) | padding |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in runs:
        lines.append(
            f"| {r['trace']} | {r['run']} | {r['output_tokens_per_s']:.1f} | {r['requests_per_s']:.3f} | "
            f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | {r['tpot_p50_s'] * 1000:.0f} / {r['tpot_p99_s'] * 1000:.0f} | "
            f"{r['e2e_p99_s']:.1f} | {r['max_wait_s']:.2f} | {r['preemptions']} | {r['switches']} "
            f"({r['recomputed_tokens']}) | {r['padding_fraction']:.1%} |")
    if sims:
        lines += ["", "| trace | run | simulated out tok/s (error) | TTFT p99 (error) | TPOT p99 (error) | e2e p99 (error) |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for x in sims:
            s, e = x["sim"], x["error"]
            lines.append(f"| {x['trace']} | {x['run']} | {s['output_tokens_per_s']:.1f} ({e['output_tokens_per_s']:+.0%}) | "
                         f"{s['ttft_p99_s']:.2f} ({e['ttft_p99_s']:+.0%}) | {s['tpot_p99_s'] * 1000:.0f} "
                         f"({e['tpot_p99_s']:+.0%}) | {s['e2e_p99_s']:.1f} ({e['e2e_p99_s']:+.0%}) |")
    return "\n".join(lines)


def _simulate_job(job):
    from jaxcb.sim.simulate import MODELS, simulate

    trace, config, model, label = job
    r = simulate(trace, config, model, vocab=MODELS["llama-3-8b"].vocab, seed=VOCAB_SEED)
    r["run"] = label
    return r


def _median(values):
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def plot(path, runs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    load = ("below", "near", "above")
    for policy in POLICIES:  # in order of offered load, so each line follows its policy as the load grows
        pts = sorted(((load.index(r["trace"]), r["output_tokens_per_s"], r["ttft_p99_s"], r["tpot_p99_s"] * 1000)
                      for r in runs if r["run"] == policy and r["trace"] in load))
        axes[0].plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=policy)
        axes[1].plot([p[1] for p in pts], [p[3] for p in pts], marker="o", label=policy)
    axes[0].set(xlabel="output tokens/s", ylabel="TTFT p99 (s)", yscale="log",
                title="TTFT p99 vs throughput at 0.5x, 0.9x, 1.3x capacity")
    axes[1].set(xlabel="output tokens/s", ylabel="TPOT p99 (ms)", title="TPOT p99 vs throughput")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32, help="requests per trace")
    ap.add_argument("--policy-limit", type=int, default=8,
                    help="running limit of the policy and window runs (slots must be short for the order to matter)")
    ap.add_argument("--out", default="bench/results/policies")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--plot", action="store_true", help="write OUT/latency_throughput.png (needs matplotlib)")
    ap.add_argument("--sweep", action="store_true", help="the batch-size sweep instead")
    ap.add_argument("--replot", action="store_true", help="only redraw the plot from OUT/results.json")
    ap.add_argument("--rerun", default=None, metavar="TEXT",
                    help="run again only the runs of OUT/results.json whose label contains TEXT (same traces, "
                         "same settings) and replace them and their simulations there")
    ap.add_argument("--validate", type=int, default=0, metavar="N",
                    help="only check the simulator (OUT/step_model.json) against real FCFS runs of new traces of N "
                         "requests at 0.9x and 1.3x the capacity in OUT/results.json, and bursty at 0.8x")
    ap.add_argument("--repeat", type=int, default=1, metavar="K",
                    help="with --validate: run each real trace K times (interleaved) to measure the real spread")
    ap.add_argument("--controller-trials", type=int, default=0, metavar="K",
                    help="only the controller against fixed limits 4/8/16/32 on the near trace, K interleaved trials")
    ap.add_argument("--resimulate", action="store_true",
                    help="no JAX: refit the step model to OUT/steps.json.gz and simulate the saved runs again")
    ap.add_argument("--table", action="store_true", help="only print the markdown tables from OUT/results.json")
    ap.add_argument("--simulate-device", default=None, help="the simulated table on this device instead (h200, ...)")
    ap.add_argument("--sim-requests", type=int, default=100000)
    ap.add_argument("--sim-rate", type=float, default=50.0)
    ap.add_argument("--sim-targets", type=lambda v: [float(x) for x in v.split(",")], default=[15.0, 25.0],
                    help="TPOT targets (ms) of the controller runs, comma-separated")
    ap.add_argument("--sim-jobs", type=int, default=2, help="simulations run in parallel (processes)")
    ap.add_argument("--save-step-model", action="store_true", help="also write the fitted model as the built-in one")
    args = ap.parse_args()
    if args.sweep:
        return sweep(args)
    if args.table:
        with open(os.path.join(args.out, "results.json")) as f:
            res = json.load(f)
        return print(markdown(res["runs"], res["simulated"]))
    if args.resimulate:
        return resimulate(args)
    if args.replot:
        with open(os.path.join(args.out, "results.json")) as f:
            return plot(os.path.join(args.out, "latency_throughput.png"), json.load(f)["runs"])
    if args.simulate_device:
        return simulate_device(args)

    from jaxcb.host.engine import Engine
    from jaxcb.host.engine_config import load_config
    from jaxcb.llm import build_engine

    config = load_config(None)
    first = build_engine(None, config)
    config = first.config

    def make_engine(max_running=None, **changes):
        eng = Engine(first.runner, first.tokenizer, config.replace(**changes) if changes else config,
                     eos_ids=first.scheduler.eos_ids)
        if max_running is not None:
            eng.scheduler.running_limit = max_running
        return eng

    print(f"machine: {machine()}", flush=True)
    t0 = time.perf_counter()
    shapes = first.warmup()
    print(f"warm-up: {shapes} shapes in {time.perf_counter() - t0:.0f} s", flush=True)
    vocab = first.model_config.vocab_size

    if args.rerun:
        return rerun(args, first, config, make_engine)
    if args.validate:
        return validate(args, first, config, make_engine)
    if args.controller_trials:
        return controller_trials(args, first, config, make_engine)
    sat = poisson_trace(32, 1e9, args.seed + 100)  # everything at once
    cap = replay(make_engine(), sat, prompt_ids(sat, vocab, VOCAB_SEED))
    capacity = cap["requests_per_s"]
    print(f"capacity (32 requests at once, FCFS): {capacity:.3f} requests/s, {cap['output_tokens_per_s']:.1f} "
          f"output tokens/s", flush=True)
    traces = {"below": poisson_trace(args.requests, 0.5 * capacity, args.seed),
              "near": poisson_trace(args.requests, 0.9 * capacity, args.seed + 1),
              "above": poisson_trace(args.requests, 1.3 * capacity, args.seed + 2),
              "bursty": bursty_trace(args.requests, 0.8 * capacity, args.seed + 3)}
    os.makedirs(os.path.join(args.out, "traces"), exist_ok=True)
    for name, t in traces.items():
        write_trace(os.path.join(args.out, "traces", f"{name}.jsonl"), t)
    ids = {name: prompt_ids(t, vocab, VOCAB_SEED) for name, t in traces.items()}

    runs = real_runs(args, first, make_engine, traces, ids)
    save_steps(args.out, runs)
    fit, sims = fit_and_simulate(args, config, runs, traces, vocab)
    print(f"step model: in-sample {fit['in_sample_fcfs']}, other runs {fit['out_of_sample_other_runs']}")
    print_errors(sims)
    result = {"machine": machine(), "capacity_requests_per_s": capacity, "capacity_run": _public(cap),
              "requests_per_trace": args.requests, "num_pages": config.num_pages, "vocab": vocab,
              "runs": [_public(r) for r in runs], "step_model_fit": fit, "simulated": sims,
              "simulator_error": error_summary(sims)}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        plot(os.path.join(args.out, "latency_throughput.png"), runs)
    print(json.dumps({k: v for k, v in result.items() if k != "simulated"})[:2000])


def _public(r: dict) -> dict:
    return {k: v for k, v in r.items() if not k.startswith("_")}


if __name__ == "__main__":
    main()
