"""Time one engine step, shape by shape, on the engine's own runner: where a decode step's time goes.

    .venv/bin/python bench/step.py [--rows 1 32] [--contexts 128 512 2048] [--repeats 10]

For each (rows, context): a packed decode step of `rows` sequences, each `context` tokens long (the
newest token included), pages scattered over the pool, float32, the default model. Prints the median
step time (dispatch + the one device-to-host copy) and splits it:
  - no attention: the same program with attention skipped (its output is the queries): matmuls,
    embeddings, norms, rotary, the KV write, sampling;
  - attention: full minus no attention;
  - KV read rate: the live K/V bytes over the attention time;
  - sampling (greedy): the sampler alone on [M, V] logits;
  - host: packing the step's numpy arrays (jaxcb.batch.pack / pack_sampling).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from jaxcb.batch import SamplingRow, SeqSpec, pack, pack_sampling
    from jaxcb.engine_config import load_config
    from jaxcb.llm import load_model
    from jaxcb.model.llama import Attention
    from jaxcb.request import SamplingParams
    from jaxcb.runner import ModelRunner, step
    from jaxcb.sampling import sample

    model_config, params, _, _ = load_model(args.model)
    config = load_config()
    s = config.page_size
    max_context = min(config.scheduler.max_context, model_config.max_context)
    need = max(args.rows) * -(-max(args.contexts) // s) + 1
    runner = ModelRunner(model_config, params, need + 8, s, attention="xla")
    rng = np.random.default_rng(0)
    kv_bytes_per_token = runner.kv_bytes_per_token
    rows_out = []
    print(f"machine: {machine()}; model {model_config.name}, float32, page size {s}")
    for rows in args.rows:
        for ctx in args.contexts:
            n_pages = -(-ctx // s)
            perm = rng.permutation(np.arange(1, need))[: rows * n_pages].reshape(rows, n_pages)
            seqs = [SeqSpec([int(rng.integers(100, 1000))], ctx - 1, perm[i].tolist()) for i in range(rows)]
            shape = config.buckets.step_shape(rows, s, max_context)
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                batch = pack(seqs, shape, s)
                sampling = pack_sampling([SamplingRow(SamplingParams(), 0, [], [])] * rows, shape)
            host_ms = (time.perf_counter() - t0) / args.repeats * 1000

            def timed(fn):
                fn()
                times = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t)
                return statistics.median(times) * 1000

            full_ms = timed(lambda: jax.device_get(runner.run(batch, sampling, shape)))
            skip = jax.jit(step, static_argnames=("config", "attention"), donate_argnums=(1,))

            def no_attention():
                runner.kv_pages, out, runner.last_tokens = skip(
                    runner.params, runner.kv_pages, runner.last_tokens, batch, sampling, config=model_config,
                    attention=Attention("none"))
                jax.device_get(out)

            none_ms = timed(no_attention)
            logits = jnp.zeros((shape.seqs, model_config.vocab_size), jnp.float32)
            sample_jit = jax.jit(sample)
            sample_ms = timed(lambda: jax.device_get(sample_jit(logits, sampling)))
            attn_ms = max(full_ms - none_ms, 1e-9)
            kv_gb = rows * ctx * kv_bytes_per_token / 1e9
            row = {"rows": rows, "context": ctx, "tokens_bucket": shape.tokens, "step_ms": round(full_ms, 1),
                   "no_attention_ms": round(none_ms, 1), "attention_ms": round(attn_ms, 1),
                   "kv_read_gb_per_s": round(kv_gb / (attn_ms / 1000), 1), "sampling_ms": round(sample_ms, 2),
                   "host_pack_ms": round(host_ms, 3)}
            rows_out.append(row)
            print(f"rows {rows:3d} context {ctx:5d}: step {full_ms:7.1f} ms | without attention {none_ms:6.1f} ms | "
                  f"attention {attn_ms:6.1f} ms ({row['kv_read_gb_per_s']} GB/s of live K/V) | "
                  f"sampling {sample_ms:5.2f} ms | host pack {host_ms:.3f} ms", flush=True)
    print(json.dumps({"machine": machine(), "steps": rows_out}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "steps": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
