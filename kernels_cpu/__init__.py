"""Native CPU kernels, called from the jitted step through XLA's FFI (the CPU backend only).

`ragged_attention(...)` is `jaxcb.model.paged_attention.ragged_attention` (its oracle) for a packed step:
every sequence's new tokens (decode rows and prefill chunks) over its own paged keys and values, causal,
in one pass over each page per block of queries (paged_attention.cc).
`layer_matmul(x, w, layer)` is x @ w[layer] for float32 weights stacked over layers, read in place
inside the layer scan (matmul.cc), where XLA would copy the layer's matrix out of the stack first.
`available()` builds the library on first use (kernels_cpu.build) and registers it with XLA; where it
cannot be built it is False and the engine keeps the plain-JAX attention, which is also the oracle.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger("jaxcb.kernels_cpu")

TARGET = "jaxcb_ragged_attention"
MATMUL_TARGET = "jaxcb_layer_matmul"


@functools.cache
def _load() -> str | None:
    """Builds and registers the library; returns None on success, else why it is not available."""
    import jax

    from kernels_cpu import build

    try:
        path = build.build()
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxcbRaggedAttention), platform="cpu")
        jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(lib.JaxcbLayerMatmul), platform="cpu")
    except Exception as e:  # no compiler, a failed build: the plain-JAX path stays
        log.warning("native CPU kernels unavailable (%s); using the plain-JAX step", e)
        return str(e)
    return None


def available() -> bool:
    return _load() is None


def unavailable_reason() -> str | None:
    return _load()


def ragged_attention(q, kv_pages, layer, kv_lens, page_table, cu_q_lens, num_seqs, window=0, softcap=0.0):
    """q [T, H, D] float32, already multiplied by the score scale; kv_pages [L, 2, K, P, S, W] float32,
    bfloat16 or int8 (W = D + 4); layer, window scalars; kv_lens [M]; page_table [M, N]; cu_q_lens
    [M + 1]; num_seqs [1]. Returns [T, H, D] float32: sequence i's tokens cu_q_lens[i]:cu_q_lens[i+1]
    are the last of its kv_lens[i] keys, each attends causally to the keys up to its own position
    (only the last `window` when window > 0); padding rows and sequences without keys give zeros.
    `softcap` (static): scores become softcap * tanh(scores / softcap)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    assert available(), unavailable_reason()
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), kv_pages, i32(layer), i32(kv_lens), i32(page_table), i32(cu_q_lens),
                i32(num_seqs).reshape(1), i32(window), softcap=np.float32(softcap))


def layer_matmul(x, w, layer):
    """x [..., K] float32 @ w [L, K, N] float32 at `layer` (a scalar, may be traced) -> [..., N] float32,
    reading the layer's matrix in place."""
    import jax
    import jax.numpy as jnp

    assert available(), unavailable_reason()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    call = jax.ffi.ffi_call(MATMUL_TARGET, jax.ShapeDtypeStruct((x2.shape[0], w.shape[2]), jnp.float32))
    return call(x2, w, jnp.asarray(layer, jnp.int32)).reshape(*lead, w.shape[2])
