import os

import numpy as np
import pytest

from jaxcb.model.gguf_loader import default_model_path, load_gguf
from tests.tiny_gguf import tiny_model_config, write_tiny_gguf


def test_f32_round_trip_undoes_the_rotary_permutation(tmp_path):
    """The file holds Q/K rows permuted the way llama.cpp's converter does; loading gives back the
    original weights exactly."""
    path = str(tmp_path / "m.gguf")
    want = write_tiny_gguf(path)
    got = load_gguf(path)
    assert got.config == tiny_model_config(rms_norm_eps=got.config.rms_norm_eps)
    assert set(got.weights) == set(want)
    for k in want:
        np.testing.assert_array_equal(got.weights[k], want[k], err_msg=k)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_q_k_v_biases_and_qwen2s_unpermuted_rows_round_trip(tmp_path, arch):
    """Qwen2 GGUFs (llama.cpp's "qwen2": Q/K rows as the checkpoint has them, q/k/v biases) load as the
    Llama decoder with biases; a "llama" file with biases has its Q/K biases permuted like their rows."""
    config = tiny_model_config(attention_bias=True)
    path = str(tmp_path / "m.gguf")
    want = write_tiny_gguf(path, config, arch=arch)
    got = load_gguf(path)
    assert got.config.attention_bias and got.config.family == "llama"
    assert set(got.weights) == set(want) >= {"bq", "bk", "bv"}
    for k in want:
        np.testing.assert_array_equal(got.weights[k], want[k], err_msg=k)


@pytest.mark.parametrize("quant,tol", [("q8_0", 0.02), ("f16", 2e-3)])
def test_quantized_tensors_dequantize(tmp_path, quant, tol):
    path = str(tmp_path / "m.gguf")
    want = write_tiny_gguf(path, quant=quant)
    got = load_gguf(path)
    for k in want:
        err = np.abs(got.weights[k] - want[k]).max()
        assert err < tol * max(1.0, np.abs(want[k]).max()), (k, err)
    assert np.abs(got.weights["wq"] - want["wq"]).max() > 0  # really quantized


def test_embedded_smollm2_config():
    path = default_model_path()
    assert path.endswith(".gguf") and os.path.isfile(path)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="model: file not found"):
        load_gguf(str(tmp_path / "nope.gguf"))


def test_corrupt_files(tmp_path):
    good = str(tmp_path / "good.gguf")
    write_tiny_gguf(good)
    data = open(good, "rb").read()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 3])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"definitely not a model" * 50)
    for path in (truncated, garbage):
        with pytest.raises(ValueError, match="not a readable GGUF file"):
            load_gguf(str(path))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_tiny_gguf(path, arch="phi2")
    with pytest.raises(ValueError, match=r"general.architecture: 'phi2' is not supported; supported architectures: "
                                         r"llama, qwen2, qwen2moe, qwen3, qwen3moe, gemma, gemma2, gemma3, smollm3"):
        load_gguf(path)


def test_unsupported_tensor_type_names_the_tensor(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_tiny_gguf(path, broken_type=True)
    with pytest.raises(ValueError, match=r"tensor blk.0.attn_v.weight: type Q8_1 cannot be dequantized"):
        load_gguf(path)


def test_rope_scaling_of_a_gguf_is_read_or_refused_by_name(tmp_path):
    """llama.cpp's RoPE scaling: the rope_freqs tensor (Llama 3.1+: the frequencies' divisors, as the Hugging
    Face loader computes them from rope_scaling llama3), linear scaling by rope.scaling.type and .factor, YaRN
    (tests/test_families.py: against transformers); LongRoPE on a llama file is refused by name instead of
    being run as plain RoPE."""
    from jaxcb.host.errors import InvalidConfig
    from jaxcb.model.rope_scaling import from_dict

    spec = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}
    config = tiny_model_config()
    factors = from_dict(spec, config.rope_theta, config.head_dim, 64)["rope_freq_factors"]
    path = str(tmp_path / "llama3.gguf")
    write_tiny_gguf(path, config, rope_freqs=factors)
    loaded = load_gguf(path).config
    assert loaded.rope_freq_factors == tuple(float(np.float32(f)) for f in factors)
    assert loaded.rope_freq_factors[0] == 1.0 and loaded.rope_freq_factors[-1] == 8.0
    assert np.array_equal(loaded.rope_divisors(), np.asarray(factors, np.float32)) and config.rope_divisors() is None
    path = str(tmp_path / "linear.gguf")
    write_tiny_gguf(path, config, rope_scaling=("linear", 4.0))
    assert load_gguf(path).config.rope_linear_factor == 4.0
    path = str(tmp_path / "longrope.gguf")
    write_tiny_gguf(path, config, rope_scaling=("longrope", 4.0))
    with pytest.raises(InvalidConfig, match="llama.rope.scaling.type: 'longrope' is not supported"):
        load_gguf(path)
    path = str(tmp_path / "short.gguf")
    write_tiny_gguf(path, config, rope_freqs=factors[:-1])
    with pytest.raises(InvalidConfig, match="rope_freqs.weight"):
        load_gguf(path)
    for bad in ({"rope_type": "yarn"}, {"rope_type": "llama3", "factor": 8.0}, {"rope_type": "dynamic", "factor": 2.0},
                {"rope_type": "yarn", "factor": "x"}, {"rope_type": "linear", "factor": 0.5},
                {"rope_type": "yarn", "factor": float("inf")}):
        with pytest.raises(InvalidConfig, match="rope_scaling"):
            from_dict(bad, 10000.0, 16, 64)
    # a given attention_factor wins over DeepSeek's mscale pair (transformers' order)
    pair = {"rope_type": "yarn", "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5}
    assert from_dict({**pair, "attention_factor": 1.5}, 10000.0, 16, 64)["rope_attention_factor"] == 1.5
    assert from_dict(pair, 10000.0, 16, 64)["rope_attention_factor"] == pytest.approx(
        (1 + 0.1 * np.log(8)) / (1 + 0.05 * np.log(8)))


@pytest.mark.parametrize("key, value, message", [
    ("llama.expert_count", 8, "missing metadata llama.expert_used_count"),  # experts, but how many a token?
    ("llama.rope.dimension_count", 4, "llama.rope.dimension_count: 4 of 16 dimensions rotated"),
    ("llama.attention.value_length", 8, "llama.attention.value_length: 8 differs from key_length 16"),
])
def test_what_the_decoder_does_not_do_is_refused_by_name(tmp_path, key, value, message):
    """A Mixtral (a "llama" file with experts) without the number each token takes, partial RoPE or value
    heads of another size would load and run wrong, or fail on a missing tensor: each is refused naming
    the metadata."""
    from jaxcb.host.errors import InvalidConfig

    path = str(tmp_path / "m.gguf")
    write_tiny_gguf(path, extra_uint32={key: value})
    with pytest.raises(InvalidConfig, match=message):
        load_gguf(path)


def test_a_tensor_the_decoder_would_not_use_refuses_the_file(tmp_path):
    """Experts, a norm's bias (a LayerNorm), anything the loader does not take: refused naming it."""
    from jaxcb.host.errors import InvalidConfig

    path = str(tmp_path / "m.gguf")
    write_tiny_gguf(path, extra_tensors={"blk.0.attn_norm.bias": np.zeros(64)})
    with pytest.raises(InvalidConfig, match=r"tensors jaxcb's decoder does not use \(1: blk.0.attn_norm.bias\)"):
        load_gguf(path)


def test_a_model_split_over_shards_loads_from_any_of_them(tmp_path):
    """llama.cpp's gguf-split shards (PREFIX-00001-of-0000N.gguf, split.no / split.count / split.tensors.count; the
    metadata in the first): loaded from whichever shard is named, the weights of the one-file model exactly; a
    missing shard is refused naming it."""
    import os

    from jaxcb.host.errors import InvalidConfig
    from tests.tiny_gguf import tiny_model_config

    config = tiny_model_config()
    whole = str(tmp_path / "whole.gguf")
    write_tiny_gguf(whole, config, seed=3)
    write_tiny_gguf(str(tmp_path / "tiny.gguf"), config, seed=3, split_max_tensors=7)
    shards = sorted(p for p in os.listdir(tmp_path) if p.startswith("tiny-"))
    assert len(shards) >= 3 and shards[0] == f"tiny-00001-of-{len(shards):05d}.gguf", shards
    want = load_gguf(whole)
    for named in (shards[0], shards[-1]):
        got = load_gguf(str(tmp_path / named))
        assert got.config == want.config and got.tokenizer == want.tokenizer
        assert sorted(got.weights) == sorted(want.weights)
        for key in want.weights:
            np.testing.assert_array_equal(got.weights[key], want.weights[key], err_msg=key)
    os.remove(tmp_path / shards[1])
    with pytest.raises(InvalidConfig, match=f"file not found: .*{shards[1]}"):
        load_gguf(str(tmp_path / shards[0]))
