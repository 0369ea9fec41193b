"""The CPU decode attention alone: the step's ragged attention (the native kernel, or plain JAX) over every
layer of a SmolLM2-shaped cache, timed directly, against a copy measured in the same process.

    .venv/bin/python -m bench.attention_cpu [--rows 1 4 32] [--contexts 128 512 2048] [--attention native xla]
                                            [--scatter] [--compare REV_OR_LIB ...] [--flags FLAGS]

`bench.step` takes attention as a step's time less the time of the same step without it: at a few rows
and short contexts that is a difference of two ~30 ms figures that move by a few ms between processes.
Here one jitted program runs the attention of all 30 layers (a scan, each layer's call reading its own
pages, as the step does) and nothing else; the figure is the best of --repeats runs (more for a point
whose runs take under MIN_SECONDS in all: a 0.3 ms point's best of 20 moved 2x between processes), and
the live K/V read rate (each sequence's keys and values once per layer) is set against the copy rate
measured among the point's own runs (bench.common.copy_rate's program, a donated jitted copy of 1 GiB, run
between the point's rounds, best of about --repeats): this machine's memory rate moves by up to 2x within
one process (43.5 GB/s at its start, 27.2 at its end in one run), so a copy measured minutes away says
little about a point. Each sequence's pages are consecutive in the pool, or with --scatter lie anywhere
in it (as in a pool after hours of serving); the pool is in 2 MiB pages, as the engine's runner has it.

--compare times the native kernel of this tree against other builds of it in the same process, runs
interleaved: each REV_OR_LIB is a git revision (its kernels_cpu sources are built into a temporary
folder) or a built library's path. Each build is registered as its own FFI target, so every point runs
the same arrays through each build in turn; the copy rate of this machine moves by up to 2x between
processes, which leaves separate runs unable to tell a 10% change. --flags adds compiler flags to every
build (e.g. -mno-avx512f for the AVX2 code on an AVX-512 CPU).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import machine, write_result

LAYERS, HEADS, KV_HEADS, HEAD_DIM, PAGE = 30, 9, 3, 64, 16  # SmolLM2-135M
MIN_SECONDS = 0.5  # each point runs at least --repeats times and at least this long
COPY_BYTES = 1 << 30  # the copy measured among each point's runs, as bench.common.copy_rate's


def point_seconds(rows: int, context: int, kernels: list, repeats: int,
                  scatter: bool = False) -> tuple[list[float], float]:
    """The best time of each kernel on one point's arrays, runs interleaved, and the copy rate measured
    between them (bytes read per second): a kernel is True (this build's native kernel), False (plain
    JAX) or the name of a registered FFI target (--compare)."""
    import jax
    import jax.numpy as jnp

    import jaxcb.model.llama  # noqa: F401 - registers the packed step's types as pytrees
    import kernels_cpu
    from jaxcb.device import huge_pages
    from jaxcb.host.batch import SeqSpec, StepShape, pack
    from jaxcb.model.paged_attention import ragged_attention

    rng = np.random.default_rng(rows * 10000 + context)
    per_seq = -(-context // PAGE)
    pages = rows * per_seq + 1
    kv = jnp.asarray(rng.standard_normal((LAYERS, 2, KV_HEADS, pages, PAGE, HEAD_DIM), np.float32))
    if huge_pages.enabled():  # in 2 MiB pages, as the engine's runner has its pages (JAXCB_HUGE_PAGES=0: not)
        huge_pages.collapse(kv)
    ids = np.arange(1, pages)
    if scatter:
        rng.shuffle(ids)
    specs = [SeqSpec([0], context - 1, ids[i * per_seq:(i + 1) * per_seq].tolist()) for i in range(rows)]
    batch = jax.tree.map(jnp.asarray, pack(specs, StepShape(tokens=rows, seqs=rows, pages_per_seq=per_seq,
                                                            history=per_seq * PAGE), PAGE))
    q = jnp.asarray(rng.standard_normal((rows, HEADS, HEAD_DIM), np.float32))

    def program(kernel):
        def attend(q, kv, layer, batch):
            if isinstance(kernel, str):  # another build (--compare): the kernel's own call, as the step makes it
                scaled = q * (1.0 / HEAD_DIM**0.5)
                return kernels_cpu.ragged_attention(scaled, kv, layer, batch.kv_lens, batch.page_table,
                                                    batch.cu_q_lens, batch.num_seqs, target=kernel)
            return ragged_attention(q, kv, layer, batch, native=kernel)

        @jax.jit
        def every_layer(q, kv, batch):
            def one(total, layer):
                return total + attend(q, kv, layer, batch), None

            return jax.lax.scan(one, jnp.zeros_like(q), jnp.arange(LAYERS, dtype=jnp.int32))[0]

        every_layer(q, kv, batch).block_until_ready()
        return every_layer

    programs = [program(k) for k in kernels]
    copy = jax.jit(lambda a: a * 2, donate_argnums=0)
    block = copy(jnp.ones((COPY_BYTES // 4,), jnp.float32)).block_until_ready()
    best, spent, runs, best_copy, copies = [float("inf")] * len(kernels), 0.0, 0, float("inf"), 0
    while runs < repeats or spent < MIN_SECONDS:  # short points run more often: their best is noisier
        if copies < 1 + repeats * min(1.0, spent / MIN_SECONDS):  # about `repeats` copies, spread over the point
            t = time.perf_counter()
            block = copy(block).block_until_ready()
            best_copy = min(best_copy, time.perf_counter() - t)
            copies += 1
        for i in (range(len(programs)) if runs % 2 == 0 else reversed(range(len(programs)))):  # no one always first
            every_layer = programs[i]
            t = time.perf_counter()
            every_layer(q, kv, batch).block_until_ready()
            best[i] = min(best[i], time.perf_counter() - t)
            spent += (time.perf_counter() - t) / len(programs)
        runs += 1
    return best, COPY_BYTES / best_copy


def register_build(spec: str, index: int, flags: str) -> str:
    """Registers another build of the native attention as its own FFI target and returns the target's
    name: `spec` is a built library's path, or a git revision whose kernels_cpu sources are built here."""
    import ctypes

    import jax

    from kernels_cpu import build

    if os.path.isfile(spec):
        library = spec
    else:
        folder = Path(tempfile.mkdtemp(prefix="jaxcb-compare-"))
        for source in build.SOURCES + build.HEADERS:
            shown = subprocess.run(["git", "show", f"{spec}:kernels_cpu/{source.name}"], capture_output=True)
            if shown.returncode == 0:  # a header the revision did not have yet is not needed by it
                (folder / source.name).write_bytes(shown.stdout)
        if not (folder / build.SOURCES[0].name).exists():
            raise SystemExit(f"--compare {spec}: neither a library file nor a revision with kernels_cpu sources")
        library = str(folder / "libjaxcb_cpu_kernels.so")
        print(f"building {spec}'s kernels (flags: {flags or 'none'}) ...", flush=True)
        build.compile_library(library, folder)
    target = f"jaxcb_ragged_attention_compare_{index}"
    lib = ctypes.cdll.LoadLibrary(library)
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.JaxcbRaggedAttention), platform="cpu")
    return target


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--attention", nargs="+", default=["native"], choices=["native", "xla"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--scatter", action="store_true", help="each sequence's pages anywhere in the pool")
    ap.add_argument("--compare", nargs="+", default=[], metavar="REV_OR_LIB",
                    help="other builds of the native kernel, timed beside this tree's in the same process")
    ap.add_argument("--flags", default="", help="extra compiler flags for every build (JAXCB_KERNEL_FLAGS)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.flags:
        os.environ["JAXCB_KERNEL_FLAGS"] = f"{os.environ.get('JAXCB_KERNEL_FLAGS', '')} {args.flags}".strip()
    kernels = [attention == "native" for attention in args.attention]
    names = list(args.attention)
    if args.compare:
        import kernels_cpu

        assert kernels_cpu.available(), kernels_cpu.unavailable_reason()
        for i, spec in enumerate(args.compare):
            kernels.append(register_build(spec, i, os.environ.get("JAXCB_KERNEL_FLAGS", "")))
            names.append(spec)
    results = []
    for rows in args.rows:
        for context in args.contexts:
            times, copy = point_seconds(rows, context, kernels, args.repeats, args.scatter)
            live = LAYERS * rows * context * KV_HEADS * HEAD_DIM * 4 * 2
            for name, seconds in zip(names, times):
                results.append({"attention": name, "rows": rows, "context": context, "ms": round(seconds * 1e3, 3),
                                "live_kv_gb_per_s": round(live / seconds / 1e9, 2),
                                "copy_gb_per_s": round(copy / 1e9, 2), "of_copy": round(live / seconds / copy, 3),
                                "of_first": round(times[0] / seconds, 3)})
    layout = "scattered" if args.scatter else "consecutive"
    print(f"machine: {machine()}; SmolLM2-shaped decode attention, {LAYERS} layers, float32 pages of {PAGE}; "
          f"{layout} pages; each point against the copy rate (bytes read; as many written) measured among its runs")
    width = max(map(len, names))
    for r in results:
        against = f", {r['of_first']:.2f}x the speed of {names[0]}" if len(names) > 1 else ""
        print(f"{r['attention']:{width}s} rows {r['rows']:3d} context {r['context']:5d}: {r['ms']:8.3f} ms, "
              f"{r['live_kv_gb_per_s']:6.2f} GB/s of live K/V, {100 * r['of_copy']:3.0f}% of copy "
              f"({r['copy_gb_per_s']:.1f} GB/s){against}")
    write_result({"machine": machine(), "scatter": args.scatter, "results": results}, args.json)


if __name__ == "__main__":
    main()
