"""Quantized weights and KV cache against float32: quality, speed, bytes and what fits.

    .venv/bin/python -m bench.quant [--modes float32,int8,int8-g32,int4] [--trials 2] [--peer BIN]
        [--skip-quality] [--skip-speed] [--json bench/results/quant.json]

A mode is WEIGHTS[-gGROUP][+a8][+kv-KV]: "int8" (per output column), "int8-g32" (a scale per 32 input
rows), "int4" (groups of 32), "int8+a8" / "int4+a8" (int8 activations too: w8a8 / w4a8), "float32+kv-int8" (float weights,
int8 KV pages). On the embedded SmolLM2, in one
process, float32 compute:
  quality  perplexity on tests/data/heldout_prose.txt (the whole text as one sequence, chunked prefill
           through the mode's own KV pages) and its ratio to float32; greedy agreement with the
           float32 reference over the 20 golden prompts x 48 tokens (tests/golden/smollm2.json),
           identical in full and up to the reference's first near-tie (top-2 margin < 1e-2).
  speed    decode step time at 1, 8 and 32 rows (context 256, every mode's runner in turn, interleaved,
           median of repeats) as tokens/s; the engine benchmark's workload (bench/engine.py: 32
           requests, all at once) per mode, trials interleaved, and with --peer llama.cpp's server on
           the same requests, interleaved too.
  bytes    weight bytes a decode step reads (every matrix and the output head), KV bytes a step reads
           at 32 rows x 256 tokens; `jaxcb plan` for an 8B Llama config on a 16 GiB chip per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from bench.common import HELDOUT_PROSE, machine, write_result
from bench.engine import PEER_SCRIPT, run, run_peer, workload

GOLDEN = os.path.join(ROOT, "tests", "golden", "smollm2.json")
LLAMA8B = os.path.join(ROOT, "configs", "models", "llama-3-8b")


def parse_mode(mode: str) -> dict:
    """"int8-g32+kv-int8" -> {"weights": "int8", "weight_group": 32, "kv_dtype": "int8"}; "+a8": int8
    activations ("int8+a8": w8a8)."""
    weights, *extras = mode.split("+")
    weights, _, group = weights.partition("-g")
    out = {"weights": weights, "weight_group": int(group or 0)}
    for extra in extras:
        if extra.startswith("kv-"):
            out["kv_dtype"] = extra[3:]
        elif extra == "a8":
            out["activations"] = "int8"
        else:
            raise ValueError(f"mode {mode!r}: unknown part {extra!r} (kv-DTYPE or a8)")
    return out


def config_for(mode: str, **changes):
    from jaxcb.host.engine_config import load_config

    return load_config().replace(**parse_mode(mode), **changes)


def step_bytes(runner, rows: int, context: int) -> dict:
    """Bytes a decode step of `rows` x `context` reads: every weight but the embedding rows it looks up
    (all of it when the head is tied to it), and the live KV."""
    import jax

    p = runner.params
    layers = sum(x.nbytes for x in jax.tree.leaves(p.layers))
    head = sum(x.nbytes for x in jax.tree.leaves(p.lm_head if p.lm_head is not None else p.embed))
    return {"weights": layers + head + p.final_norm.nbytes, "kv": rows * context * runner.kv_bytes_per_token}


def decode_speed(runners: dict, rows_list, context: int, repeats: int) -> dict:
    import jax

    from jaxcb.host.batch import SamplingRow, SeqSpec, pack, pack_sampling
    from jaxcb.host.request import SamplingParams

    rng = np.random.default_rng(0)
    first = next(iter(runners.values()))
    s = first.page_size
    out = {}
    for rows in rows_list:
        n = -(-context // s)
        perm = rng.permutation(np.arange(1, first.num_pages))[: rows * n].reshape(rows, n)
        seqs = [SeqSpec([int(rng.integers(100, 1000))], context - 1, perm[i].tolist()) for i in range(rows)]
        shape = config_for("float32").buckets.step_shape(rows, s, 2048)
        batch = pack(seqs, shape, s)
        sampling = pack_sampling([SamplingRow(SamplingParams(), 0, [], [])] * rows, shape, first.model_config.vocab_size)
        times = {m: [] for m in runners}
        for r in runners.values():
            jax.device_get(r.run(batch, sampling, shape))
        for _ in range(repeats):
            for m, r in runners.items():
                t = time.perf_counter()
                jax.device_get(r.run(batch, sampling, shape))
                times[m].append(time.perf_counter() - t)
        for m, v in times.items():
            ms = statistics.median(v) * 1000
            out.setdefault(m, {})[rows] = {"step_ms": round(ms, 1), "tokens_per_s": round(rows / ms * 1000, 1)}
        print(f"decode {rows:2d} rows x {context}: " + "  ".join(
            f"{m} {out[m][rows]['step_ms']} ms" for m in runners), flush=True)
    return out


def quality(mode: str, ids: list[int], golden: list[dict]) -> dict:
    from jaxcb.device.evaluate import greedy_agreement, perplexity
    from jaxcb.host.request import SamplingParams
    from jaxcb.llm import LLM

    llm = LLM(config=config_for(mode, num_pages=len(ids) // 16 + 64))
    ppl = perplexity(llm.engine.runner, ids)
    outs = llm.generate([r["prompt_ids"] for r in golden], SamplingParams(max_tokens=48, ignore_eos=True))
    agree = greedy_agreement([r["greedy_ids"] for r in golden], [o.token_ids for o in outs],
                             [r["margins"] for r in golden])
    llm.close()
    return {"perplexity": round(ppl["perplexity"], 4), "nll": ppl["nll"], "tokens": ppl["tokens"], **agree}


def plan_8b(mode: str) -> dict:
    from jaxcb.host import memory_plan
    from jaxcb.llm import read_model_config

    model = read_model_config(LLAMA8B)
    cfg = config_for(mode, num_pages=0)
    m = parse_mode(mode)
    try:
        p = memory_plan.plan_for_model(model, cfg, budget_bytes=16 << 30, dtype_bytes=2, max_context=4096,
                                       weights=m["weights"] if m["weights"] != "float32" else "bfloat16")
    except ValueError as e:
        return {"fits": False, "why": str(e)[:160]}
    return {"fits": True, "weights_gib": round(p.weight_bytes / 2**30, 2), "kv_pages": p.num_pages,
            "batch_at_4096": p.max_batch_at(4096)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="float32,int8,int8-g32,int4")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--peer", default=None, help="llama-server binary (../shared/peers/build-llama-server.sh)")
    ap.add_argument("--peer-slots", type=int, default=8)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    modes = args.modes.split(",")

    from jaxcb.llm import build_engine

    result = {"machine": machine(), "modes": modes, "quality": {}, "bytes": {}, "plan_8b_16gib": {}}
    print(f"machine: {result['machine']}; SmolLM2-135M, float32 compute")
    for m in modes:
        result["plan_8b_16gib"][m] = plan_8b(m)
    if not args.skip_quality:
        from jaxcb.llm import LLM  # noqa: F401 - the tokenizer of the embedded model

        golden = json.load(open(GOLDEN))["records"]
        text = open(HELDOUT_PROSE, encoding="utf-8").read()
        ids = None
        for m in modes:
            if ids is None:
                from jaxcb.llm import load_model

                ids = load_model()[2].encode(text)
            t0 = time.perf_counter()
            result["quality"][m] = q = quality(m, ids, golden)
            print(f"quality {m}: perplexity {q['perplexity']:.3f} over {q['tokens']} tokens; greedy identical "
                  f"{q['identical']}/{q['prompts']}, up to the first near-tie {q['identical_up_to_near_tie']}/"
                  f"{q['prompts']}, mean matching prefix {q['mean_matching_prefix']:.1f} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
        base = result["quality"][modes[0]]["perplexity"]
        for m in modes:
            result["quality"][m]["perplexity_vs_first"] = round(result["quality"][m]["perplexity"] / base - 1, 4)
    if not args.skip_speed:
        from jaxcb.host.engine import Engine

        pages = args.requests * 40 + 64
        engines = {}
        for m in modes:
            e = build_engine(config=config_for(m, num_pages=pages))
            t0 = time.perf_counter()
            e.warmup()
            e.runner.wait_for_huge_pages()  # timed as a running server's memory is (bench.engine, bench.step)
            engines[m] = e
            result["bytes"][m] = step_bytes(e.runner, 32, args.context)
            print(f"{m}: warm-up {time.perf_counter() - t0:.0f} s; a decode step reads "
                  f"{result['bytes'][m]['weights'] / 1e6:.1f} MB of weights, "
                  f"{result['bytes'][m]['kv'] / 1e6:.1f} MB of KV at 32 x {args.context}", flush=True)
        result["decode"] = decode_speed({m: e.runner for m, e in engines.items()}, (1, 8, 32), args.context,
                                        args.repeats)
        prompts, output_lens = workload(args.requests, 0, engines[modes[0]].model_config.vocab_size)
        runs = {m: [] for m in modes} | ({"llama.cpp": []} if args.peer else {})
        for _ in range(args.trials):
            for m, e in engines.items():
                fresh = Engine(e.runner, e.tokenizer, e.config, eos_ids=e.scheduler.eos_ids)
                runs[m].append(run(fresh, prompts, output_lens))
                print(f"engine benchmark {m}: {runs[m][-1]['output_tokens_per_s']} output tokens/s", flush=True)
            if args.peer:
                try:
                    peer = run_peer(args.peer, PEER_SCRIPT, prompts, output_lens, args.peer_slots)
                except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
                    peer = {"output_tokens_per_s": 0.0, "error": str(e)[:200]}
                if not peer["output_tokens_per_s"]:  # nothing came back: the server died (see its stderr)
                    print(f"llama.cpp's server returned nothing: {peer.get('error', peer)}", flush=True)
                    continue
                runs["llama.cpp"].append(peer)
                print(f"engine benchmark llama.cpp: {peer['output_tokens_per_s']} output tokens/s", flush=True)
        result["engine"] = {m: statistics.median(r["output_tokens_per_s"] for r in v) for m, v in runs.items() if v}
        result["engine_runs"] = {m: [r["output_tokens_per_s"] for r in v] for m, v in runs.items()}

    print()
    print("| mode | perplexity (vs first) | greedy identical / up to near-tie | decode tok/s 1 / 8 / 32 rows | "
          "engine tok/s (vs first) | weights read a step | KV read (32 x %d) | 8B on 16 GiB: weights, batch at 4096 |"
          % args.context)
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in modes:
        q, d = result["quality"].get(m), result.get("decode", {}).get(m)
        e, b, p = result.get("engine", {}).get(m), result["bytes"].get(m), result["plan_8b_16gib"][m]
        first_e = result.get("engine", {}).get(modes[0])
        cells = [
            m,
            f"{q['perplexity']:.3f} ({q['perplexity_vs_first']:+.2%})" if q else "-",
            f"{q['identical']}/20, {q['identical_up_to_near_tie']}/20" if q else "-",
            " / ".join(f"{d[r]['tokens_per_s']:.1f}" for r in (1, 8, 32)) if d else "-",
            f"{e:.1f} ({e / first_e:.2f}x)" if e else "-",
            f"{b['weights'] / 1e6:.0f} MB" if b else "-",
            f"{b['kv'] / 1e6:.0f} MB" if b else "-",
            f"{p['weights_gib']} GiB, {p['batch_at_4096']}" if p["fits"] else "does not fit",
        ]
        print("| " + " | ".join(cells) + " |")
    if "engine" in result and "llama.cpp" in result["engine"]:
        peer = result["engine"]["llama.cpp"]
        print(f"llama.cpp's server (its Q4_1/Q8_0 GGUF as shipped): {peer:.1f} output tokens/s; jaxcb / llama.cpp: "
              + ", ".join(f"{m} {result['engine'][m] / peer:.2f}x" for m in modes))
    write_result(result, args.json)


if __name__ == "__main__":
    main()
