"""Run by test_parallel.py in a subprocess (forced host devices must be set before JAX starts):
greedy tokens of two tiny models on one device and on meshes of 2 to 8 devices (tensor parallel,
KV heads replicated where the devices outnumber them, data-parallel replicas, both), as JSON."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from tiny_gguf import write_tiny_gguf  # noqa: E402

# (model, name, tensor, data, attention). Model "a": 4 query heads, 2 KV heads; "b": 8 and 2.
RUNS = [
    ("a", "tp1", 1, 1, "xla"), ("a", "tp2", 2, 1, "xla"), ("a", "tp2-pallas", 2, 1, "pallas"),
    ("a", "tp4", 4, 1, "xla"), ("a", "dp2", 1, 2, "xla"), ("a", "tp2-dp2", 2, 2, "xla"),
    ("b", "tp1", 1, 1, "xla"), ("b", "tp8", 8, 1, "xla"), ("b", "tp4-pallas", 4, 1, "pallas"),
    ("g", "tp1", 1, 1, "xla"), ("g", "tp2", 2, 1, "xla"), ("g", "dp2", 1, 2, "xla"),
]
# Model "g": the tiny Gemma 3 checkpoint (sliding window 8: its second page group is sharded too).
GEMMA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "tiny_hf", "gemma3")


def main(workdir: str) -> None:
    from jaxcb.engine_config import make_config
    from jaxcb.llm import LLM, load_model
    from jaxcb.model.config import tiny_config
    from jaxcb.request import SamplingParams

    models = {"a": tiny_config(), "b": tiny_config(num_heads=8, hidden_size=128), "g": None}
    out = {}
    for key, model in models.items():
        path = GEMMA
        if model is not None:
            path = os.path.join(workdir, f"tiny-{key}.gguf")
            write_tiny_gguf(path, model)
        cfg, params, tok, eos = load_model(path)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 40, 17, 90, 33, 1)]
        for _, name, tp, dp, attention in (r for r in RUNS if r[0] == key):
            config = make_config(num_pages=16, max_context=256, decode_batch=(2, 8), prefill_tokens=(32, 64),
                                 tensor_parallel=tp, data_parallel=dp, attention=attention)
            llm = LLM.from_params(cfg, params, tok, config=config, eos_ids=eos)
            llm.warmup()
            engines = llm.replicas.engines if llm.replicas else [llm.engine]
            before = engines[0].stats().compilations
            tokens = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]
            llm.close()
            for e in engines:
                e.pool.check_all_free()
            out[f"{key}-{name}"] = {
                "tokens": tokens, "compilations_after_warmup": engines[0].stats().compilations - before,
                "kv_shards": [[list(x.data.shape) for x in e.runner.kv_arrays[0].addressable_shards] for e in engines],
                "devices": [sorted(d.id for d in e.runner.kv_arrays[0].devices()) for e in engines],
                "preemptions": sum(e.stats().preemptions for e in engines),
                "routed": llm.replicas.routed if llm.replicas else None,
                "load_left": llm.replicas.load if llm.replicas else None,
            }
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
