"""Quality measurements of a loaded model: perplexity on a text through the paged cache, and greedy
agreement of two runs up to the first near-tie.

    nll = perplexity(runner, token_ids)             # {"tokens", "nll", "perplexity"}
    agree = greedy_agreement(reference, other, margins)

Perplexity runs the text as one sequence, chunk by chunk (chunked prefill over the runner's own KV
pages, so a quantized KV cache is what the later chunks read), and takes the log-probability of each
next token from every row of the step. It is how bench/quant.py and tests/test_quant.py compare the
weight and KV modes with float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.host.batch import SeqSpec, StepShape, pack
from jaxcb.model.llama import forward


def _chunk_nll(params, kv_pages, batch, targets, config, attention):
    kv_pages, logits = forward(params, kv_pages, batch, config, attention)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]
    return kv_pages, jnp.where(targets >= 0, -picked, 0.0)


@functools.cache
def _chunk_nll_program(options: tuple):
    """_chunk_nll jitted with the runner's XLA options (EngineConfig.compile): the engine's own numerics."""
    return jax.jit(_chunk_nll, static_argnames=("config", "attention"), donate_argnums=(1,),
                   compiler_options=dict(options) or None)


def perplexity(runner, token_ids: list[int], chunk: int = 256) -> dict:
    """Mean negative log-likelihood (nats) of token_ids[1:] given the tokens before each, and its
    exponential. The runner's KV pages are overwritten (use a runner no engine is serving from)."""
    ids = [int(t) for t in token_ids]
    n, s = len(ids), runner.page_size
    pages = -(-n // s)
    if pages + 1 > runner.num_pages:
        raise ValueError(f"token_ids: {n} tokens need {pages} pages; the runner has {runner.num_pages - 1}")
    page_ids = list(range(1, pages + 1))
    shape = StepShape(tokens=chunk, seqs=chunk, pages_per_seq=pages, history=1)
    window = runner.step_config.sliding_window if runner.step_config.windowed else 0
    chunk_nll = _chunk_nll_program(tuple(sorted((runner.compiler_options or {}).items())))
    total, count = 0.0, 0
    for start in range(0, n - 1, chunk):
        part = ids[start:start + chunk]
        held = page_ids[:-(-(start + len(part)) // s)]
        batch = pack([SeqSpec(part, start, held, window_page_ids=held if window else None)], shape, s, window)
        batch.last_token = np.arange(chunk, dtype=np.int32)  # every row's logits, not only the last
        targets = np.full(chunk, -1, np.int32)
        nxt = ids[start + 1:start + 1 + len(part)]
        targets[:len(nxt)] = nxt
        runner.kv_pages, nll = chunk_nll(runner.params, runner.kv_pages, batch, targets,
                                          config=runner.step_config, attention=runner.attention)
        total += float(np.asarray(nll, np.float64).sum())
        count += len(nxt)
    mean = total / count
    return {"tokens": count, "nll": mean, "perplexity": math.exp(mean)}


def greedy_agreement(reference: list[list[int]], other: list[list[int]], margins: list[list[float]] | None = None,
                     near_tie: float = 1e-2) -> dict:
    """How far `other`'s greedy tokens follow `reference`'s, prompt by prompt: identical in full, and
    identical up to the reference's first near-tie (its top-2 logprob margin below `near_tie`, where
    rounding may rightly pick the other token; `margins[i][j]` for token j of prompt i)."""
    full = upto_tie = 0
    matched = []
    for i, (a, b) in enumerate(zip(reference, other)):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same = k == len(a) == len(b)
        full += same
        matched.append(k)
        tie = len(a)
        if margins is not None:
            tie = next((j for j, m in enumerate(margins[i]) if m < near_tie), len(a))
        upto_tie += same or k >= tie
    return {"prompts": len(matched), "identical": full, "identical_up_to_near_tie": upto_tie,
            "mean_matching_prefix": sum(matched) / max(1, len(matched))}
