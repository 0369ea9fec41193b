"""Run by test_cpu_dots.py in a subprocess (XLA reads its flags once per process): SmolLM2 greedy on
every other golden prompt with XLA:CPU's dots in the library named on the command line; prints the
choice that held, the dot fusions of a compiled model-shaped dot, and the token ids, as JSON."""

import json
import re
import sys

STEPS = 24


def main(golden_path: str, library: str) -> None:
    from jaxcb.device import cpu_dots
    from jaxcb.host.engine_config import make_config
    from jaxcb.host.request import SamplingParams
    from jaxcb.llm import LLM

    with open(golden_path) as f:
        records = json.load(f)["records"][::2]
    # One decode bucket of exactly these prompts (no padded rows), one prefill bucket.
    config = make_config(num_pages=512, max_context=256, decode_batch=(len(records),), prefill_tokens=(64,),
                         cpu_dots=library)
    llm = LLM(config=config)

    import jax
    import jax.numpy as jnp

    hlo = jax.jit(lambda x, w: jax.nn.silu(x @ w)).lower(jnp.ones((32, 576)), jnp.ones((576, 1536))).compile().as_text()
    outs = llm.generate([r["prompt_ids"] for r in records], SamplingParams(max_tokens=STEPS, ignore_eos=True))
    llm.engine.pool.check_all_free()
    print(json.dumps({"library": cpu_dots.current().library,
                      "fusions": sorted(set(re.findall(r'"kind":"(__\w+_fusion)"', hlo))),
                      "tokens": [o.token_ids for o in outs]}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
