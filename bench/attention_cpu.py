"""The CPU decode attention alone: the step's ragged attention (the native kernel, or plain JAX) over every
layer of a SmolLM2-shaped cache, timed directly, against a copy measured in the same process.

    .venv/bin/python -m bench.attention_cpu [--rows 1 4 32] [--contexts 128 512 2048] [--attention native xla]
                                            [--scatter]

`bench.step` takes attention as a step's time less the time of the same step without it: at a few rows
and short contexts that is a difference of two ~30 ms figures that move by a few ms between processes.
Here one jitted program runs the attention of all 30 layers (a scan, each layer's call reading its own
pages, as the step does) and nothing else; the figure is the best of --repeats runs (more for a point
whose runs take under MIN_SECONDS in all: a 0.3 ms point's best of 20 moved 2x between processes), and
the live K/V read rate (each sequence's keys and values once per layer) is set against the copy rate of
the same process (bench.common.copy_rate), measured before and after the rows and averaged. Each
sequence's pages are consecutive in the pool, or with --scatter lie anywhere in it (as in a pool after
hours of serving).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import copy_rate, machine, write_result

LAYERS, HEADS, KV_HEADS, HEAD_DIM, PAGE = 30, 9, 3, 64, 16  # SmolLM2-135M
MIN_SECONDS = 0.5  # each point runs at least --repeats times and at least this long


def attention_seconds(rows: int, context: int, native: bool, repeats: int, scatter: bool = False) -> float:
    import jax
    import jax.numpy as jnp

    import jaxcb.model.llama  # noqa: F401 - registers the packed step's types as pytrees
    from jaxcb.host.batch import SeqSpec, StepShape, pack
    from jaxcb.model.paged_attention import ragged_attention

    rng = np.random.default_rng(rows * 10000 + context)
    per_seq = -(-context // PAGE)
    pages = rows * per_seq + 1
    kv = jnp.asarray(rng.standard_normal((LAYERS, 2, KV_HEADS, pages, PAGE, HEAD_DIM), np.float32))
    ids = np.arange(1, pages)
    if scatter:
        rng.shuffle(ids)
    specs = [SeqSpec([0], context - 1, ids[i * per_seq:(i + 1) * per_seq].tolist()) for i in range(rows)]
    batch = jax.tree.map(jnp.asarray, pack(specs, StepShape(tokens=rows, seqs=rows, pages_per_seq=per_seq,
                                                            history=per_seq * PAGE), PAGE))
    q = jnp.asarray(rng.standard_normal((rows, HEADS, HEAD_DIM), np.float32))

    @jax.jit
    def every_layer(q, kv, batch):
        def one(total, layer):
            return total + ragged_attention(q, kv, layer, batch, native=native), None

        return jax.lax.scan(one, jnp.zeros_like(q), jnp.arange(LAYERS, dtype=jnp.int32))[0]

    every_layer(q, kv, batch).block_until_ready()
    best, spent, runs = float("inf"), 0.0, 0
    while runs < repeats or spent < MIN_SECONDS:  # short points run more often: their best is noisier
        t = time.perf_counter()
        every_layer(q, kv, batch).block_until_ready()
        best = min(best, time.perf_counter() - t)
        spent += time.perf_counter() - t
        runs += 1
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--attention", nargs="+", default=["native"], choices=["native", "xla"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--scatter", action="store_true", help="each sequence's pages anywhere in the pool")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    before = copy_rate()
    results = []
    for attention in args.attention:
        for rows in args.rows:
            for context in args.contexts:
                seconds = attention_seconds(rows, context, attention == "native", args.repeats, args.scatter)
                live = LAYERS * rows * context * KV_HEADS * HEAD_DIM * 4 * 2
                results.append({"attention": attention, "rows": rows, "context": context,
                                "ms": round(seconds * 1e3, 3), "live_kv_gb_per_s": round(live / seconds / 1e9, 2)})
    copy = (before + copy_rate()) / 2
    layout = "scattered" if args.scatter else "consecutive"
    print(f"machine: {machine()}; SmolLM2-shaped decode attention, {LAYERS} layers, float32 pages of {PAGE}; "
          f"{layout} pages; copy rate {copy / 1e9:.1f} GB/s read (+ as much written), mean of before and after")
    for r in results:
        r["of_copy"] = round(r["live_kv_gb_per_s"] * 1e9 / copy, 3)
        print(f"{r['attention']:6s} rows {r['rows']:3d} context {r['context']:5d}: {r['ms']:8.3f} ms, "
              f"{r['live_kv_gb_per_s']:6.2f} GB/s of live K/V, {100 * r['of_copy']:.0f}% of copy")
    write_result({"machine": machine(), "copy_gb_per_s": round(copy / 1e9, 2), "scatter": args.scatter,
                  "results": results}, args.json)


if __name__ == "__main__":
    main()
