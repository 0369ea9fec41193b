"""Classification: labels' probabilities from a prompt's last hidden state, through a classifier head.

Plain Python and numpy, no JAX. A classification is an embedding request pooled at the last token
(SamplingParams.pooling "last", jaxcb.host.embedding): the engine runs it like any other prompt-only
request, beside generation, and the head [labels, hidden] is applied here to the pooled vector (the final
norm's output at the prompt's last token), as transformers' *ForSequenceClassification applies its `score`
to it. The head comes from
- a sequence classifier's checkpoint (config.json's architecture *ForSequenceClassification: rerankers,
  reward models, text classifiers): its `score` tensor, its labels (id2label) and its activation: sigmoid
  for one label or problem_type "multi_label_classification", none for "regression", else softmax
  (sentence-transformers' CrossEncoder `activation_fn`, where the config names one);
- a causal LM read as a classifier by the logits of some of its tokens (vLLM's `classifier_from_token`):
  the rows of its output head for those tokens, with the model's own final scaling and softcapping. Two
  tokens make one label, the second token, whose logit is the difference (sigmoid of it = the model's
  probability of the second token between the two): Qwen3-Reranker's "no" and "yes", as vLLM converts
  it; one token or three and more make a label each (softmax over them; one: sigmoid).

A one-label head is a cross-encoder: its probability is a pair's relevance score (the score and rerank
APIs). A pair is encoded as vLLM encodes it (Tokenizer.encode_pair): a checkpoint's head takes the tokenizer's
pair template (config.json's use_sep_token, default true), a from-token head the two texts joined into one (the
prompt a causal LM reranker was trained on, e.g. Qwen3-Reranker's instruction, query and document).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from jaxcb.host.errors import InvalidConfig, InvalidRequest

ACTIVATIONS = ("softmax", "sigmoid", "none")
# sentence-transformers' CrossEncoder activation_fn (config.json's "sentence_transformers", or the older
# "sbert_ce_default_activation_function") -> ours
_ST_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "none",
                   "torch.nn.modules.activation.Softmax": "softmax"}
MAX_FROM_TOKENS = 64  # tokens a from-token head may name
# How a from-token head reads its tokens' logits (vLLM's names): "from_2_way_softmax", two tokens as one label (the
# second's logit minus the first's); "no_post_processing", a label per token; "auto", the first for two tokens,
# else the second
FROM_TOKEN_METHODS = ("auto", "from_2_way_softmax", "no_post_processing")
# vLLM's --hf-overrides keys this server applies (to a from-token head), and the architectures it may name
HF_OVERRIDE_KEYS = ("classifier_from_token", "method", "is_original_qwen3_reranker", "architectures")
HEAD_FILE = "classifier"  # a converted checkpoint's head: classifier.json and classifier.npz


@dataclasses.dataclass(frozen=True, eq=False)
class Classification:
    """One input's answer: the most probable label and every label's probability."""

    label: str
    probs: np.ndarray  # [labels] float64 (the raw logits for a head without an activation)


@dataclasses.dataclass(frozen=True, eq=False)
class Classifier:
    """A head on the last token's final hidden state: logits = weight @ h (+ bias), then the activation."""

    weight: np.ndarray  # [rows, hidden] float32
    labels: tuple[str, ...]
    activation: str  # ACTIVATIONS
    source: str  # where it was read (the start banner, GetModelInfo)
    bias: np.ndarray | None = None  # [rows]
    difference: bool = False  # two rows, one label: the second row's logit minus the first's
    joins_pairs: bool = False  # a scored pair is its two texts joined into one text (else the pair template)
    # A scored pair is written by the server's chat template (--chat-template: a score template, vLLM's way to
    # serve e.g. the original Qwen3-Reranker to clients that send a bare query and documents)
    templated: bool = False
    # A from-token head's logits as the causal LM finishes its own: divided by its logit scale, softcapped
    logit_scale: float = 1.0
    softcap: float = 0.0

    def __post_init__(self):
        assert self.activation in ACTIVATIONS, self.activation
        assert len(self.labels) == (1 if self.difference else self.weight.shape[0]), (self.labels, self.weight.shape)

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def scores(self) -> bool:
        """Whether it gives one relevance score per input (a cross-encoder): one label."""
        return self.num_labels == 1

    def logits(self, pooled: np.ndarray) -> np.ndarray:
        z = self.weight @ np.asarray(pooled, np.float32)
        if self.bias is not None:
            z = z + self.bias
        if self.logit_scale != 1.0:
            z = z / self.logit_scale
        if self.softcap:
            z = self.softcap * np.tanh(z / self.softcap)
        return (z[1:] - z[:1]) if self.difference else z

    def probs(self, pooled: np.ndarray, activation: bool = True) -> np.ndarray:
        """The labels' probabilities (float64); the raw logits for activation "none" or `activation` false (vLLM's
        use_activation: a reward model's score)."""
        z = self.logits(pooled).astype(np.float64)
        if not activation:
            return z
        if self.activation == "sigmoid":
            return 1.0 / (1.0 + np.exp(-z))
        if self.activation == "softmax":
            e = np.exp(z - z.max())
            return e / e.sum()
        return z

    def classify(self, pooled: np.ndarray, activation: bool = True) -> Classification:
        probs = self.probs(pooled, activation)
        return Classification(self.labels[int(np.argmax(probs))], probs)

    def check_scores(self) -> None:
        """Before a score or rerank request runs on this head."""
        if not self.scores:
            raise InvalidRequest(f"model: classifies into {self.num_labels} labels ({', '.join(self.labels[:8])}); "
                                 "scoring pairs needs a cross-encoder's one label (use /classify)")

    def describe(self) -> str:
        kind = "a cross-encoder's score" if self.scores else f"{self.num_labels} labels"
        return f"{kind}, {self.activation} ({self.source})"

    def save(self, path: str) -> None:
        """Into a converted checkpoint's directory (`jaxcb convert`), read back by `load`."""
        arrays = {"weight": self.weight} if self.bias is None else {"weight": self.weight, "bias": self.bias}
        np.savez(os.path.join(path, HEAD_FILE + ".npz"), **arrays)
        with open(os.path.join(path, HEAD_FILE + ".json"), "w", encoding="utf-8") as f:
            json.dump({"labels": list(self.labels), "activation": self.activation, "source": self.source,
                       "difference": self.difference, "logit_scale": self.logit_scale, "softcap": self.softcap,
                       "joins_pairs": self.joins_pairs}, f, indent=1)


def load(path: str) -> Classifier | None:
    """A converted checkpoint's head (Classifier.save), None if it has none."""
    meta_path = os.path.join(path, HEAD_FILE + ".json")
    if not os.path.isfile(meta_path):
        return None
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        with np.load(os.path.join(path, HEAD_FILE + ".npz")) as arrays:
            weight, bias = arrays["weight"], arrays["bias"] if "bias" in arrays else None
        return Classifier(weight.astype(np.float32), tuple(meta["labels"]), meta["activation"], meta["source"],
                          bias, difference=bool(meta["difference"]), joins_pairs=bool(meta.get("joins_pairs", False)),
                          logit_scale=float(meta["logit_scale"]), softcap=float(meta["softcap"]))
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise InvalidConfig(f"model: {path}'s classifier head ({HEAD_FILE}.json / .npz) is not readable ({e})") from None


def score_kwargs(head: Classifier | None, instruction, kwargs) -> dict:
    """A score request's variables for the score template (vLLM's `instruction`, folded into its
    `chat_template_kwargs`, whose own keys win), refused where there is no template to write them."""
    from jaxcb.host.chat_template import check_template_kwargs

    kwargs = check_template_kwargs(kwargs)
    if instruction is not None:
        if not isinstance(instruction, str):
            raise InvalidRequest(f"instruction: must be a string, got {type(instruction).__name__}")
        kwargs = {"instruction": instruction, **kwargs}
    if kwargs and (head is None or not head.templated):
        field = "instruction" if instruction is not None else "chat_template_kwargs"
        raise InvalidRequest(f"{field}: this server has no score template to write it into (serve a cross-encoder "
                             "with --chat-template)")
    return kwargs


def score_pairs(first: int, second: int) -> list[tuple[int, int]]:
    """vLLM's score pairing of `first` texts (text_1) against `second` texts (text_2): one against each, or the
    two lists pair by pair; each pair as (i, j) indices into text_1 + text_2."""
    if first != 1 and first != second:
        raise InvalidRequest(f"text_1: {first} texts against text_2's {second}; give one text, or as many as text_2 "
                             "has")
    return [(0 if first == 1 else k, first + k) for k in range(second)]


def not_served(what: str) -> InvalidRequest:
    return InvalidRequest(f"model: has no classifier head, so it does not {what} (serve a *ForSequenceClassification "
                          "checkpoint, or a causal LM with --classifier-from-tokens)")


def from_checkpoint(path: str, raw: dict, tensors: dict[str, np.ndarray]) -> Classifier | None:
    """A Hugging Face checkpoint's sequence classifier head (`raw`: its config.json; `tensors`: its score.weight and
    score.bias, as the model loader reads them), or None when its architecture is not one."""
    arch = (raw.get("architectures") or [""])[0]
    if not isinstance(arch, str) or not arch.endswith("ForSequenceClassification"):
        return None
    if "score.weight" not in tensors:
        raise InvalidConfig(f"model: {path} is a {arch} without its score.weight")
    weight = np.asarray(tensors["score.weight"], np.float32)
    if weight.ndim != 2:
        raise InvalidConfig(f"model: {path}'s score.weight has shape {weight.shape}, not [labels, hidden]")
    n = weight.shape[0]
    id2label = raw.get("id2label") or {}
    try:
        names = {int(k): str(v) for k, v in id2label.items()} if isinstance(id2label, dict) else {}
    except (TypeError, ValueError):
        names = {}
    labels = tuple(names.get(i, f"LABEL_{i}") for i in range(n))
    problem = raw.get("problem_type")
    activation = "sigmoid" if n == 1 or problem == "multi_label_classification" else \
        "none" if problem == "regression" else "softmax"
    st = raw.get("sentence_transformers")
    named = (st.get("activation_fn") if isinstance(st, dict) else None) or raw.get("sbert_ce_default_activation_function")
    if named is not None:
        if named not in _ST_ACTIVATIONS:
            raise InvalidConfig(f"model: {path}/config.json names the activation {str(named)[:80]!r}, which this "
                                f"server does not apply ({', '.join(_ST_ACTIVATIONS)})")
        activation = _ST_ACTIVATIONS[named]
    bias = tensors.get("score.bias")
    return Classifier(weight, labels, activation, f"{arch}'s score head",
                      None if bias is None else np.asarray(bias, np.float32).reshape(n),
                      joins_pairs=raw.get("use_sep_token", True) is False)


def parse_tokens(value) -> tuple[str, ...]:
    """--classifier-from-tokens / model.classifier_from_tokens: comma-separated text, or a list of strings."""
    if isinstance(value, str):
        value = [t for t in value.split(",")] if value else []
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) and t for t in value):
        raise InvalidConfig(f"model.classifier_from_tokens: must be a list of tokens (e.g. no,yes), got {value!r}")
    if len(value) > MAX_FROM_TOKENS or len(set(value)) != len(value):
        raise InvalidConfig(f"model.classifier_from_tokens: 1 to {MAX_FROM_TOKENS} different tokens, got {len(value)}")
    return tuple(value)


def check_method(method: str, tokens: tuple[str, ...]) -> str:
    """model.classifier_method against the tokens it reads."""
    if method not in FROM_TOKEN_METHODS:
        raise InvalidConfig(f"model.classifier_method: {method!r} is not one of {', '.join(FROM_TOKEN_METHODS)}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise InvalidConfig(f"model.classifier_method: from_2_way_softmax reads two tokens, "
                            f"model.classifier_from_tokens names {len(tokens)}")
    return method


def hf_overrides(text: str) -> tuple[tuple[str, ...], str]:
    """vLLM's --hf-overrides as it is written to serve a causal LM as a reranker (e.g. the original
    Qwen3-Reranker's {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": true}): (classifier_from_tokens, classifier_method). Any other key is refused by
    name: this server does not rewrite a model's config."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise InvalidConfig(f"--hf-overrides: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise InvalidConfig("--hf-overrides: must be a JSON object")
    other = sorted(set(raw) - set(HF_OVERRIDE_KEYS))
    if other:
        raise InvalidConfig(f"--hf-overrides: {other[0]!r} is not a key this server applies (it takes "
                            f"{', '.join(HF_OVERRIDE_KEYS)}: a causal LM read as a classifier)")
    archs = raw.get("architectures", [])
    if not isinstance(archs, list) or not all(isinstance(a, str) and a.endswith(("ForSequenceClassification",
                                                                              "ForCausalLM")) for a in archs):
        raise InvalidConfig("--hf-overrides: architectures may only name a *ForSequenceClassification (or the "
                            "*ForCausalLM) of the model's family")
    tokens = parse_tokens(raw.get("classifier_from_token", []))
    method = raw.get("method", "auto")
    if raw.get("is_original_qwen3_reranker") is True:
        method = "from_2_way_softmax"
    if not isinstance(method, str):
        raise InvalidConfig(f"--hf-overrides: method must be a string, got {method!r}")
    if not tokens and (method != "auto" or archs):
        raise InvalidConfig("--hf-overrides: classifier_from_token is required to read the model as a classifier")
    return tokens, check_method(method, tokens)


def token_ids(tokenizer, tokens: tuple[str, ...]) -> list[int]:
    """Each token's id: the vocabulary entry spelt so, else the one token its text encodes to."""
    if tokenizer is None:
        raise InvalidConfig("model.classifier_from_tokens: this model has no tokenizer to find the tokens in")
    ids = []
    for t in tokens:
        i = tokenizer.token_id(t)
        if i is None:
            encoded = tokenizer.encode(t, add_bos=False)
            if len(encoded) != 1:
                raise InvalidConfig(f"model.classifier_from_tokens: {t!r} is not one token of this model's "
                                    f"vocabulary (it encodes to {len(encoded)})")
            i = encoded[0]
        ids.append(int(i))
    return ids


def from_tokens(tokens: tuple[str, ...], rows: np.ndarray, logit_scale: float = 1.0, softcap: float = 0.0,
                method: str = "auto") -> Classifier:
    """The head that reads a causal LM's logits of `tokens` (rows: their output head rows [n, hidden]) by
    `method` (FROM_TOKEN_METHODS)."""
    source = f"the logits of {', '.join(repr(t) for t in tokens)}"
    common = dict(logit_scale=logit_scale, softcap=softcap, joins_pairs=True)
    rows = np.asarray(rows, np.float32)
    if len(tokens) == 2 and check_method(method, tokens) != "no_post_processing":
        return Classifier(rows, (tokens[1],), "sigmoid", source, difference=True, **common)
    return Classifier(rows, tokens, "sigmoid" if len(tokens) == 1 else "softmax", source, **common)
