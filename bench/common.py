"""Helpers shared by the benchmark scripts: the machine's measured matmul rate and a description."""

from __future__ import annotations

import os
import platform
import time


def machine() -> str:
    import jax

    dev = jax.devices()[0]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    kind = dev.device_kind if dev.platform != "cpu" else f"CPU ({os.cpu_count()} cores: {cpu})"
    return f"{kind}, jax {jax.__version__}"


def matmul_flops_per_s(n: int = 1024, dtype="float32", repeats: int = 10) -> float:
    """Measured rate of a square matmul under jit: the compute ceiling the figures are read against."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), dtype)
    b = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best
