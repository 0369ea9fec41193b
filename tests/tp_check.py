"""Run by test_parallel.py in a subprocess (forced host devices must be set before JAX starts):
greedy tokens of the tiny model on one device and under tensor parallelism, as JSON."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from tiny_gguf import write_tiny_gguf  # noqa: E402


def main(workdir: str) -> None:
    from jaxcb.engine_config import make_config
    from jaxcb.llm import LLM, load_model
    from jaxcb.request import SamplingParams

    path = os.path.join(workdir, "tiny.gguf")
    write_tiny_gguf(path)
    cfg, params, tok, eos = load_model(path)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 40, 17, 90, 33, 1)]
    out = {}
    for name, tp, attention in (("tp1", 1, "xla"), ("tp2", 2, "xla"), ("tp2-pallas", 2, "pallas")):
        config = make_config(num_pages=16, max_context=256, decode_batch=(1, 2, 4, 8), prefill_tokens=(16, 32, 64),
                             tensor_parallel=tp, attention=attention)
        llm = LLM.from_params(cfg, params, tok, config=config, eos_ids=eos)
        llm.warmup()
        before = llm.engine.stats().compilations
        tokens = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]
        llm.engine.pool.check_all_free()
        out[name] = {"tokens": tokens, "compilations_after_warmup": llm.engine.stats().compilations - before,
                     "kv_shards": [list(x.data.shape) for x in llm.engine.runner.kv_pages.addressable_shards],
                     "preemptions": llm.engine.stats().preemptions}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
