"""The two ways of running a mixture of experts' layer (jaxcb.model.llama.experts) on this machine, same run:
a loop over the experts some token chose, each run over every token (the CPU's way), and the token-expert
pairs grouped by expert through jax.lax.ragged_dot (the GPU's and TPU's way; XLA:CPU runs it as every
expert over every row), at 1 to 256 tokens of a Mixtral-shaped layer scaled to this machine.

    .venv/bin/python -m bench.moe [--hidden 1024] [--intermediate 2048] [--experts 8] [--per-token 2] [--json out]

Each way is jitted alone over the layer's weights (float32) and timed as the best of --repeats runs; the
experts' weight bytes each way reads are printed beside it (the loop's: the chosen experts'; the grouped:
every expert's).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import machine, write_result


def main():
    import jax
    import jax.numpy as jnp

    from jaxcb.model.config import tiny_config
    from jaxcb.model.llama import experts, params_from_numpy, random_weights

    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--per-token", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(machine())
    config = tiny_config(hidden_size=args.hidden, intermediate_size=args.intermediate, num_layers=1, num_heads=8,
                         num_kv_heads=8, head_dim=args.hidden // 8, num_experts=args.experts,
                         experts_per_token=args.per_token)
    layer = jax.tree.map(lambda a: a[0], params_from_numpy(random_weights(config)).layers)
    expert_bytes = 3 * args.hidden * args.intermediate * 4
    rows = []
    rng = np.random.default_rng(0)
    for t in args.tokens:
        x = jnp.asarray(rng.standard_normal((t, args.hidden)).astype(np.float32))
        own = "loop"
        logits = np.asarray(x) @ np.asarray(layer.router)
        chosen = len(np.unique(np.argsort(-logits, axis=-1)[:, :args.per_token]))  # (the softmax keeps the order)
        times = {}
        for way, grouped in ((own, False), ("grouped", True)):
            f = jax.jit(lambda x, g=grouped: experts(config, x, layer, grouped=g))
            f(x).block_until_ready()
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                f(x).block_until_ready()
                best = min(best, time.perf_counter() - t0)
            times[way] = best * 1e3
        read = chosen
        row = {"tokens": t, "cpu_way": own, "cpu_ms": times[own], "grouped_ms": times["grouped"],
               "cpu_way_expert_mib": read * expert_bytes / 2**20, "all_experts_mib": args.experts * expert_bytes / 2**20}
        rows.append(row)
        print(f"{t:4d} tokens: {own:5s} {times[own]:8.2f} ms (experts read {row['cpu_way_expert_mib']:6.0f} MiB)   "
              f"grouped (ragged_dot) {times['grouped']:8.2f} ms ({row['all_experts_mib']:.0f} MiB)   "
              f"grouped / {own} = {times['grouped'] / times[own]:.2f}", flush=True)
    write_result({"machine": machine(), "shape": vars(args), "rows": rows}, args.json, echo=False)


if __name__ == "__main__":
    main()
