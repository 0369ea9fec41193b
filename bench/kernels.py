"""Decode-kernel timings on a GPU: jaxcb's Pallas kernel against JAX's shipped one and the reference.

    python -m bench.kernels                 # the full table, on a GPU (bf16, 32 q heads / 8 kv heads, D=128)
    python -m bench.kernels --quick         # a few sizes, to check the script (any GPU)
    python -m bench.kernels --interpret     # tiny sizes in interpret mode on the CPU: checks it runs, no figures

Each figure is the median of --repeats calls after warm-up. Achieved bandwidth counts the K/V bytes a
kernel must read (each sequence's context, keys and values, once) over its time, and is set against
the device's copy bandwidth measured in the same run (a large array copied: bytes read + written).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import machine
from jaxcb.model.paged_attention import paged_attention_reference
from kernels_pallas import paged_attention

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def median_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile + warm
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(repeats: int) -> float:
    """Bytes read + written per second by a jitted copy of a 2 GiB array."""
    x = jnp.ones((1 << 30,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.bfloat16(1))
    return 2 * x.nbytes / median_seconds(lambda: f(x), repeats)


def inputs(batch, context, page_size, dtype, seed=0):
    """Every sequence at the full context, its pages scattered over a pool of exactly the pages used."""
    rng = np.random.default_rng(seed)
    pages_per_seq = context // page_size
    num_pages = batch * pages_per_seq + 1
    table = (rng.permutation(num_pages - 1) + 1)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    shape = (KV_HEADS, num_pages, page_size, HEAD_DIM)
    return (jax.random.normal(kq, (batch, HEADS, HEAD_DIM), dtype), jax.random.normal(kk, shape, dtype),
            jax.random.normal(kv, shape, dtype), jnp.full((batch,), context, jnp.int32),
            jnp.asarray(table, jnp.int32))


def shipped(q, k, v, lengths, table):
    """JAX's jax.experimental.pallas.ops.gpu.paged_attention with splits and tiles that fit the table."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    n = table.shape[1]
    splits = min(16, n)
    per_block = min(8, n // splits)
    return jax_paged.paged_attention(q, k, v, table, lengths, k_splits=splits, pages_per_compute_block=per_block)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="batch 8/64, context 512/2048, page 16 only")
    p.add_argument("--interpret", action="store_true", help="tiny sizes on the CPU in interpret mode")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--markdown", help="also write the table to this file")
    args = p.parse_args(argv)

    platform = jax.default_backend()
    if platform not in ("gpu", "cuda") and not args.interpret:
        print(f"bench/kernels.py: needs a GPU (this is {platform}); --interpret checks the script on the CPU")
        return 2
    dtype = jnp.bfloat16
    batches, contexts, page_sizes = (8, 32, 64, 128), (512, 2048, 8192), (16, 64)
    if args.quick:
        batches, contexts, page_sizes = (8, 64), (512, 2048), (16,)
    if args.interpret:  # float32: the CPU has no bf16 x bf16 -> f32 matmul for the reference
        batches, contexts, page_sizes, args.repeats, dtype = (2,), (64,), (16,), 2, jnp.float32

    ours = jax.jit(lambda *a: paged_attention(*a, interpret=args.interpret))
    theirs = jax.jit(shipped)
    ref = jax.jit(lambda q, k, v, lens, table: paged_attention_reference(
        q[:, None], k, v, table, lens, (lens - 1)[:, None])[:, 0])

    copy_bw = None if args.interpret else copy_bandwidth(args.repeats)
    lines = [f"Decode attention, {machine()}, {jnp.dtype(dtype).name}, {HEADS} q heads / {KV_HEADS} kv heads, D={HEAD_DIM}; "
             f"median of {args.repeats} calls.",
             f"Measured copy bandwidth: {copy_bw / 1e9:.0f} GB/s." if copy_bw else "Interpret mode: no figures.",
             "",
             "| batch | context | page | jaxcb us | jaxcb GB/s | % of copy bw | JAX shipped us | jaxcb speed-up "
             "| reference us | max abs diff vs reference |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    def row(batch, context, page_size):
        """One table row; the inputs are freed when it returns."""
        q, k, v, lengths, table = inputs(batch, context, page_size, dtype)
        kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * jnp.dtype(dtype).itemsize
        t_ours = median_seconds(lambda: ours(q, k, v, lengths, table), args.repeats)
        out = ours(q, k, v, lengths, table)
        try:
            t_ref = median_seconds(lambda: ref(q, k, v, lengths, table), args.repeats)
            diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref(q, k, v, lengths, table).astype(jnp.float32))))
            ref_cell, diff_cell = f"{t_ref * 1e6:.0f}", f"{diff:.3g}"
        except Exception as e:  # the reference gathers the whole context: may not fit
            ref_cell, diff_cell = f"failed ({type(e).__name__}: {str(e)[:80]})", "-"
        theirs_cell, speedup = "-", "-"
        if not args.interpret:
            try:
                t_theirs = median_seconds(lambda: theirs(q, k, v, lengths, table), args.repeats)
                theirs_cell, speedup = f"{t_theirs * 1e6:.0f}", f"{t_theirs / t_ours:.2f}x"
            except Exception as e:
                theirs_cell = f"failed ({type(e).__name__})"
        bw = kv_bytes / t_ours
        share = f"{100 * bw / copy_bw:.0f}%" if copy_bw else "-"
        return (f"| {batch} | {context} | {page_size} | {t_ours * 1e6:.0f} | {bw / 1e9:.0f} | {share} | "
                f"{theirs_cell} | {speedup} | {ref_cell} | {diff_cell} |")

    for page_size in page_sizes:
        for context in contexts:
            for batch in batches:
                lines.append(row(batch, context, page_size))
                print(lines[-1], flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
