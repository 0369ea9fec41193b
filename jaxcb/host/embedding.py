"""Embeddings: a prompt's vector from the model's last hidden states, pooled.

Plain Python and numpy, no JAX. An embedding request is a prompt-only request (SamplingParams.pooling,
max_tokens 0) that runs through the engine like any other: scheduled, chunked, batched with generation,
preempted and recomputed. Every step gives each sequence's final-norm output at its last row and the sum
over its rows in the step (jaxcb.device.runner); `take_pooled` keeps what the request's pooling needs of
them, and its final event carries the pooled vector (`pooled_vector`). What the model's makers add after
the pooling (the L2 normalization of sentence-transformers' Normalize module) and a request's
`dimensions` (Matryoshka truncation) are applied by `Pooling.finish`, at the API.

The pooling is the model's: sentence-transformers' modules.json and 1_Pooling/config.json in a Hugging Face
directory, a GGUF's `{arch}.pooling_type`, else the last token, normalized (vLLM's default for a
generative model served for embeddings). Mean pooling needs every prompt position's hidden state: such a
request takes nothing from the prefix cache (jaxcb.host.prefix_cache), and starts its sum again when it is
preempted (jaxcb.host.scheduler).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os

import numpy as np

from jaxcb.host.errors import InvalidConfig, InvalidRequest

POOLING_MODES = ("last", "mean")
# llama.cpp's enum llama_pooling_type (a GGUF's {arch}.pooling_type): 0 none, 1 mean, 2 cls, 3 last, 4 rank
_GGUF_POOLING = {1: "mean", 3: "last"}
# sentence-transformers' Pooling config: the mode each flag names (the others are not supported here)
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}
_ST_UNSUPPORTED = ("pooling_mode_cls_token", "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")
_ST_KNOWN_MODULES = {"sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
                     "sentence_transformers.models.Normalize"}
ENCODING_FORMATS = ("float", "base64")


@dataclasses.dataclass(frozen=True)
class Pooling:
    """How the model's embeddings are made from its last hidden states."""

    mode: str = "last"  # POOLING_MODES: the last prompt token's, or the mean over the prompt's tokens
    normalize: bool = True  # L2-normalized (sentence-transformers' Normalize module)
    source: str = "default"  # where it was read (the start banner, GetModelInfo.embedding_pooling)
    # Why this model cannot give embeddings (a sentence-transformers module this engine does not run, e.g. a
    # Dense projection): requests are refused naming it; "" = it can.
    unsupported: str = ""

    @classmethod
    def from_dir(cls, path: str) -> "Pooling":
        """A Hugging Face directory's sentence-transformers configuration, if it has one."""
        modules_path = os.path.join(path, "modules.json")
        if not os.path.isfile(modules_path):
            return cls()
        modules = _read_json(modules_path)
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise InvalidConfig(f"model: {modules_path} must hold a list of modules")
        kinds = [str(m.get("type", "")) for m in modules]
        other = next((k for k in kinds if k not in _ST_KNOWN_MODULES), None)
        if other is not None:
            return cls(source=modules_path, unsupported=f"the model's {modules_path} has a module this server does "
                                                       f"not run: {other}")
        pooling = next((m for m in modules if m.get("type") == "sentence_transformers.models.Pooling"), None)
        normalize = "sentence_transformers.models.Normalize" in kinds
        if pooling is None:
            return cls("last", normalize, modules_path)
        config_path = os.path.join(path, str(pooling.get("path", "")), "config.json")
        if not os.path.isfile(config_path):
            raise InvalidConfig(f"model: {modules_path} names a Pooling module without its config.json")
        config = _read_json(config_path)
        if not isinstance(config, dict):
            raise InvalidConfig(f"model: {config_path} must hold a JSON object")
        chosen = [mode for flag, mode in _ST_MODES.items() if config.get(flag)]
        other = [flag for flag in _ST_UNSUPPORTED if config.get(flag)]
        if other or len(chosen) != 1 or config.get("include_prompt", True) is not True:
            what = other[0] if other else "include_prompt false" if chosen else "no pooling mode"
            if len(chosen) > 1:
                what = "several pooling modes at once"
            return cls(normalize=normalize, source=config_path,
                       unsupported=f"the model's {config_path} asks for {what}, which this server does not do "
                                   f"(it pools by {' or '.join(_ST_MODES)})")
        return cls(chosen[0], normalize, config_path)

    @classmethod
    def from_gguf(cls, pooling_type) -> "Pooling":
        """A GGUF's {arch}.pooling_type (llama.cpp normalizes embeddings by default)."""
        if pooling_type is None or int(pooling_type) == 0:
            return cls()
        mode = _GGUF_POOLING.get(int(pooling_type))
        if mode is None:
            return cls(source="the GGUF's pooling_type", unsupported=f"the GGUF's pooling_type {int(pooling_type)} "
                       "(llama.cpp's cls or rank) is not one this server does (mean or last)")
        return cls(mode, True, "the GGUF's pooling_type")

    def save(self, path: str) -> None:
        """Into a Hugging Face directory as sentence-transformers writes it (read back by from_dir); nothing
        for the default pooling, or one this server does not do."""
        if self.source == "default" or self.unsupported:
            return
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if self.normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
        with open(os.path.join(path, "modules.json"), "w", encoding="utf-8") as f:
            json.dump(modules, f, indent=1)
        with open(os.path.join(path, "1_Pooling", "config.json"), "w", encoding="utf-8") as f:
            json.dump({flag: mode == self.mode for flag, mode in _ST_MODES.items()}, f, indent=1)

    def describe(self) -> str:
        if self.unsupported:
            return f"not served ({self.unsupported})"
        return f"{self.mode} token{'s, mean' if self.mode == 'mean' else ''}, " + \
            ("L2-normalized" if self.normalize else "not normalized") + f" ({self.source})"

    def check(self, hidden_size: int, dimensions) -> int:
        """A request's `dimensions` (None: the model's own), checked before anything runs."""
        if self.unsupported:
            raise InvalidRequest(f"model: does not give embeddings here: {self.unsupported}")
        if dimensions is None:
            return hidden_size
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= hidden_size:
            raise InvalidRequest(f"dimensions: must be an integer between 1 and {hidden_size} (the model's "
                                 f"embedding size), got {dimensions!r}")
        return dimensions

    def finish(self, vector: np.ndarray, dimensions: int) -> np.ndarray:
        """The pooled vector as the model's makers give it, cut to its first `dimensions` (Matryoshka
        truncation) before it is normalized, as vLLM cuts it (OpenAI's shortened embeddings are unit vectors)."""
        v = np.asarray(vector, np.float32)[:dimensions]
        if self.normalize:
            norm = float(np.linalg.norm(v))
            v = v / max(norm, 1e-12)  # (torch.nn.functional.normalize's eps)
        return v


def encoded(vector: np.ndarray, encoding_format: str):
    """OpenAI's embedding field: a list of floats, or base64 of the little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


def check_encoding_format(value) -> str:
    if value is None:
        return "float"
    if value not in ENCODING_FORMATS:
        raise InvalidRequest(f"encoding_format: must be one of {', '.join(ENCODING_FORMATS)}, got {str(value)[:40]!r}")
    return value


def cosines(vectors: list[np.ndarray], pairs: list[tuple[int, int]]) -> list[float]:
    """The cosine of each pair (i, j) of `vectors`: the score of two texts by their embeddings."""
    unit = [v / max(float(np.linalg.norm(v)), 1e-12) for v in vectors]
    return [float(np.dot(unit[i], unit[j])) for i, j in pairs]


def take_pooled(request, start: int, num_tokens: int, last: np.ndarray, sums: np.ndarray) -> None:
    """A step's part of a pooling request's vector: its chunk covered prompt positions [start, start +
    num_tokens); `last` [E] is the final norm's output at the chunk's last row, `sums` [E] the sum over its
    rows (one row of the step's pooled outputs)."""
    end = start + num_tokens
    if request.params.pooling == "mean":
        assert start == request.pooled_upto, (
            f"{request.key}: a chunk at {start} after {request.pooled_upto} positions pooled")
        request.pooled = sums.astype(np.float32) if request.pooled is None else request.pooled + sums
        request.pooled_upto = end
    elif end == len(request.prompt_ids):
        request.pooled = last.astype(np.float32)
        request.pooled_upto = end


def pooled_vector(request) -> np.ndarray | None:
    """A finished pooling request's vector (before the model's normalization); None for other requests."""
    if request.params.pooling is None or request.pooled_upto != len(request.prompt_ids):
        return None
    return request.pooled / len(request.prompt_ids) if request.params.pooling == "mean" else request.pooled


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidConfig(f"model: {path} is not readable JSON ({e})") from None
