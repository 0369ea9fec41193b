"""Model directories: Hugging Face checkpoints (Llama, Qwen2 biases, untied head) and converted orbax
checkpoints, checked against the same weights loaded through the project's own path."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxcb.cli import main as cli
from jaxcb.host.engine_config import make_config
from jaxcb.host.request import SamplingParams
from jaxcb.llm import LLM, load_model
from jaxcb.model.hf_loader import hf_state_dict
from jaxcb.model.llama import params_from_numpy, random_weights
from tests.tiny_gguf import tiny_model_config

CONFIG = dict(num_pages=64, max_context=256, decode_batch=(1, 2, 4), prefill_tokens=(16, 32, 64), compile="fast")
PROMPTS = [[5, 9, 40, 41, 7], list(range(3, 40))]


def write_hf_dir(path, config, weights, tokenizer, arch="LlamaForCausalLM"):
    """A checkpoint as transformers writes one: torch layouts ([out, in]), HF tensor names."""
    os.makedirs(path, exist_ok=True)
    tensors = hf_state_dict(config, weights)
    half = len(tensors) // 2  # two shards, as large checkpoints come
    items = sorted(tensors.items())
    save_file(dict(items[:half]), os.path.join(path, "model-00001-of-00002.safetensors"))
    save_file(dict(items[half:]), os.path.join(path, "model-00002-of-00002.safetensors"))
    hf = {"architectures": [arch], "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
          "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
          "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
          "max_position_embeddings": config.max_context, "rope_theta": config.rope_theta,
          "rms_norm_eps": config.rms_norm_eps, "tie_word_embeddings": config.tie_embeddings}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    tokenizer.save(path)


def greedy(llm, prompts=PROMPTS):
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))]


@pytest.mark.parametrize("arch,tied,bias", [("LlamaForCausalLM", True, False), ("LlamaForCausalLM", False, False),
                                            ("Qwen2ForCausalLM", False, True), ("MistralForCausalLM", True, False)])
def test_hf_checkpoint_gives_the_logits_of_the_same_weights(tmp_path, tiny_model, arch, tied, bias):
    config = tiny_model_config(tie_embeddings=tied, attention_bias=bias)
    weights = random_weights(config, seed=3)
    write_hf_dir(str(tmp_path), config, weights, tiny_model[2], arch)
    loaded_config, params, tokenizer, eos = load_model(str(tmp_path), jnp.float32)
    assert loaded_config.attention_bias == bias and loaded_config.tie_embeddings == tied
    assert (params.layers.bq is not None) == bias and (params.lm_head is None) == tied
    ours = LLM.from_params(config, params_from_numpy(weights), tokenizer, config=make_config(**CONFIG))
    theirs = LLM.from_params(loaded_config, params, tokenizer, config=make_config(**CONFIG))
    import jax

    for a, b in zip(jax.tree_util.tree_leaves(params_from_numpy(weights)), jax.tree_util.tree_leaves(params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))  # the same weights, every one in its place
    assert greedy(theirs) == greedy(ours)
    if bias:  # the biases matter: without them the tokens change
        no_bias = {k: v for k, v in weights.items() if k not in ("bq", "bk", "bv")}
        plain = LLM.from_params(tiny_model_config(tie_embeddings=tied), params_from_numpy(no_bias), tokenizer,
                                config=make_config(**CONFIG))
        assert greedy(plain) != greedy(ours)
    assert tokenizer.encode("hello world") == tiny_model[2].encode("hello world")


def test_hf_prefill_logits_match_exactly(tmp_path, tiny_model):
    from jaxcb.host.batch import SeqSpec, StepShape, pack
    from jaxcb.model.llama import forward
    from jaxcb.model.paged_attention import allocate_kv_pages

    config = tiny_model_config(tie_embeddings=False, attention_bias=True)
    weights = random_weights(config, seed=4)
    write_hf_dir(str(tmp_path), config, weights, tiny_model[2], "Qwen2ForCausalLM")
    _, params, _, _ = load_model(str(tmp_path), jnp.float32)
    step = pack([SeqSpec(list(PROMPTS[0]), 0, [1])], StepShape(16, 1, 2, 32), 16)
    pages = lambda: allocate_kv_pages(config.num_layers, config.num_kv_heads, 4, 16, config.head_dim, jnp.float32)  # noqa: E731
    _, a = forward(params, pages(), step, config)
    _, b = forward(params_from_numpy(weights), pages(), step, config)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def test_hf_bad_directories(tmp_path, tiny_model):
    config = tiny_model_config()
    write_hf_dir(str(tmp_path), config, random_weights(config), tiny_model[2])
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, rope_scaling={"rope_type": "dynamic", "factor": 4})))
    with pytest.raises(ValueError, match="rope_scaling"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(ValueError, match="is missing from"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="neither a converted checkpoint"):
        load_model(str(tmp_path.parent))  # a directory that is neither kind


def test_convert_round_trip_and_bad_checkpoints(tmp_path, tiny_gguf_path, tiny_model, capsys):
    out = str(tmp_path / "converted")
    assert cli(["convert", tiny_gguf_path, out, "--dtype", "float32"]) == 0
    assert "serve it with --model" in capsys.readouterr().out
    config, params, tokenizer, eos = load_model(out)
    assert config == tiny_model[0] and eos == tiny_model[3]
    assert tokenizer.encode("hello world") == tiny_model[2].encode("hello world")
    assert tokenizer.chat_template == tiny_model[2].chat_template
    from_gguf = LLM.from_params(*tiny_model[:3], config=make_config(**CONFIG), eos_ids=tiny_model[3])
    from_ckpt = LLM(out, config=make_config(**CONFIG))
    assert greedy(from_ckpt) == greedy(from_gguf)
    assert cli(["convert", tiny_gguf_path, out]) == 2  # will not overwrite
    assert "already holds" in capsys.readouterr().err

    other = str(tmp_path / "other")
    shutil.copytree(out, other)
    manifest = json.loads(open(os.path.join(other, "jaxcb_model.json")).read())
    manifest["config"]["hidden_size"] *= 2
    open(os.path.join(other, "jaxcb_model.json"), "w").write(json.dumps(manifest))
    with pytest.raises(ValueError, match="from another model: embed has shape"):
        load_model(other)
    shutil.rmtree(os.path.join(other, "params"))
    with pytest.raises(ValueError, match="incomplete checkpoint"):
        load_model(other)
    os.remove(os.path.join(other, "jaxcb_model.json"))
    with pytest.raises(ValueError, match="neither a converted checkpoint"):
        load_model(other)


def test_sliding_windows_of_llama_shaped_checkpoints(tmp_path, tiny_model):
    """Mistral 7B v0.1's sliding_window (every layer sees its last W tokens) is full attention up to W:
    its context is served up to there; Qwen2's use_sliding_window layers are refused by name."""
    from jaxcb.host.errors import InvalidConfig
    from jaxcb.model.hf_loader import read_config

    config = tiny_model_config()
    weights = random_weights(config, seed=3)
    for arch, extra, want in (("MistralForCausalLM", {"sliding_window": 64}, 64),
                              ("MistralForCausalLM", {"sliding_window": None}, config.max_context),
                              ("Qwen2ForCausalLM", {"sliding_window": 64, "use_sliding_window": False}, config.max_context),
                              ("Qwen2ForCausalLM", {"sliding_window": 64, "use_sliding_window": True}, None)):
        path = str(tmp_path / f"{arch}-{len(extra)}-{extra.get('sliding_window')}-{extra.get('use_sliding_window')}")
        write_hf_dir(path, config, weights, tiny_model[2], arch)
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**raw, **extra}, f)
        if want is None:
            with pytest.raises(InvalidConfig, match="use_sliding_window"):
                read_config(path)
        else:
            assert read_config(path).max_context == want


def test_a_tensor_the_decoder_would_not_use_refuses_the_model(tmp_path, tiny_model):
    """A checkpoint with parts jaxcb does not run (Llama's o_proj bias with attention_bias, an MLP bias)
    is refused naming them, not served without them; RoPE's stored inverse frequencies are derived data."""
    from jaxcb.host.errors import InvalidConfig

    config = tiny_model_config()
    weights = random_weights(config, seed=3)
    for extra, refused in (({"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}, True),
                           ({"model.layers.1.mlp.down_proj.bias": np.zeros(64, np.float32)}, True),
                           ({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}, False)):
        path = str(tmp_path / next(iter(extra)))
        write_hf_dir(path, config, weights, tiny_model[2])
        save_file(extra, os.path.join(path, "extra.safetensors"))
        if refused:
            with pytest.raises(InvalidConfig, match=f"tensors jaxcb's decoder does not use \\(1: {next(iter(extra))}\\)"):
                load_model(path, jnp.float32)
        else:
            load_model(path, jnp.float32)


@pytest.mark.parametrize("weights, by_layer", [("float32", False), ("int8", False), ("bfloat16", True), ("int4", True)])
def test_weights_are_read_one_at_a_time_and_checked_before_any_is_read(tmp_path, tiny_model, weights, by_layer,
                                                                       monkeypatch):
    """A checkpoint's weights are built from the mapped files one at a time, each converted and placed before the
    next is read: the host's numpy memory while loading (tracemalloc) rises above what it keeps by less than half the
    model in float32 (a 12-layer model whose largest weight is under a fifth of it; reading all of it first, as
    before, took more than the model), and the weights are those of the files; a
    tensor of the wrong shape in the last layer is refused naming it before any weight is read. Built on the device a
    layer at a time (`by_layer`, as stacks over llama.LAYERWISE_BYTES are), the same weights, and less memory still."""
    import tracemalloc

    from jaxcb.host.errors import InvalidConfig
    from jaxcb.model import lazy_weights
    from jaxcb.model.llama import params_to_weights

    config = tiny_model_config(num_layers=12, intermediate_size=96, tie_embeddings=True)
    want = random_weights(config, seed=4)
    path = str(tmp_path / "hf")
    write_hf_dir(path, config, want, tiny_model[2])
    total = sum(w.size * 4 for w in want.values())
    assert max(w.size * 4 for w in want.values()) < total / 5
    whole = load_model(path, jnp.float32, weights=weights)[1]  # (imports and first calls outside the measurement)
    if by_layer:
        from jaxcb.model import llama

        monkeypatch.setattr(llama, "LAYERWISE_BYTES", 0)
        load_model(path, jnp.float32, weights=weights)
    tracemalloc.start()
    try:
        got = load_model(path, jnp.float32, weights=weights)[1]
        kept, peak = tracemalloc.get_traced_memory()  # (kept: XLA:CPU may keep a numpy buffer as the device's)
    finally:
        tracemalloc.stop()
    assert peak - kept < total / (4 if by_layer else 2), (peak, kept, total)
    if weights == "float32":
        for name, w in params_to_weights(got).items():
            np.testing.assert_array_equal(np.asarray(w), want[name], err_msg=name)
    for name, w in params_to_weights(whole).items():
        for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(params_to_weights(got)[name])):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(np.asarray(a), np.asarray(b)), name
    bad = dict(want, wk=want["wk"].copy())
    bad["wk"] = np.concatenate([want["wk"], want["wk"][:, :, :16]], axis=2)  # (every layer's, one more head)
    write_hf_dir(str(tmp_path / "bad"), dataclasses.replace(config), bad, tiny_model[2])
    read = []  # (a weight built whole, lazy_weights.float32; stacked, lazy_weights.filled)
    for what in ("float32", "filled"):
        original = getattr(lazy_weights, what)
        monkeypatch.setattr(lazy_weights, what, lambda *a, original=original: read.append(a) or original(*a))
    with pytest.raises(InvalidConfig, match=r"model.layers.0.self_attn.k_proj.weight \(wk\) has shape \(64, 48\), "
                                            r"expected \(64, 32\)"):
        load_model(str(tmp_path / "bad"), jnp.float32)
    assert read == []


def test_the_shards_index_names_the_files_read(tmp_path, tiny_model):
    """With model.safetensors.index.json the files it names are read, as transformers reads them: a Mistral release's
    consolidated.safetensors (its own layout) beside the shards is left alone, where without the index its tensors
    would refuse the model; an index naming a file that is not there is refused naming it."""
    from jaxcb.host.errors import InvalidConfig

    config = tiny_model_config()
    want = random_weights(config, seed=6)
    path = str(tmp_path / "hf")
    write_hf_dir(path, config, want, tiny_model[2])
    save_file({"layers.0.attention.wq.weight": np.ascontiguousarray(want["wq"][0].T)},
              os.path.join(path, "consolidated.safetensors"))
    with pytest.raises(InvalidConfig, match=r"does not use \(1: layers.0.attention.wq.weight\)"):
        load_model(path, jnp.float32)
    shards = {f: f for f in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")}
    from safetensors import safe_open

    weight_map = {n: f for f in shards for n in safe_open(os.path.join(path, f), "np").keys()}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    got = load_model(path, jnp.float32)[1]
    np.testing.assert_array_equal(np.asarray(got.layers.wq), want["wq"])
    os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    with pytest.raises(InvalidConfig, match="lacks model-00002-of-00002.safetensors, which model.safetensors.index.json"):
        load_model(path, jnp.float32)


def test_a_cut_or_garbled_safetensors_file_is_refused_naming_it(tmp_path, tiny_model):
    """A shard cut short (its tensors' data past the end) or whose header's length is garbage is refused naming the
    file, before any weight is read."""
    from jaxcb.host.errors import InvalidConfig

    config = tiny_model_config()
    path = str(tmp_path / "hf")
    write_hf_dir(path, config, random_weights(config, seed=7), tiny_model[2])
    shard = os.path.join(path, "model-00002-of-00002.safetensors")
    data = open(shard, "rb").read()
    for broken, why in ((data[: len(data) // 2], "not a readable safetensors file"),
                        ((1 << 60).to_bytes(8, "little") + data[8:], "runs past the end of the file")):
        with open(shard, "wb") as f:
            f.write(broken)
        with pytest.raises(InvalidConfig, match=f"model-00002-of-00002.safetensors .*{why}|{why}"):
            load_model(path, jnp.float32)
