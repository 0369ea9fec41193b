"""Helpers shared by the benchmark scripts: the machine's description, its measured matmul and memory
rates, and writing a result."""

from __future__ import annotations

import json
import os
import time

# The held-out prose (not in any golden file): perplexity, scoring workloads, the offline lm-eval task.
HELDOUT_PROSE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data",
                             "heldout_prose.txt")


def machine() -> str:
    import jax

    from serve.benchmark import cpu_name

    dev = jax.devices()[0]
    kind = dev.device_kind if dev.platform != "cpu" else f"CPU ({os.cpu_count()} cores: {cpu_name()})"
    return f"{kind}, jax {jax.__version__}"


def decode_inputs(engine, rows: int, context: int):
    """A decode step of `rows` sequences at `context` tokens each (pages 1, 2, ... in order) for the
    engine's runner: (batch, sampling, shape), or None where its pool has too few pages."""
    from jaxcb.host.batch import SamplingRow, SeqSpec, pack, pack_sampling
    from jaxcb.host.request import SamplingParams

    config, model = engine.config, engine.model_config
    s = config.page_size
    n = -(-context // s)
    if rows * n + 1 > engine.runner.num_pages:
        return None
    seqs = [SeqSpec([1], context - 1, list(range(1 + i * n, 1 + (i + 1) * n))) for i in range(rows)]
    shape = config.buckets.step_shape(rows, s, config.max_context_for(model))
    sampling = pack_sampling([SamplingRow(SamplingParams(), 0, [], [])] * rows, shape, model.vocab_size)
    return pack(seqs, shape, s), sampling, shape


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


def copy_rate(nbytes: int = 1 << 30, dtype="float32", repeats: int = 5) -> float:
    """Bytes per second read by a jitted streaming copy (x * 2) of an `nbytes` array (as many are
    written): the memory rate a kernel that reads each byte once can hope for. In place (donated, each
    run's output the next one's input): no fresh output pages to fault in."""
    import jax

    return _bytes_per_s(jax.jit(lambda a: a * 2, donate_argnums=0), nbytes, dtype, repeats, chain=True)


def read_rate(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second read by a jitted sum of an `nbytes` float32 array: the rate at which a kernel that
    only reads (weights streamed once a step) can hope to take its bytes in (above the copy rate)."""
    import jax
    import jax.numpy as jnp

    return _bytes_per_s(jax.jit(jnp.sum), nbytes, "float32", repeats, chain=False)


def _bytes_per_s(f, nbytes: int, dtype, repeats: int, chain: bool) -> float:
    """An array's bytes over the best of `repeats` timed runs of `f` on it (after one untimed run);
    `chain`: each run's output is the next run's input."""
    import jax.numpy as jnp

    x = jnp.ones((nbytes // jnp.dtype(dtype).itemsize,), dtype)
    best = float("inf")
    for i in range(repeats + 1):
        t = time.perf_counter()
        out = f(x).block_until_ready()
        if i:
            best = min(best, time.perf_counter() - t)
        if chain:
            x = out
    return x.nbytes / best


def write_result(result: dict, path: str | None, echo: bool = True) -> None:
    """A benchmark's closing step: its result as one JSON line on stdout (the last line, for scripts that
    read it) and, when `path` is given, indented into that file."""
    if echo:
        print(json.dumps(result))
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def warmed_engine(model: str | None, config: str | None):
    """The engine of a model and config file (jaxcb.llm.build_engine), warmed up: (engine, the step shapes
    compiled, the warm-up's seconds). Benchmarks that compare modes build further engines on its runner."""
    from jaxcb.llm import build_engine

    engine = build_engine(model, config)
    t0 = time.perf_counter()
    shapes = engine.warmup()
    return engine, shapes, time.perf_counter() - t0
