"""The native layer matmul (kernels_cpu.layer_matmul) per weight format: a 30-layer scan of SmolLM2's
MLP up-projection shape (576 x 1536, random weights) at 1, 2, 4, 8, 32 and 128 rows, float32 / int8 (per column) /
int4 (groups of 32) / w8a8 (int8 weights per column, rows of x quantized per 32 values, VNNI's integer
sums where the build has them) / w4a8 (int4 weights, the same rows of x), best of 9, in one process. Each
stack as the engine holds it (jaxcb.model.quant.blocked_layers): float32 blocked, w8a8 and w4a8 in quad
blocks where the build has VNNI; "w8a8 packed" / "w4a8 packed": the same in their stored layout, each
slab packed as it is read.

    .venv/bin/python -m bench.layer_matmul
"""

from __future__ import annotations

import time

import numpy as np

from bench.common import machine


def main():
    import jax
    import jax.numpy as jnp

    import kernels_cpu
    from jaxcb.model.quant import ACT_BLOCK, quantize_int4, quantize_int8

    layers, k, n = 30, 576, 1536
    rng = np.random.default_rng(0)
    w = rng.standard_normal((layers, k, n)).astype(np.float32)
    q8 = jax.tree.map(jnp.asarray, quantize_int8(w, 0))
    q4 = jax.tree.map(jnp.asarray, quantize_int4(w, 32))
    wf = jax.jit(kernels_cpu.block_stack)(jnp.asarray(w))
    quads = kernels_cpu.vnni()
    q8q = jax.jit(kernels_cpu.quad_block)(q8.q) if quads else q8.q
    q4q = jax.jit(kernels_cpu.quad_block)(q4.q) if quads else q4.q

    def scan(fn):
        def f(x):
            return jax.lax.scan(lambda h, layer: (h, fn(h, layer)), x, jnp.arange(layers, dtype=jnp.int32))[1]
        return jax.jit(f)

    kinds = {"float32": scan(lambda h, i: kernels_cpu.layer_matmul(h, wf, i)),
             "int8": scan(lambda h, i: kernels_cpu.layer_matmul(h, q8.q, i, q8.scale)),
             "int4": scan(lambda h, i: kernels_cpu.layer_matmul(h, q4.q, i, q4.scale, q4.offset)),
             "w8a8": scan(lambda h, i: kernels_cpu.layer_matmul(h, q8q, i, q8.scale, act_block=ACT_BLOCK)),
             "w4a8": scan(lambda h, i: kernels_cpu.layer_matmul(h, q4q, i, q4.scale, q4.offset, act_block=ACT_BLOCK))}
    if quads:
        kinds["w8a8 packed"] = scan(lambda h, i: kernels_cpu.layer_matmul(h, q8.q, i, q8.scale, act_block=ACT_BLOCK))
        kinds["w4a8 packed"] = scan(lambda h, i: kernels_cpu.layer_matmul(h, q4.q, i, q4.scale, q4.offset,
                                                                          act_block=ACT_BLOCK))
    print(f"machine: {machine()}; {layers} layers of {k} x {n}, best of 9; quad blocks: {quads}")
    for m in (1, 2, 4, 8, 32, 128):
        x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
        line = []
        for name, f in kinds.items():
            f(x).block_until_ready()
            best = float("inf")
            for _ in range(9):
                t = time.perf_counter()
                f(x).block_until_ready()
                best = min(best, time.perf_counter() - t)
            line.append(f"{name} {best * 1e3:6.2f} ms ({2 * m * k * n * layers / best / 1e9:5.1f} GFLOP/s)")
        print(f"rows {m:2d}: " + " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
