"""Time one engine step, shape by shape, on the engine's own runner: where a decode step's time goes.

    .venv/bin/python -m bench.step [--rows 1 32] [--contexts 128 512 2048] [--repeats 10] [--attention xla native]
                                   [--page-size N] [--layout pool|shuffled]

For each (rows, context): a packed decode step of `rows` sequences, each `context` tokens long (the
newest token included), float32, the default model. Their pages lie where the engine's page pool puts
them (`--layout pool`: the configured pool, the sequences' prompts, a quarter of the context each,
admitted together, then grown a token at a time in turn) or scattered at random over the pool
(`--layout shuffled`: the worst case, a pool churned long enough). Prints the median
step time (dispatch + the one device-to-host copy) and splits it:
  - no attention: the same program with attention skipped (its output is the queries): matmuls,
    embeddings, norms, rotary, the KV write, sampling;
  - attention: full minus no attention;
  - KV read rate: the live K/V bytes over the attention time, and its share of the copy rate (a jitted
    x * 2 over a 1 GiB float32 array in the same process: bytes read per second; it also writes as many);
  - sampling (greedy): the sampler alone on [M, V] logits;
  - host: packing the step's numpy arrays (jaxcb.host.batch.pack / pack_sampling).
With several `--attention` choices (xla: the plain-JAX loops; native: the C++ decode kernel) each shape
runs every choice back to back, so their ratio is measured under the same conditions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench.common import copy_rate, machine, write_result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--weights", default="float32", choices=["float32", "bfloat16", "int8", "int4", "w8a8", "w4a8"],
                    help="the layer matrices' storage (jaxcb.model.quant); w8a8 / w4a8: int8 / int4 with int8 "
                         "activations")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--attention", nargs="+", default=["xla", "native"], choices=["xla", "native"])
    ap.add_argument("--page-size", type=int, default=0, help="tokens per KV page (default: the config's)")
    ap.add_argument("--layout", default="pool", choices=["pool", "shuffled"],
                    help="where the sequences' pages lie: as the engine's page pool puts them, or at random")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from jaxcb.device.runner import ModelRunner, step_functions
    from jaxcb.device.sampling import sample
    from jaxcb.host.batch import SamplingRow, SeqSpec, pack, pack_sampling
    from jaxcb.host.engine_config import load_config
    from jaxcb.host.request import SamplingParams
    from jaxcb.llm import load_model
    from jaxcb.model.llama import Attention

    forward_step, sample_step = step_functions()

    stored = {"w8a8": "int8", "w4a8": "int4"}.get(args.weights, args.weights)
    model_config, params, _, _ = load_model(args.model, weights=stored)
    if stored != args.weights:
        from jaxcb.model.quant import with_int8_activations

        params = with_int8_activations(params)
    config = load_config()
    s = args.page_size or config.page_size
    max_context = min(config.scheduler.max_context, model_config.max_context)
    need = max(args.rows) * -(-max(args.contexts) // s) + 1
    num_pages = max(need + 8, config.num_pages) if args.layout == "pool" else need + 8
    # A runner per choice, as the engine builds it: "native" also reads its float32 matrices natively, in
    # the kernel's column blocks (kernels_cpu.block_stack), which "xla" leaves as they are.
    runners = {choice: ModelRunner(model_config, params, num_pages, s, attention=choice) for choice in args.attention}
    for runner in runners.values():  # timed once the weights and pages are in huge pages, as a started server's are
        runner.warmed_up()
        runner.wait_for_huge_pages()
    window = model_config.sliding_window if model_config.windowed else 0
    rng = np.random.default_rng(0)
    kv_bytes_per_token = runners[args.attention[0]].kv_bytes_per_token
    rows_out = []
    copy_gb_s = copy_rate() / 1e9
    print(f"machine: {machine()}; model {model_config.name}, {args.weights} weights, page size {s}, "
          f"{args.layout} layout over {num_pages} pages; "
          f"copy rate {copy_gb_s:.1f} GB/s read (+ as much written)")
    for rows in args.rows:
        for ctx in args.contexts:
            n_pages = -(-ctx // s)
            if args.layout == "pool":
                tables = pool_layout(rows, ctx, ctx // 4, num_pages, s)
            else:
                tables = rng.permutation(np.arange(1, need))[: rows * n_pages].reshape(rows, n_pages).tolist()
            # A model with sliding-window layers (Gemma 3): its window group's pages at the same ids of its own pool.
            seqs = [SeqSpec([int(rng.integers(100, 1000))], ctx - 1, tables[i],
                            window_page_ids=tables[i] if window else None) for i in range(rows)]
            shape = config.buckets.step_shape(rows, s, max_context)
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                batch = pack(seqs, shape, s, window)
                sampling = pack_sampling([SamplingRow(SamplingParams(), 0, [], [])] * rows, shape, model_config.vocab_size)
            host_ms = (time.perf_counter() - t0) / args.repeats * 1000

            def timed(fn):
                fn()
                times = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t)
                return statistics.median(times) * 1000

            def run_with(runner, attention):
                def go():  # the step's two programs, as the runner dispatches them
                    runner.kv_pages, logits, newest, _ = forward_step(
                        runner.params, runner.kv_pages, runner.last_tokens, batch, config=runner.step_config,
                        attention=attention)
                    out, runner.last_tokens = sample_step(logits, newest, runner.last_tokens, sampling, seqs=shape.seqs)
                    jax.device_get(out)
                return go

            logits = jnp.zeros((shape.seqs, model_config.vocab_size), jnp.float32)
            sample_jit = jax.jit(sample)
            sample_ms = timed(lambda: jax.device_get(sample_jit(logits, sampling)))
            kv_gb = rows * ctx * kv_bytes_per_token / 1e9
            for choice in args.attention:
                runner = runners[choice]
                attention = runner.attention
                # The same step without attention (its matmuls as this choice runs them), run in turn with
                # the full one: the attention is the median of the pairs' differences (at one row it is a
                # few percent of the step, below the drift between two separate series).
                none_ms, full_ms, attn_ms = timed_pairs(
                    run_with(runner, Attention("none", native_matmul=attention.native_matmul)),
                    run_with(runner, attention), args.repeats)
                attn_ms = max(attn_ms, 0.0)
                rate = kv_gb / (attn_ms / 1000) if attn_ms >= 0.05 else None  # None: within the pairs' noise
                row = {"attention": choice, "layout": args.layout, "rows": rows, "context": ctx,
                       "page_runs_per_seq": round(sum(runs(t) for t in tables) / rows, 1), "tokens_bucket": shape.tokens,
                       "step_ms": round(full_ms, 1), "no_attention_ms": round(none_ms, 1),
                       "attention_ms": round(attn_ms, 1), "attention_share": round(attn_ms / full_ms, 3),
                       "kv_read_gb_per_s": rate and round(rate, 2),
                       "kv_read_of_copy_rate": rate and round(rate / copy_gb_s, 3),
                       "sampling_ms": round(sample_ms, 2), "host_pack_ms": round(host_ms, 3)}
                rows_out.append(row)
                read = (f"{rate:.1f} GB/s of live K/V, {100 * rate / copy_gb_s:.0f}% of copy" if rate
                        else "within the noise")
                print(f"{choice:6s} rows {rows:3d} context {ctx:5d}: step {full_ms:7.1f} ms | without attention "
                      f"{none_ms:6.1f} ms | attention {attn_ms:6.1f} ms ({100 * attn_ms / full_ms:.0f}%; {read}) | "
                      f"sampling {sample_ms:5.2f} ms | host pack {host_ms:.3f} ms", flush=True)
    result = {"machine": machine(), "weights": args.weights, "copy_gb_per_s": round(copy_gb_s, 2), "steps": rows_out}
    write_result(result, args.json)


def timed_pairs(base, full, repeats: int) -> tuple[float, float, float]:
    """Medians (ms) of `base`, of `full`, and of full minus base, each pair run back to back."""
    base()
    full()
    pairs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        base()
        t1 = time.perf_counter()
        full()
        t2 = time.perf_counter()
        pairs.append((t1 - t0, t2 - t1))
    ms = lambda xs: statistics.median(xs) * 1000  # noqa: E731
    return ms([a for a, _ in pairs]), ms([b for _, b in pairs]), ms([b - a for a, b in pairs])


def pool_layout(rows: int, context: int, prompt: int, num_pages: int, page_size: int) -> list[list[int]]:
    """The page tables the engine's pool gives `rows` sequences admitted together with `prompt`-token
    prompts and then grown, a token each in turn, to `context` tokens (what the scheduler asks of it)."""
    from jaxcb.host.page_pool import PagePool

    pool = PagePool(num_pages, page_size)
    tables = [pool.allocate(pool.pages_for(max(prompt, 1))) for _ in range(rows)]
    for length in range(max(prompt, 1) + 1, context + 1):
        for t in tables:
            need = pool.pages_for(length) - len(t)
            if need > 0:
                t.extend(pool.allocate(need, after=t[-1]))
    return tables


def runs(pages: list[int]) -> int:
    """Stretches of consecutive page ids in a page table."""
    return 1 + sum(b != a + 1 for a, b in zip(pages, pages[1:]))


if __name__ == "__main__":
    main()
