"""Quantized weights (jaxcb.model.quant): the formats, the step that reads them, and what they cost in
quality on the real model."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcb.host import memory_plan
from jaxcb.host.engine_config import make_config
from jaxcb.host.request import SamplingParams
from jaxcb.llm import LLM, load_model
from jaxcb.model import quant
from jaxcb.model.llama import params_from_numpy, params_to_weights

CONFIG = dict(num_pages=48, max_context=256, decode_batch=(2, 8), prefill_tokens=(32, 64), compile="fast")  # tiny models
HELDOUT = os.path.join(os.path.dirname(__file__), "data", "heldout_prose.txt")


def on_device(w):
    return jax.tree.map(jnp.asarray, w)


@pytest.mark.parametrize("group", [0, 16])
def test_int8_values_are_within_half_a_step_of_the_float_weights(group):
    w = np.random.default_rng(0).standard_normal((3, 64, 40)).astype(np.float32)
    w[1, :, 5] = 0.0  # an all-zero column must not divide by zero
    q = quant.quantize_int8(w, group)
    assert q.q.dtype == np.int8 and q.scale.shape == (3, 64 // (group or 64), 40)
    back = np.asarray(quant.dequantize(on_device(q)))
    step = np.repeat(q.scale, group or 64, axis=-2)
    assert (np.abs(back - w) <= step / 2 + 1e-7).all()
    assert (back[1, :, 5] == 0).all()


def test_int4_packs_two_values_a_byte_and_reproduces_a_q4_1_grid_exactly():
    rng = np.random.default_rng(1)
    # Weights already on an asymmetric 16-level grid per group of 32 input rows (what a GGUF's Q4_1
    # blocks dequantize to), with float16 scales and minimums: int4 must give them back exactly.
    d = rng.uniform(0.01, 0.1, (2, 4, 1, 24)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-1, 0, (2, 4, 1, 24)).astype(np.float16).astype(np.float32)
    levels = rng.integers(0, 16, (2, 4, 32, 24))
    levels[..., 0, :], levels[..., 1, :] = 0, 15  # every group spans its grid
    w = (levels * d + m).reshape(2, 128, 24).astype(np.float32)
    q = quant.quantize_int4(w, 32)
    assert q.q.dtype == np.uint8 and q.q.shape == (2, 64, 24) and q.scale.dtype == np.float16
    back = np.asarray(quant.dequantize(on_device(q)))
    np.testing.assert_allclose(back, w, atol=1e-6)
    # Any float matrix: within half a step (plus float16 rounding of the grid) of the original.
    g = rng.standard_normal((128, 24)).astype(np.float32)
    q = quant.quantize_int4(g, 32)
    step = np.repeat(q.scale.astype(np.float32), 32, axis=0)
    assert (np.abs(np.asarray(quant.dequantize(on_device(q))) - g) <= step / 2 + 2e-3).all()


@pytest.mark.parametrize("mode, group", [("int8", 0), ("int8", 32), ("int4", 32)])
def test_a_stack_quantized_a_layer_at_a_time_is_the_stack_quantized_whole(mode, group):
    """The loader quantizes a stack [L, in, out] (or experts' [L, X, in, out]) a layer at a time to bound its float
    temporaries: the same values, scales and offsets as the whole stack's."""
    rng = np.random.default_rng(5)
    for name, shape in (("w_up", (3, 64, 48)), ("experts_down", (2, 3, 64, 16))):
        w = rng.standard_normal(shape).astype(np.float32)
        whole = quant.quantize_int8(w, group, name) if mode == "int8" else quant.quantize_int4(w, group, name)
        got = quant.quantize_weight(name, w, mode, group)
        for part in ("q", "scale", "offset"):
            if getattr(whole, part) is None:
                assert getattr(got, part) is None
            else:
                np.testing.assert_array_equal(getattr(got, part), getattr(whole, part), err_msg=f"{name} {part}")


def test_the_int8_embedding_keeps_a_scale_per_32_values_and_gives_back_q8_0_rows_exactly():
    rng = np.random.default_rng(5)
    d = rng.uniform(0.001, 0.01, (10, 3, 1)).astype(np.float32)
    levels = rng.integers(-127, 128, (10, 3, 32))
    levels[:, :, 0] = 127  # each block reaches its range, as Q8_0's d = max / 127 makes it
    w = (levels * d).reshape(10, 96)
    rows = quant.quantize_rows(w)
    assert rows.q.dtype == np.int8 and rows.scale.shape == (10, 3)
    back = np.asarray(quant.embed_rows(on_device(rows), jnp.arange(10), jnp.float32))
    np.testing.assert_allclose(back, w, rtol=1e-6, atol=1e-9)
    last = jnp.asarray(rng.standard_normal((2, 96)).astype(np.float32))
    np.testing.assert_allclose(np.asarray(quant.head_logits(last, on_device(rows), None)), np.asarray(last @ back.T),
                               rtol=1e-5, atol=1e-5)
    assert quant.quantize_rows(np.ones((4, 40), np.float32)).scale.shape == (4, 1)  # 40 values: one scale a row


@pytest.mark.parametrize("make", [lambda w: quant.quantize_int8(w), lambda w: quant.quantize_int8(w, 32),
                                  lambda w: quant.quantize_int4(w, 32)], ids=["int8", "int8-g32", "int4"])
def test_dense_is_the_matmul_with_the_dequantized_matrix(make):
    rng = np.random.default_rng(2)
    w = make(rng.standard_normal((96, 40)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((5, 96)).astype(np.float32))
    expect = np.asarray(x @ quant.dequantize(on_device(w)))
    np.testing.assert_allclose(np.asarray(quant.dense(x, on_device(w))), expect, rtol=2e-5, atol=2e-5)


def test_bad_groups_and_modes_are_refused_naming_the_setting():
    w = np.zeros((48, 8), np.float32)
    with pytest.raises(ValueError, match="model.weight_group: int4 groups of 32 do not divide the 48 input rows of wq"):
        quant.quantize_int4(w, 32, "wq")
    with pytest.raises(ValueError, match="model.weights: 'int3' is not one of"):
        make_config(weights="int3")
    with pytest.raises(ValueError, match="model.weight_group: must be 0 or an even number"):
        make_config(weight_group=3)
    with pytest.raises(ValueError, match="model.activations: int8 activations need int8 weights with one scale "
                                         "per column .* or int4 weights in groups of a multiple of 32 .* got "
                                         "'float32'"):
        make_config(weights="float32", activations="int8")
    with pytest.raises(ValueError, match="model.activations: .* got 'int4' in groups of 48"):
        make_config(weights="int4", weight_group=48, activations="int8")
    assert make_config(weights="int4", weight_group=64, activations="int8").activations == "int8"
    with pytest.raises(ValueError, match="model.activations: .* got 'int8' in groups of 32"):
        make_config(weights="int8", weight_group=32, activations="int8")
    with pytest.raises(ValueError, match="model.activations: 'int4' is not one of"):
        make_config(activations="int4")


def test_int8_activations_refuse_weights_that_are_not_int8_per_column(tiny_model):
    """weights = "auto" with int8 activations is allowed by the config (a converted int8 checkpoint);
    the float weights it finds are refused when the runner is made, naming the matrix."""
    cfg, params, tok, eos = tiny_model
    with pytest.raises(ValueError, match="model.activations: int8 activations need int8 weights .* wq is float32"):
        LLM.from_params(cfg, params, tok, config=make_config(**CONFIG, activations="int8"), eos_ids=eos)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_int8_activations_give_the_plain_steps_tokens_natively_and_never_compile_after_warmup(tiny_model, weights):
    """w8a8 (int8 weights per column, int8 activations) and w4a8 (int4 in groups of 32): the native CPU
    kernels (VNNI's integer sums where the build has them) give the tokens of the plain-JAX step, which
    quantizes the activations in floats; the banner's description says so."""
    cfg, params, tok, eos = tiny_model
    floats = {k: np.asarray(v) for k, v in params_to_weights(params).items()}
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 40, 17, 70)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    outs = {}
    for attention in ("xla", "native"):
        config = make_config(**CONFIG, weights=weights, activations="int8", attention=attention)
        llm = LLM.from_params(cfg, params_from_numpy(floats, jnp.float32, weights, 0), tok, config=config, eos_ids=eos)
        assert llm.engine.runner.params.layers.w_up.act_block == quant.ACT_BLOCK
        assert llm.engine.runner.describe()["weights"] == f"{weights}, int8 activations"
        llm.warmup()
        before = llm.engine.stats().compilations
        outs[attention] = [o.token_ids for o in llm.generate(prompts, sp)]
        assert llm.engine.stats().compilations == before
        llm.engine.pool.check_all_free()
    assert outs["native"] == outs["xla"]


@pytest.mark.parametrize("mode, group", [("int8", 0), ("int4", 32)])  # int8 in groups: test_dense_... above
def test_the_step_reads_the_quantized_weights_and_gives_the_dequantized_models_tokens(tiny_model, mode, group):
    """The engine on quantized weights gives the tokens of the same engine on those weights
    dequantized (what the quantized model means), never compiles after warm-up, and holds the bytes
    the memory plan counts; the compiled step has no float copy of any stacked weight."""
    cfg, params, tok, eos = tiny_model
    floats = {k: np.asarray(v) for k, v in params_to_weights(params).items()}
    qparams = params_from_numpy(floats, jnp.float32, mode, group)
    assert isinstance(qparams.layers.wq, quant.QuantWeight) and isinstance(qparams.embed, quant.QuantRows)
    held = sum(x.nbytes for x in jax.tree.leaves(qparams))
    assert held == memory_plan.weight_bytes(cfg, mode, 4, group)
    assert held < 0.6 * sum(x.nbytes for x in jax.tree.leaves(params))

    meant = {k: np.asarray(quant.dequantize(v) if isinstance(v, quant.QuantWeight)
                           else quant.embed_rows(v, jnp.arange(v.shape[0]), jnp.float32)
                           if isinstance(v, quant.QuantRows) else v)
             for k, v in params_to_weights(qparams).items()}
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 40, 17, 70)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    reference = LLM.from_params(cfg, params_from_numpy(meant), tok, config=make_config(**CONFIG), eos_ids=eos)
    expect = [o.token_ids for o in reference.generate(prompts, sp)]
    llm = LLM.from_params(cfg, qparams, tok, config=make_config(**CONFIG), eos_ids=eos)
    llm.warmup()
    before = llm.engine.stats().compilations
    assert [o.token_ids for o in llm.generate(prompts, sp)] == expect
    assert llm.engine.stats().compilations == before
    llm.engine.pool.check_all_free()

    forward, _ = llm.engine.runner._compiled[max(llm.engine.runner._compiled, key=lambda shape: shape.tokens)]
    hlo = forward.as_text()  # the step's forward pass (the sampler never sees the weights)
    layers = cfg.num_layers
    stacked = {f"f32[{layers},{','.join(map(str, np.shape(floats[n])[1:]))}]" for n in quant.MATRICES if n in floats}
    found = set(re.findall(r"f32\[\d+,\d+,\d+\]", hlo))
    assert not stacked & found, f"a float copy of stacked weights in the step: {stacked & found}"


def test_int8_kv_pages_serve_under_preemption_and_prefix_caching(tiny_model):
    """int8 KV (cache.kv_dtype): a pool tight enough to preempt gives the ample pool's tokens (greedy and
    seeded), shared prefixes are served from cached int8 pages, nothing compiles after warm-up, and the
    memory plan counts a byte a value plus each token-head's scale."""
    from jaxcb.host.memory_plan import plan_for_model

    cfg, params, tok, eos = tiny_model
    rng = np.random.default_rng(4)
    shared = rng.integers(3, cfg.vocab_size, 40).tolist()
    prompts = [shared + rng.integers(3, cfg.vocab_size, n).tolist() for n in (3, 9, 20, 1, 30, 14)]
    sps = [SamplingParams(max_tokens=24, ignore_eos=True),
           SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=11)]
    runs = {}
    for pages in (200, 14):
        llm = LLM.from_params(cfg, params, tok, config=make_config(**{**CONFIG, "num_pages": pages}, kv_dtype="int8"),
                              eos_ids=eos)
        assert llm.engine.runner.kv_arrays[0].dtype == jnp.int8
        llm.warmup()
        before = llm.engine.stats().compilations
        outs = [llm.generate(prompts, sp) for sp in sps]
        runs[pages] = [[o.token_ids for o in out] for out in outs]
        st = llm.engine.stats()
        assert st.compilations == before
        llm.engine.pool.check_all_free()
        if pages == 14:
            assert st.preemptions > 0
        else:  # the second round finds the shared prefix's pages cached
            assert st.prefix_cache_hits > 0 and sum(o.num_cached_tokens for o in outs[1]) >= 32 * len(prompts)
        plan = plan_for_model(cfg, llm.engine.config, budget_bytes=1 << 30, dtype_bytes=4)
        assert plan.kv_bytes_per_token == llm.engine.runner.kv_bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4)
        llm.close()
    assert runs[14] == runs[200]


def test_convert_stores_quantized_weights_and_loads_them_as_they_were(tmp_path, tiny_gguf_path, tiny_model):
    from jaxcb.cli import main as cli

    for mode in ("int8", "int4"):
        out = str(tmp_path / mode)
        assert cli(["convert", tiny_gguf_path, out, "--dtype", "float32", "--weights", mode]) == 0
        _, params, _, _ = load_model(out)
        _, at_load, _, _ = load_model(tiny_gguf_path, jnp.float32, weights=mode)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(at_load)):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
        assert jax.tree.structure(params) == jax.tree.structure(at_load)


def test_plan_counts_the_quantized_bytes(capsys):
    from jaxcb.cli import main as cli

    llama8b = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "models", "llama-3-8b")
    seen = {}
    for mode in ("bfloat16", "int8", "int4"):
        assert cli(["plan", "--model", llama8b, "--memory", "16GiB", "--max-context", "4096", "--weights", mode]) in (0, 2)
        out = capsys.readouterr()
        seen[mode] = out.out + out.err
    assert "room for 0 KV pages" in seen["bfloat16"]  # 15 GiB of weights do not leave room on one 16 GiB chip
    gib = {m: float(re.search(r"weights\s+([\d.]+) GiB", seen[m]).group(1)) for m in ("int8", "int4")}
    # int8: a byte a value (+ the embedding and head at 8 bits); int4: 5 bits a value with the float16
    # scale and offset of each group of 32, the 1 GiB of embedding and head at 8 bits
    assert 7.0 < gib["int8"] < 7.6 and 4.6 < gib["int4"] < 5.2
    assert int(re.search(r"largest batch at context 4096: (\d+)", seen["int4"]).group(1)) > \
        int(re.search(r"largest batch at context 4096: (\d+)", seen["int8"]).group(1)) > 0


def test_smollm2_perplexity_of_each_mode_against_float32():
    """The real model on held-out prose (tests/data): int4 (groups of 32, asymmetric) gives back the
    GGUF's own Q4_1 matrices and the int8 embedding its Q8_0 rows, so int4 is the float32 model; int8
    in groups of 32 is close; int8 per output column rounds the Q4_1 groups onto one grid per column;
    int8 activations (w8a8, w4a8) add their own rounding; bfloat16 rounds each matrix value and input."""
    from jaxcb.device.evaluate import perplexity

    cfg, params, tok, eos = load_model()  # the embedded SmolLM2, float32; each mode quantizes these weights
    floats = {k: np.asarray(v) for k, v in params_to_weights(params).items()}
    ids = tok.encode(open(HELDOUT, encoding="utf-8").read())[:768]  # three chunks of 256 a mode
    figures = {}
    for mode, group, kv in (("float32", 0, "auto"), ("int8", 0, "auto"), ("int8", 32, "auto"), ("int4", 0, "auto"),
                            ("float32", 0, "int8"), ("w8a8", 0, "auto"), ("w4a8", 0, "auto"), ("bfloat16", 0, "auto")):
        weights, activations = {"w8a8": ("int8", "int8"), "w4a8": ("int4", "int8")}.get(mode, (mode, "float"))
        config = make_config(num_pages=80, max_context=2048, weights=weights, weight_group=group, kv_dtype=kv,
                             activations=activations)
        llm = LLM.from_params(cfg, params_from_numpy(floats, jnp.float32, weights, group), tok, config=config,
                              eos_ids=eos)
        figures[mode, group, kv] = perplexity(llm.engine.runner, ids)["perplexity"]
        llm.close()
    base = figures["float32", 0, "auto"]
    ratios = {k: v / base - 1 for k, v in figures.items()}
    print({f"{m}/g{g}/kv-{kv}": f"{v:+.2%}" for (m, g, kv), v in ratios.items()})
    # int4's groups and the int8 embedding's give back the GGUF's own Q4_1 and Q8_0 blocks: the same model.
    assert abs(ratios["int4", 0, "auto"]) < 1e-4  # target 5%
    assert abs(ratios["float32", 0, "int8"]) < 0.01
    assert -0.03 < ratios["int8", 32, "auto"] < 0.01  # on this excerpt a little below float32 (-1.7%)
    # Per output column: +0.9% on the whole text (README), +1.7% on this excerpt (its first 768 tokens).
    assert 0 < ratios["int8", 0, "auto"] < 0.02
    # int8 activations too (rows quantized per 32 values): about +1.5-2% more on this excerpt. Rounding each
    # activation to int8 turns differences in the last bits of the attention into different roundings:
    # the plain-JAX attention gives +3.36%, the native kernel +3.13% (one summation order) and +3.70%
    # (another), with float32 perplexity equal to 1e-6 between all three; +4.02% on a 2-core AMD EPYC (AVX2,
    # plain-JAX attention and XLA's integer dots). With the layer kernel's later summation order (one fused
    # multiply-add a block) and the tied head's input rounded so too (as llama.cpp's Q8_0 output multiplies Q8
    # activations): +2.57%, against +4.02% before both (2-core Zen 5).
    assert ratios["int8", 0, "auto"] < ratios["w8a8", 0, "auto"] < 0.05
    # int4 (the GGUF's own Q4_1 matrices) with int8 activations: the activations' rounding alone, +0.66% and
    # +1.73% on this excerpt under two summation orders of the kernel's block sums (2-core AMD EPYC Zen 4,
    # VNNI's integer sums); -0.33% with that later order and the head's input rounded too (+1.73% before both,
    # 2-core Zen 5).
    assert -0.01 < ratios["w4a8", 0, "auto"] < 0.03
    # bfloat16 matrices (each Q4_1 value rounded to 8 significant bits) and each matmul's input rounded so
    # too, and the embedding (the lookups and the tied head), the rest float32 (the CPU's bfloat16 mode): -0.09%
    # on this excerpt (+0.17% with the embedding float32, +0.04% with the inputs unrounded too); -0.06% with
    # the head's input rounded as well.
    assert abs(ratios["bfloat16", 0, "auto"]) < 0.005


def test_bfloat16_weights_compute_in_float32_on_the_cpu(tiny_gguf_path):
    """--weights bfloat16 on the CPU: the layer matrices and the embedding are stored in bfloat16 (half
    the bytes to stream), the norms and the compute in float32; the memory plan counts what is stored, and the
    runner keeps the stacks in bfloat16 (in the native matmul's blocks, where it reads them)."""
    from jaxcb.device.factory import compute_dtype
    from jaxcb.host.memory_plan import weight_bytes
    from jaxcb.model.quant import MATRICES

    config = make_config(num_pages=64, max_context=256, weights="bfloat16")
    dtype = compute_dtype(config)
    assert dtype == jnp.float32
    cfg, params, tok, eos = load_model(tiny_gguf_path, dtype, weights="bfloat16")
    for name in MATRICES:  # (those this model has: not a mixture's dense layers' or latent attention's)
        assert name not in cfg.weight_shapes() or getattr(params.layers, name).dtype == jnp.bfloat16, name
    assert params.embed.dtype == jnp.bfloat16
    assert params.compute_dtype == params.final_norm.dtype == params.layers.attn_norm.dtype == jnp.float32
    assert weight_bytes(cfg, "bfloat16", 4) == sum(x.nbytes for x in jax.tree.leaves(params))
    llm = LLM.from_params(cfg, params, tok, config=config, eos_ids=eos)
    info = llm.engine.runner.describe()
    assert (info["compute_dtype"], info["weights"], info["kv_dtype"]) == ("float32", "bfloat16", "float32")
    runner = llm.engine.runner
    assert runner.params.layers.w_up.dtype == jnp.bfloat16
    assert runner.params.layers.w_up.ndim == (4 if runner.attention.native_matmul else 3)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
    llm.close()
