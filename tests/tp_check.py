"""Run by test_parallel.py in a subprocess (forced host devices must be set before JAX starts):
greedy tokens of two tiny models on one device and on meshes of 2 to 8 devices (tensor parallel,
KV heads replicated where the devices outnumber them, data-parallel replicas, both), as JSON."""

import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import numpy as np

from tests.tiny_gguf import write_tiny_gguf

# (model, name, tensor, data, attention, weights). Model "a": 4 query heads, 2 KV heads; "b": 8 and 2.
# A run's reference is its model's "tp1" run with the same weights ("tp1-int4" for "tp2-int4"); the
# int8 runs also keep their KV pages in int8; a "spec" run speculates (n-gram proposals, all kept).
RUNS = [
    ("a", "tp1", 1, 1, "xla", "auto"), ("a", "tp2", 2, 1, "xla", "auto"), ("a", "tp2-pallas", 2, 1, "pallas", "auto"),
    ("a", "tp4", 4, 1, "xla", "auto"), ("a", "tp2-dp2", 2, 2, "xla", "auto"), ("a", "tp2-dp2-spec", 2, 2, "xla", "auto"),
    ("a", "tp1-int4", 1, 1, "xla", "int4"), ("a", "tp2-int4", 2, 1, "xla", "int4"),
    ("b", "tp1-int8", 1, 1, "xla", "int8"), ("b", "tp8-int8", 8, 1, "xla", "int8"),
    ("b", "tp4-pallas-int8", 4, 1, "pallas", "int8"),
    ("g", "tp1", 1, 1, "xla", "auto"), ("g", "tp2", 2, 1, "xla", "auto"), ("g", "dp2", 1, 2, "xla", "auto"),
    ("a", "tp1-lora", 1, 1, "xla", "auto"), ("a", "tp2-lora", 2, 1, "xla", "auto"),
    ("a", "tp2-dp2-lora", 2, 2, "xla", "auto"), ("a", "tp4-lora", 4, 1, "xla", "auto"),
    ("a", "tp2-draft", 2, 1, "xla", "auto"), ("a", "tp2-direct-int4", 2, 1, "xla", "int4"),
    ("a", "tp4-direct", 4, 1, "xla", "auto"), ("a", "tp2-direct-draft", 2, 1, "xla", "auto"),
    ("m", "tp1", 1, 1, "xla", "auto"), ("m", "tp2", 2, 1, "xla", "auto"),
    ("m", "tp1-int8", 1, 1, "xla", "int8"), ("m", "tp2-int8", 2, 1, "xla", "int8"),
    ("o", "tp1", 1, 1, "xla", "auto"), ("o", "tp2", 2, 1, "xla", "auto"),
    ("s", "tp1", 1, 1, "xla", "auto"), ("s", "tp2", 2, 1, "xla", "auto"), ("s", "tp2-pallas", 2, 1, "pallas", "auto"),
    ("d", "tp1", 1, 1, "xla", "auto"), ("d", "tp2", 2, 1, "xla", "auto"),
]
# A "direct" run builds its engine from the file (LLM(path)): the weights are placed on the mesh as they are read
# (K and V whole on every device where the KV heads are replicated, at TP 4), not loaded onto one device first;
# "direct-draft" reads a draft model (the same file's first layer) onto the mesh so too.
# A "lora" run serves two LoRA adapters (all projections) beside the base model, rows of all three mixed
# (at TP 4 over model a's 2 KV heads the adapters' k/v columns are replicated with the heads). A "draft"
# run speculates with a draft model (the target's first layer), split over the mesh as the target is.
# Model "g": the tiny Gemma 3 checkpoint (sliding window 8: its second page group is sharded too); "m": the
# tiny Qwen2-MoE (a mixture of experts: each expert's columns split as a dense MLP's, and its shared expert's);
# "o": the tiny OLMo 2 (q and k normed over all their heads, which are split over the devices); "s": the tiny
# gpt-oss (attention sinks split with their heads, in plain JAX and from the Pallas kernels' log-sum-exps;
# the experts' biases split with their columns); "d": the tiny DeepSeek-V3 (a dense layer, then experts' layers:
# each kind's matrices split by columns, stacked over its own layers; latent attention: its one KV head, the
# rotated part and the latent, a copy on each device; the heads' up-projections split).
# The models whose runs take new weights while serving, then answer the same requests again (tokens compared with
# the single device's after its own update).
UPDATED = ("a", "g")
TINY_HF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "tiny_hf")


def main(workdir: str) -> None:
    import jax

    from jaxcb.host.engine_config import make_config
    from jaxcb.host.lora import LoraConfig
    from tests.lora_util import write_adapter
    from jaxcb.host.request import SamplingParams
    from jaxcb.host.speculative import SpeculativeConfig
    from jaxcb.host.structured import Constraint
    from jaxcb.llm import LLM, load_model
    from jaxcb.model.llama import head_rows
    from jaxcb.model.config import tiny_config

    models = {"a": tiny_config(), "b": tiny_config(num_heads=8, hidden_size=128),
              "g": os.path.join(TINY_HF, "gemma3"), "m": os.path.join(TINY_HF, "qwen2moe"),
              "o": os.path.join(TINY_HF, "olmo2"), "s": os.path.join(TINY_HF, "gpt-oss"),
              "d": os.path.join(TINY_HF, "deepseek-v3")}
    out = {}
    for key, model in models.items():
        path = model
        if not isinstance(model, str):
            path = os.path.join(workdir, f"tiny-{key}.gguf")
            write_tiny_gguf(path, model)
        loaded = {}
        for _, name, tp, dp, attention, weights in (r for r in RUNS if r[0] == key):
            t0 = time.perf_counter()
            if weights not in loaded:  # quantized as the engine loads them (jaxcb.model.quant)
                loaded[weights] = load_model(path, weights=weights)
            cfg, params, tok, eos = loaded[weights]
            rng = np.random.default_rng(0)
            prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 40, 17, 90, 33, 1)]
            config = make_config(num_pages=16, max_context=256, decode_batch=(8,), prefill_tokens=(64,), tokens=(72,),
                                 tensor_parallel=tp, data_parallel=dp, attention=attention, weights=weights,
                                 kv_dtype="int8" if weights == "int8" else "auto",  # int8 runs: int8 KV too
                                 compile="fast",  # tiny models: server_util.compile_mode
                                 speculative=SpeculativeConfig("ngram", adaptive=False) if "spec" in name
                                 else SpeculativeConfig("draft", num_tokens=3, draft_layers=1, adaptive=False,
                                                        draft_model=path if "direct" in name else "")
                                 if "draft" in name else SpeculativeConfig(),
                                 lora=LoraConfig(max_loras=2, max_rank=4) if "lora" in name else None)
            if "direct" in name:  # (every stack built on the mesh a layer at a time, as a large model's are)
                from jaxcb.model import llama

                llama.LAYERWISE_BYTES, before = 0, llama.LAYERWISE_BYTES
                llm = LLM(path, config=config)
                llama.LAYERWISE_BYTES = before
            else:
                llm = LLM.from_params(cfg, params, tok, config=config, eos_ids=eos)
            adapters = ("",)
            if "lora" in name:
                adapters = ("", "x", "y")
                for seed, a in enumerate(adapters[1:]):
                    write_adapter(os.path.join(workdir, f"{key}-{a}"), cfg, rank=4, seed=seed)
                    (llm.replicas or llm.engine).load_lora(a, os.path.join(workdir, f"{key}-{a}"))
            llm.warmup()
            t1 = time.perf_counter()
            engines = llm.replicas.engines if llm.replicas else [llm.engine]
            before = engines[0].stats().compilations
            params = [SamplingParams(max_tokens=24, ignore_eos=True, lora=adapters[i % len(adapters)])
                      for i in range(len(prompts))]
            if tok is not None:  # a structured-output row among them: its mask is a step input like any other
                params[2] = SamplingParams(max_tokens=24, structured=Constraint("regex", "[a-z]{3,40}"))
            tokens = [o.token_ids for o in llm.generate(prompts, params)]
            pooled = llm.generate(prompts[:3], [SamplingParams(max_tokens=0, pooling=m)
                                                for m in ("last", "mean", "last")])
            compiled = engines[0].stats().compilations - before
            rows = head_rows(engines[0].runner.params, [3, 7, cfg.vocab_size - 1])  # (a from-token classifier's)
            updated = None
            if key in UPDATED:  # new weights while serving (jaxcb.weight_update), then the same requests again: the
                # steps compile nothing (the update may: the KV heads' copies made on the mesh)
                llm.update_weights(new_weights(key, path, workdir), version="next")
                before = engines[0].stats().compilations
                updated = [o.token_ids for o in llm.generate(prompts, params)]
                compiled += engines[0].stats().compilations - before
            llm.close()
            for e in engines:
                e.pool.check_all_free()
            out[f"{key}-{name}"] = {
                "tokens": tokens, "compilations_after_warmup": compiled, "updated_tokens": updated,
                "embeddings": [o.embedding.tolist() for o in pooled],
                "head_rows": rows.tolist(),
                "kv_shards": [[list(x.data.shape) for x in e.runner.kv_arrays[0].addressable_shards] for e in engines],
                "kv_dtype": str(engines[0].runner.kv_arrays[0].dtype),
                "devices": [sorted(d.id for d in e.runner.kv_arrays[0].devices()) for e in engines],
                "preemptions": sum(e.stats().preemptions for e in engines),
                "speculative_accepted": sum(e.stats().speculative_accepted for e in engines),
                "wq_shards": [list(x.data.shape) for x in jax.tree.leaves(engines[0].runner.params.layers.wq)[0]
                              .addressable_shards] if engines[0].runner.params.layers.wq is not None else None,
                "routed": llm.replicas.routed if llm.replicas else None,
                "lora_b_wq_shards": [list(x.data.shape) for x in engines[0].runner.lora.arrays["b"]["wq"]
                                     .addressable_shards] if "lora" in name else None,
                "load_left": llm.replicas.load if llm.replicas else None,
                "draft_wq_shards": [list(x.data.shape) for x in engines[0].draft_runner.params.layers.wq
                                    .addressable_shards] if "draft" in name else None,
            }
            print(f"{key}-{name}: build and warm-up {t1 - t0:.1f} s, generate {time.perf_counter() - t1:.1f} s",
                  file=sys.stderr, flush=True)
    out["placed"] = placed_where_read(models["d"], 2)
    converted = os.path.join(workdir, "a-int8-converted")  # (jaxcb convert's checkpoint of model a, int8)
    from jaxcb.model import checkpoint
    from jaxcb.model.llama import params_to_weights

    cfg, params, tok, _ = load_model(os.path.join(workdir, "tiny-a.gguf"), weights="int8")
    checkpoint.save(converted, cfg, params_to_weights(params), tok, "float32", "int8")
    out["placed_converted"] = placed_where_read(converted, 4)
    print(json.dumps(out))


def new_weights(key: str, path: str, workdir: str):
    """Other weights of model `key` (UPDATED): a GGUF file's of other random weights, or (a Hugging Face checkpoint)
    its state dict by its own names, each tensor shifted by a little noise."""
    if path.endswith(".gguf"):
        other = os.path.join(workdir, f"tiny-{key}-next.gguf")
        if not os.path.exists(other):
            from jaxcb.llm import read_model_config

            write_tiny_gguf(other, read_model_config(path), seed=1)
        return other
    from safetensors.numpy import load_file

    rng = np.random.default_rng(1)
    state = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(path, f)))
    return {n: (t + rng.normal(0, 0.05, t.shape).astype(t.dtype)) if t.dtype.kind == "f" else t for n, t in state.items()}


def placed_where_read(path: str, tensor: int) -> dict:
    """load_model onto a mesh of `tensor` devices: how many devices each weight's arrays span as they come back
    (before any runner), and the weights not split as the tensor-parallel layout says (jaxcb.device.parallel:
    param_spec; K and V whole on every device where the KV heads are to be replicated); the weights that differ,
    in values or split, when every stack is built on the mesh a layer at a time."""
    import jax
    from jax.sharding import NamedSharding

    from jaxcb.device.parallel import kv_replication, make_mesh, param_spec, replicated
    from jaxcb.llm import load_model
    from jaxcb.model.llama import params_to_weights

    from jaxcb.model import llama

    mesh = make_mesh(tensor)
    config, params = load_model(path, mesh=mesh)[:2]
    weights = params_to_weights(params)
    llama.LAYERWISE_BYTES, before = 0, llama.LAYERWISE_BYTES  # (and every stack built on the mesh a layer at a time)
    by_layer = params_to_weights(load_model(path, mesh=mesh)[1])
    llama.LAYERWISE_BYTES = before
    differ = [n for n, w in weights.items()
              if not all(np.array_equal(np.asarray(a), np.asarray(b)) and a.sharding == b.sharding
                         for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(by_layer[n])))]
    if os.path.isdir(os.path.join(path, "params")):  # (a converted checkpoint: as orbax restores it, before any move)
        from jaxcb.device.parallel import Placement
        from jaxcb.model import checkpoint

        weights = checkpoint.load(path, None, Placement(mesh, config).shardings)[1]
    copied = kv_replication(config, tensor) > 1

    def expected(name):
        return replicated(mesh) if copied and name in ("wk", "wv", "bk", "bv") else NamedSharding(mesh, param_spec(name))

    return {"count": len(weights), "copied": copied, "by_layer_differ": differ,
            "devices": sorted({len(a.sharding.device_set) for w in weights.values() for a in jax.tree.leaves(w)}),
            "elsewhere": [n for n, w in weights.items() if getattr(w, "q", w).sharding != expected(n)]}


if __name__ == "__main__":
    main(sys.argv[1])
