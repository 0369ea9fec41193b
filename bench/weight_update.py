"""New weights while serving (jaxcb.weight_update), SmolLM2 on this machine, one process.

    python -m bench.weight_update [--requests 32] [--tokens 64] [--noise 0.01] [--json PATH]

Other weights: the served ones with Gaussian noise of `--noise` times each matrix's own spread (a step of training,
roughly: the tokens change, the model still speaks). Measured:
1. An update's time, the engine idle, from each kind of source: a converted checkpoint (`jaxcb convert`'s format), a
   Hugging Face directory (safetensors), arrays by Hugging Face name in memory, jaxcb's loader layout in memory, the
   served GGUF file (the weights it started with).
2. After each, the workload's greedy tokens against those of an engine built with the same weights (requests that
   differ, target 0); the compilations while the weights are read (a checkpoint's casts may compile) and while the
   engine serves on them (target 0: the step's programs are the ones compiled at warm-up).
3. Under load: the workload running when an update from memory is given; the longest gap between two steps, the
   running requests computed again, and the run's output tokens/s against the same run without an update.
4. Sleep (vLLM's sleep mode): the process's resident memory and the devices' arrays before, asleep at level 1 (the KV
   pages freed, the weights copied to the host) and level 2 (both freed), the time to sleep and to wake, and the
   workload's tokens after waking (level 2: woken by an update) against those before.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from bench.common import machine, write_result


def workload(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    words = ["the", "model", "weights", "policy", "reward", "token", "batch", "train", "rollout", "step", "value"]
    return [tokenizer.encode(" ".join(rng.choice(words, int(rng.integers(8, 60))))) for _ in range(n)]


def greedy(llm, prompts, tokens: int) -> list[list[int]]:
    from jaxcb.host.request import SamplingParams

    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                      ignore_eos=True))]


def run_with_update(llm, prompts, tokens: int, update=None, after_steps: int = 8) -> dict:
    """The workload through the engine's loop; `update` (weights) given after `after_steps` steps."""
    from jaxcb import weight_update
    from jaxcb.host.request import SamplingParams

    engine = llm.engine
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    out, gaps, steps, recomputed, t0 = 0, [], 0, 0, time.perf_counter()
    last = t0
    while engine.has_work():
        if update is not None and steps == after_steps:
            recomputed = len(engine.scheduler.running)
            weight_update.update([engine], update, "under-load")
        out += sum(len(ev.token_ids) for ev in engine.step())
        now = time.perf_counter()
        gaps.append(now - last)
        last, steps = now, steps + 1
    seconds = time.perf_counter() - t0
    return {"output_tokens_per_s": out / seconds, "longest_step_gap_s": max(gaps), "median_step_gap_s":
            float(np.median(gaps)), "recomputed": recomputed, "seconds": seconds}


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def device_mb() -> float:
    import jax

    return sum(a.nbytes for a in jax.live_arrays()) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--noise", type=float, default=0.01)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import jax.numpy as jnp

    from jaxcb.device.runner import compilation_count
    from jaxcb.host.engine_config import load_config
    from jaxcb.llm import LLM, load_model
    from jaxcb.model import checkpoint, hf_loader
    from jaxcb.model.embedded import resolve_model
    from jaxcb.model.llama import params_from_numpy, params_to_weights

    gguf = resolve_model(None)
    config, params, tokenizer, eos = load_model(gguf, jnp.float32)
    served = {k: np.asarray(v) for k, v in params_to_weights(params).items()}
    rng = np.random.default_rng(1)
    other = {k: (v + rng.normal(0, args.noise * float(v.std()), v.shape).astype(v.dtype)) if v.ndim == 3 else v
             for k, v in served.items()}
    prompts = workload(tokenizer, args.requests)
    reference = LLM.from_params(config, params_from_numpy(other), tokenizer, eos_ids=eos, config=load_config(None))
    expected_other = greedy(reference, prompts, args.tokens)
    del reference
    llm = LLM(gguf)
    llm.warmup()
    expected_served = greedy(llm, prompts, args.tokens)
    result = {"machine": machine(), "model": "SmolLM2-135M-Instruct (float32)", "requests": args.requests,
              "tokens": args.tokens, "noise": args.noise, "updates": []}
    with tempfile.TemporaryDirectory() as tmp:
        converted, hf_dir = os.path.join(tmp, "converted"), os.path.join(tmp, "hf")
        checkpoint.save(converted, config, other, tokenizer, "float32")
        os.makedirs(hf_dir)
        from safetensors.numpy import save_file

        state = hf_loader.hf_state_dict(config, other)
        save_file(state, os.path.join(hf_dir, "model.safetensors"))
        with open(os.path.join(hf_dir, "config.json"), "w") as f:  # (SmolLM2's, as its release has it)
            import json

            json.dump({"architectures": ["LlamaForCausalLM"], "vocab_size": config.vocab_size,
                       "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
                       "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
                       "num_key_value_heads": config.num_kv_heads, "max_position_embeddings": config.max_context,
                       "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
                       "tie_word_embeddings": config.tie_embeddings}, f)
        sources = [("converted checkpoint (orbax)", converted, expected_other),
                   ("Hugging Face directory (safetensors)", hf_dir, expected_other),
                   ("state dict by Hugging Face names, in memory", state, expected_other),
                   ("jaxcb loader layout, in memory", other, expected_other),
                   ("the served GGUF file", gguf, expected_served)]
        for name, source, expected in sources:
            t0, before = time.perf_counter(), compilation_count()
            llm.update_weights(source, version=name)
            seconds, reading = time.perf_counter() - t0, compilation_count() - before
            before = compilation_count()
            got = greedy(llm, prompts, args.tokens)
            row = {"source": name, "update_s": seconds, "requests_differing": sum(a != b for a, b in zip(got, expected)),
                   "compilations_reading": reading, "compilations_serving": compilation_count() - before}
            result["updates"].append(row)
            print(f"{name:48s} update {seconds:6.2f} s  differing {row['requests_differing']}/{len(prompts)}  "
                  f"compilations: reading {reading}, serving after {row['compilations_serving']}", flush=True)
    result["changed_tokens"] = sum(a != b for a, b in zip(expected_served, expected_other))
    print(f"requests whose tokens the other weights change: {result['changed_tokens']}/{len(prompts)}")
    compiled = compilation_count()
    plain = run_with_update(llm, prompts, args.tokens)
    loaded = run_with_update(llm, prompts, args.tokens, update=other)
    plain2 = run_with_update(llm, prompts, args.tokens)  # (the served weights are `other` now: the same work)
    result["under_load"] = {"without": [plain, plain2], "with_update": loaded,
                            "compilations_since_warmup": compilation_count() - compiled}
    for label, r in (("without an update", plain), ("with an update at step 8", loaded), ("without (again)", plain2)):
        print(f"{label:28s} {r['output_tokens_per_s']:7.1f} output tok/s, longest step gap "
              f"{r['longest_step_gap_s'] * 1000:7.1f} ms (median {r['median_step_gap_s'] * 1000:.1f} ms), "
              f"recomputed {r['recomputed']}", flush=True)
    print(f"compilations since warm-up: {result['under_load']['compilations_since_warmup']}")
    result["sleep"] = []
    expected = greedy(llm, prompts, args.tokens)
    for level in (1, 2):
        before = {"rss_mb": rss_mb(), "device_mb": device_mb()}
        t0 = time.perf_counter()
        llm.sleep(level)
        slept = time.perf_counter() - t0
        asleep = {"rss_mb": rss_mb(), "device_mb": device_mb()}
        t0 = time.perf_counter()
        if level == 2:
            llm.update_weights(other)
        llm.wake_up()
        woke = time.perf_counter() - t0
        row = {"level": level, "awake": before, "asleep": asleep, "sleep_s": slept, "wake_s": woke,
               "requests_differing": sum(a != b for a, b in zip(greedy(llm, prompts, args.tokens), expected))}
        result["sleep"].append(row)
        print(f"sleep level {level}: resident {before['rss_mb']:.0f} -> {asleep['rss_mb']:.0f} MB, device arrays "
              f"{before['device_mb']:.0f} -> {asleep['device_mb']:.0f} MB; sleep {slept:.2f} s, wake "
              f"{woke:.2f} s{' (with the update)' if level == 2 else ''}; requests differing after "
              f"{row['requests_differing']}/{len(prompts)}", flush=True)
    result["compilations_since_warmup"] = compilation_count() - compiled
    print(f"compilations since warm-up, all: {result['compilations_since_warmup']}")
    print(machine())
    write_result(result, args.json, echo=False)


if __name__ == "__main__":
    main()
