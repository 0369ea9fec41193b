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
    write_tiny_gguf(path, arch="phi3")
    with pytest.raises(ValueError, match=r"general.architecture: 'phi3' is not supported; supported architectures: "
                                         r"llama, qwen3, gemma2, gemma3"):
        load_gguf(path)


def test_unsupported_tensor_type_names_the_tensor(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_tiny_gguf(path, broken_type=True)
    with pytest.raises(ValueError, match=r"tensor blk.0.attn_v.weight: type Q8_1 cannot be dequantized"):
        load_gguf(path)
