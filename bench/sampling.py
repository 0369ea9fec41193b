"""The jitted sampler (jaxcb.device.sampling.sample) alone, one step's rows at once: greedy, temperature,
top-p on peaked logits (a cut among each row's best tokens) and on flat ones (a cut far down the
vocabulary), top logprobs; random logits of SmolLM2's and Gemma 3's vocabulary sizes, median of 7.

    .venv/bin/python -m bench.sampling [--rows 32] [--vocab 49152 262144] [--json FILE]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import machine, write_result


def main():
    import jax
    import jax.numpy as jnp

    from jaxcb.device.sampling import sample
    from jaxcb.host.batch import SamplingRow, StepShape, pack_sampling
    from jaxcb.host.request import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--vocab", type=int, nargs="+", default=[49_152, 262_144])
    p.add_argument("--json")
    args = p.parse_args()
    rows = args.rows
    shape = StepShape(rows, rows, 16, 1)
    settings = {"greedy": (SamplingParams(), 1.0),
                "temperature 0.8": (SamplingParams(temperature=0.8, seed=1), 1.0),
                "top-p 0.95, peaked logits": (SamplingParams(temperature=0.8, top_p=0.95, seed=1), 8.0),
                "top-p 0.95, flat logits": (SamplingParams(temperature=0.8, top_p=0.95, seed=1), 1.0),
                "logprobs 5": (SamplingParams(logprobs=5), 1.0)}
    print(f"machine: {machine()}; {rows} rows, logits standard normal (peaked: times 8)")
    result = {"machine": machine(), "rows": rows, "ms": {}}
    for vocab in args.vocab:
        logits = jnp.asarray(np.random.default_rng(0).standard_normal((rows, vocab)), jnp.float32)
        figures = {}
        for name, (params, scale) in settings.items():
            s = jax.device_put(pack_sampling([SamplingRow(params, 0, [], [])] * rows, shape, vocab))
            x = logits * scale
            run = jax.jit(sample)
            jax.block_until_ready(run(x, s))
            times = []
            for _ in range(7):
                t = time.perf_counter()
                jax.block_until_ready(run(x, s))
                times.append(time.perf_counter() - t)
            figures[name] = round(float(np.median(times)) * 1e3, 2)
        result["ms"][str(vocab)] = figures
        print(f"vocabulary {vocab:7d}: " + "; ".join(f"{k} {v:.1f} ms" for k, v in figures.items()), flush=True)
    write_result(result, args.json, echo=False)


if __name__ == "__main__":
    main()
