"""Host time per engine step, with the device replaced by a stub.

    .venv/bin/python -m bench.host [--running 32 64 256] [--steps 200] [--sleep-ms 5]

The engine runs its real host side (inbox, scheduler, page pool, prefix cache, packing, output
processing with the SmolLM2 tokenizer's detokenizer) over the simulator's runner
(jaxcb.sim.simulate.SimRunner) on the wall clock, which returns random sampled tokens at once: the time
per step is then all host. With `--sleep-ms`, its results become ready that many milliseconds after
dispatch (a device busy for that long): the step time over (sleep + host) tells how
much of the host work the engine hides behind the device, with async scheduling (the default) and
without it (serial: about 0%).
"""

from __future__ import annotations

import argparse
import json
import time
import types

import numpy as np

from bench.common import machine


class WallClock:
    """The real clock for jaxcb.sim.simulate.SimRunner: waiting for a step's end sleeps until then."""

    now = staticmethod(time.perf_counter)

    def advance_to(self, t: float) -> None:
        if t > time.perf_counter():
            time.sleep(t - time.perf_counter())


def measure(model_config, tokenizer, running: int, steps: int, sleep_s: float, async_scheduling: bool = True) -> dict:
    from jaxcb.host.engine import Engine
    from jaxcb.host.engine_config import make_config
    from jaxcb.host.request import SamplingParams
    from jaxcb.sim.simulate import SimRunner

    batch = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b < running) + (running,)
    config = make_config(num_pages=running * 64 + 1, max_context=1024, decode_batch=batch,
                         prefill_tokens=(64, 128, 256, 512), async_scheduling=async_scheduling)
    # The device: the simulator's runner on the wall clock, each step taking sleep_s, random tokens.
    runner = SimRunner(types.SimpleNamespace(seconds=lambda stats: sleep_s), WallClock(), model_config.vocab_size,
                       rng=np.random.default_rng(0))
    engine = Engine(runner, tokenizer, config)
    rng = np.random.default_rng(1)
    for _ in range(running):  # long outputs: the batch stays full for the whole measurement
        engine.add_request(rng.integers(100, 5000, int(rng.integers(16, 200))).tolist(),
                           SamplingParams(max_tokens=800, ignore_eos=True))
    while engine.stats().running < running or engine.scheduler.waiting:  # admission and prefill first
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    per_step = (time.perf_counter() - t0) / steps
    for rid in list(engine._requests):
        engine.abort(rid)
    engine.run_until_done()
    return {"running": running, "sleep_ms": sleep_s * 1000, "step_ms": round(per_step * 1000, 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--running", type=int, nargs="+", default=[32, 64, 256])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sleep-ms", type=float, default=5.0)
    args = ap.parse_args()
    from jaxcb.llm import load_model

    model_config, _, tokenizer, _ = load_model()
    print(f"machine: {machine()}; host side of the engine, device replaced by a stub")
    results = []
    for n in args.running:
        host = measure(model_config, tokenizer, n, args.steps, 0.0)
        entry = {"running": n, "host_ms_per_step": host["step_ms"]}
        for mode, flag in (("serial", False), ("async", True)):
            slept = measure(model_config, tokenizer, n, args.steps, args.sleep_ms / 1000, async_scheduling=flag)
            hidden = 1 - (slept["step_ms"] - args.sleep_ms) / host["step_ms"]
            entry[f"{mode}_step_ms_with_{args.sleep_ms:g}ms_device"] = slept["step_ms"]
            entry[f"{mode}_host_hidden_fraction"] = round(hidden, 3)
            print(f"{n:4d} running, {mode:6s}: host {host['step_ms']:.3f} ms/step; with a {args.sleep_ms:g} ms "
                  f"device {slept['step_ms']:.3f} ms/step -> {max(hidden, 0):.0%} of the host work hidden", flush=True)
        results.append(entry)
    print(json.dumps({"machine": machine(), "results": results}))


if __name__ == "__main__":
    main()
