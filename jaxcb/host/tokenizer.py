"""Tokenizer and chat template, built from the model file's metadata.

The byte-level BPE model is built with the `tokenizers` library from the GGUF vocabulary and merges;
the pre-tokenizer follows llama.cpp's name for it (`tokenizer.ggml.pre`). Control tokens
(`<|im_start|>`...) are added as special tokens, user-defined ones (Qwen's `<tool_call>`) as tokens that
are matched whole in text and decoded as text.

A SentencePiece vocabulary (`tokenizer.ggml.model = llama`: Llama 2, Gemma) becomes a BPE model with
byte fallback over "▁"-for-space text. Such files carry no merges: they are rebuilt from the
vocabulary (every split of a token into two tokens is a merge), ranked by the token's score, except
for Gemma, whose merge order is the order of its tokens in the file (its scores do not follow it);
Gemma files also spell whitespace-only tokens with real spaces, which are respelled with "▁".
Control tokens are special; user-defined ones (Gemma's runs of newlines, its HTML tags) are matched
whole but decoded as text. Rebuilding the merges of a large vocabulary takes seconds (Gemma 3's 262,144
tokens: about 6 s on a 2-core CPU), so the finished tokenizer is kept as JSON in
~/.cache/jaxcb/tokenizers/ (JAXCB_TOKENIZER_CACHE overrides the folder), keyed by the vocabulary, its
scores and types, the options, this module's source and the tokenizers library's version.
The chat template stored in the file (or the server's, or a request's) is rendered with jinja2 in a sandbox
(jaxcb.host.chat_template).
"""

from __future__ import annotations

import array
import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import threading

import jinja2
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import __version__ as _TOKENIZERS_VERSION

from jaxcb.host import template_process
from jaxcb.host.chat_template import (ROLES, TextParts, check_template_kwargs, compile_template, parts_for,
                                      reads_parts, template_roles)
from jaxcb.host.embedding import Pooling
from jaxcb.host.errors import InvalidConfig, InvalidRequest, shown

_CONTROL, _USER_DEFINED = 3, 4
UNLOCKED_CHARS = 4096  # texts at least this long are encoded with the GIL let go (_Unlocked)
_LONG = threading.Lock()
TRIM_CHARS = 1 << 18  # before encoding a text this long, the heap gives back what earlier ones freed (trim_heap)


def trim_heap() -> None:
    """glibc's malloc keeps the memory a megabyte's encoding and its Python objects freed, in each thread's arena
    (four clients counting a megabyte's tokens over and over: +3.3 GB held, all of it given back by malloc_trim),
    and a profile's buffers likewise: give it back to the system. A no-op where the C library has no malloc_trim."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class _Unlocked:
    """A `tokenizers` Tokenizer whose `encode` lets other Python threads run: its own `encode` holds the GIL
    throughout (a megabyte of text: 0.5-0.6 s in which the engine's step loop and the event loop stood still,
    every stream with them), `encode_batch` lets it go. Long texts go through the latter (the same encoding), one
    at a time; everything else is the tokenizer's own."""

    def __init__(self, tok: HFTokenizer):
        self._tok = tok

    def encode(self, sequence, pair=None, add_special_tokens: bool = True):
        if len(sequence) + len(pair or "") < UNLOCKED_CHARS:
            return self._tok.encode(sequence, pair, add_special_tokens=add_special_tokens)
        with _LONG:  # (one long text at a time, as the GIL had them: a megabyte's encoding peaks near 160 MB)
            if len(sequence) >= TRIM_CHARS:
                trim_heap()
            return self._tok.encode_batch([sequence if pair is None else (sequence, pair)],
                                          add_special_tokens=add_special_tokens)[0]

    def __getattr__(self, name):
        if name == "_tok":  # (not set yet: a copy being made)
            raise AttributeError(name)
        return getattr(self._tok, name)
# GPT-2's split pattern, used by most byte-level BPE vocabularies.
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Qwen2's (and Qwen2.5's, Qwen3's): Llama 3's with every digit a piece of its own.
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's Tekken (Mistral Nemo, Pixtral): words split at a lower-to-upper case change, every digit its own
# piece, no contractions (its tokenizer.json's pattern).
_TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o's (o200k: Phi-4-mini): Tekken's words with their contractions, digits by three.
_GPT4O_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# generation_config.json's fields a server takes as its sampling defaults, as vLLM's --generation-config auto takes them
SAMPLING_DEFAULTS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float}


def sampling_defaults(generation: dict, where: str) -> dict:
    """The sampling fields of a generation_config.json (`generation`), checked as a request's would be (a bad one
    refuses the model, naming the file, rather than every request)."""
    from jaxcb.host.request import SamplingParams

    out = {}
    for key, kind in SAMPLING_DEFAULTS.items():
        value = generation.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise InvalidConfig(f"model: {where}: {key} must be {'an integer' if kind is int else 'a number'}, "
                                f"got {value!r}")
        out[key] = kind(value)
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise InvalidConfig(f"model: {where}: {e}") from None
    return out


# The roles a score template's two messages have (vLLM's: Tokenizer.encode_pair)
SCORE_ROLES = ("query", "document")


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """What a tokenizer needs, as stored in the model file."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE with byte fallback)
    pre: str  # llama.cpp pre-tokenizer name, e.g. "smollm", "llama-bpe", "default"
    tokens: tuple[str, ...]
    merges: tuple[str, ...]
    token_types: tuple[int, ...]  # 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None
    scores: tuple[float, ...] = ()  # SentencePiece: each token's score (its merge priority)
    add_space_prefix: bool = True  # SentencePiece: a space before the text (Llama 2 yes, Gemma no)
    arch: str = "llama"  # general.architecture (Gemma's merge order is its token order, not its scores)
    end_ids: tuple[int, ...] = ()  # more tokens that end a generation (GGUF's end-of-turn and end-of-message)
    add_eos: bool = False  # tokenizer.ggml.add_eos_token: an input to embed ends with the EOS (encode_input)
    pooling_type: int | None = None  # {arch}.pooling_type: how its embeddings pool (jaxcb.host.embedding)


# Control tokens that end a generation besides the file's EOS, by their text (llama.cpp's rule for GGUF
# files): an instruct model's end of turn where the EOS is its end of text, or the reverse (Llama 3's
# <|eot_id|> and, after a tool call, <|eom_id|>; Gemma's <end_of_turn>; ChatML's <|im_end|>).
END_TEXTS = frozenset(("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                       "<EOT>", "<|return|>", "<|call|>"))
# OpenAI's harmony vocabulary (gpt-oss): an answer ends at <|return|> or at a tool call's <|call|>; its <|end|>
# ends one message (the reasoning) and the answer goes on. Where a vocabulary has both, <|end|> ends nothing
# (llama.cpp's rule).
HARMONY_ENDS = ("<|return|>", "<|call|>")


def _end_ids(spec: TokenizerSpec) -> tuple[int, ...]:
    control = {t: i for i, (t, kind) in enumerate(zip(spec.tokens, spec.token_types)) if kind == _CONTROL}
    ids = tuple(spec.end_ids) + tuple(i for t, i in control.items() if t in END_TEXTS)
    if all(t in control for t in HARMONY_ENDS) and "<|end|>" in control:
        ids = tuple(i for i in ids if i != control["<|end|>"])
    return ids


# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) by the split they make: GPT-2's pattern; every digit
# its own piece ("\p{N}" first), then GPT-2's; Llama 3's pattern; Qwen2's; Tekken's; GPT-4o's.
_PRE_SPLITS = {"default": "gpt2", "gpt-2": "gpt2", "gpt2": "gpt2", "smollm": "digits", "starcoder": "digits",
               "refact": "digits", "codeshell": "digits", "llama-bpe": "llama3", "llama3": "llama3",
               "smaug-bpe": "llama3", "qwen2": "qwen2", "tekken": "tekken", "gpt-4o": "gpt4o",
               "llama4": "gpt4o"}
_PATTERNS = {"llama3": _LLAMA3_PATTERN, "qwen2": _QWEN2_PATTERN, "tekken": _TEKKEN_PATTERN, "gpt4o": _GPT4O_PATTERN}
# Whose BPE takes a piece that is a token whole before any merge (tokenizer.json's ignore_merges; llama.cpp's
# for these names).
_IGNORE_MERGES = ("llama-bpe", "llama3", "tekken")
PRE_TOKENIZERS = tuple(_PRE_SPLITS)


def _pre_tokenizer(pre: str):
    """llama.cpp's pre-tokenizer `pre` (tokenizer.ggml.pre) as the `tokenizers` library's. One that is not
    known here is refused: splitting text another way than the model was trained on gives other tokens."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = _PRE_SPLITS.get(pre)
    if split == "gpt2":
        return byte_level
    if split == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if split in _PATTERNS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PATTERNS[split]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise InvalidConfig(f"tokenizer.ggml.pre: {pre!r} is not a pre-tokenizer jaxcb knows ({', '.join(PRE_TOKENIZERS)}); "
                        "serve the model's Hugging Face directory (its tokenizer.json) instead")


def _cache_path(spec: TokenizerSpec) -> str:
    root = os.environ.get("JAXCB_TOKENIZER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxcb",
                                                                     "tokenizers")
    key = hashlib.sha256()
    with open(__file__, "rb") as f:  # any change to how tokenizers are built makes a new key
        key.update(f.read())
    for part in (_TOKENIZERS_VERSION, spec.model, spec.arch, str(spec.add_space_prefix), str(len(spec.tokens))):
        key.update(part.encode() + b"\0")
    key.update("\0".join(spec.tokens).encode("utf-8", "surrogatepass"))
    key.update(array.array("d", spec.scores).tobytes())
    key.update(array.array("q", spec.token_types).tobytes())
    return os.path.join(root, key.hexdigest()[:32] + ".json")


def _cached(path: str) -> tuple[HFTokenizer, str] | None:
    """The tokenizer built before for this vocabulary (its _cache_path), and its JSON; None if there is
    none, or it does not parse (a truncated or foreign file is rebuilt, not trusted)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        return HFTokenizer.from_str(text), text
    except Exception:  # noqa: BLE001 - any failure: build it again
        return None


def _store(path: str, text: str) -> None:
    """Keep the built tokenizer at `path` (atomically: a reader never sees half a file); a cache that
    cannot be written is no error."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=os.path.dirname(path))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        pass


def _sentencepiece_bpe(spec: TokenizerSpec) -> HFTokenizer:
    space = "\u2581"
    tokens = [space * len(t) if t and not t.strip(" ") else t for t in spec.tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if spec.arch.startswith("gemma") or not spec.scores:
        rank = lambda i: -i  # noqa: E731 - earlier in the file merges first
    else:
        rank = spec.scores.__getitem__
    merges = []
    for i, t in enumerate(tokens):
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in vocab and right in vocab:
                merges.append((rank(i), len(left), len(right), vocab[left], vocab[right], left, right))
    # Best token first; among one token's splits, the longest left piece first.
    merges.sort(key=lambda m: (-m[0], -m[1], -m[2], m[3], m[4]))
    unk = "<unk>" if "<unk>" in vocab else None
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[(m[5], m[6]) for m in merges], unk_token=unk,
                                 fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend(space)] if spec.add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", space)])
    tok.decoder = decoders.Sequence([decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     *([decoders.Strip(" ", 1, 0)] if spec.add_space_prefix else [])])
    return tok


class Tokenizer:
    def __init__(self, spec: TokenizerSpec):
        if spec.model == "llama":
            path = _cache_path(spec)  # hashes the whole vocabulary: once
            cached = _cached(path)
            if cached is None:
                tok = _sentencepiece_bpe(spec)
                # User-defined tokens are matched whole, except the whitespace runs, which the vocabulary
                # holds respelled with "▁" and the merges produce.
                vocab = tok.get_vocab()
                special = [AddedToken(t, special=kind == _CONTROL, normalized=False)
                           for t, kind in zip(spec.tokens, spec.token_types)
                           if kind == _CONTROL or (kind == _USER_DEFINED and t in vocab)]
                tok.add_special_tokens([t for t in special if t.special])
                tok.add_tokens([t for t in special if not t.special])
                text = tok.to_str()
                _store(path, text)
            else:
                tok, text = cached
            self._setup(tok, spec.bos_id, spec.eos_id, spec.add_bos, spec.chat_template, text, _end_ids(spec),
                        spec.add_eos, Pooling.from_gguf(spec.pooling_type))
            return
        if spec.model != "gpt2":
            raise InvalidConfig(
                f"tokenizer.ggml.model: {spec.model!r} is not supported; supported: 'gpt2' (byte-level BPE), "
                "'llama' (SentencePiece)"
            )
        vocab = {tok: i for i, tok in enumerate(spec.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in spec.merges]
        # Llama 3's tokenizer (and llama.cpp for it) takes a piece that is a token whole, merges aside.
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                     ignore_merges=spec.pre in _IGNORE_MERGES))
        tok.pre_tokenizer = _pre_tokenizer(spec.pre)
        if spec.pre == "qwen2":  # (Qwen's tokenizer.json normalizes to NFC first)
            tok.normalizer = normalizers.NFC()
        tok.decoder = decoders.ByteLevel()
        # Control tokens are special (left out of decoded text); user-defined ones (Qwen's <tool_call> and
        # <think>, which llama.cpp's converter marks so) are matched whole and are text, as in the model's
        # tokenizer.json and llama.cpp's detokenizer.
        added = [AddedToken(t, special=kind == _CONTROL, normalized=False)
                 for t, kind in zip(spec.tokens, spec.token_types) if kind in (_CONTROL, _USER_DEFINED)]
        tok.add_special_tokens([t for t in added if t.special])
        tok.add_tokens([t for t in added if not t.special])
        self._setup(tok, spec.bos_id, spec.eos_id, spec.add_bos, spec.chat_template, None, _end_ids(spec), spec.add_eos,
                    Pooling.from_gguf(spec.pooling_type))

    def _setup(self, tok: HFTokenizer, bos_id, eos_id, add_bos: bool, chat_template: str | None,
               text: str | None = None, end_ids=(), add_eos: bool = False, pooling: Pooling = Pooling()) -> None:
        self._tok = _Unlocked(tok)
        self.add_eos = add_eos  # an input to embed ends with the EOS (encode_input)
        self.pooling = pooling  # how the model's embeddings pool (jaxcb.host.embedding)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_id = eos_id
        # Every token that ends a generation: the EOS and the file's others (a GGUF's end of turn, a
        # Hugging Face generation_config.json's eos_token_id list).
        self.end_ids = tuple(sorted({eos_id, *end_ids} - {None}))
        self.add_bos = add_bos
        self.chat_template = chat_template
        # The sampling the model's makers recommend (generation_config.json, from_dir): a server's defaults for what
        # a request leaves out (vLLM's --generation-config auto)
        self.sampling_defaults: dict = {}
        self.special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        # A copy that reads special-token text as plain text: for what users wrote (encode_chat).
        plain = HFTokenizer.from_str(text or tok.to_str())
        plain.encode_special_tokens = True
        self._plain = _Unlocked(plain)
        self._bytes: dict[int, bytes] = {}
        self._llg: dict[tuple, object] = {}  # llguidance's tokenizers of this one, by (n_vocab, eos ids)
        self._llg_lock = threading.Lock()
        self._bytes_from_text = False  # token_bytes: llguidance could not read this tokenizer
        self._template = compile_template(chat_template) if chat_template else None

    def set_chat_template(self, text: str) -> None:
        """Replace the model file's chat template (the server's --chat-template: jaxcb.host.chat_template)."""
        self.chat_template, self._template = text, compile_template(text, "model.chat_template")

    def to_str(self) -> str:
        """The tokenizer as Hugging Face tokenizers' JSON (what llguidance reads: jaxcb.host.structured)."""
        return self._tok.to_str()

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        """A Hugging Face tokenizer directory: tokenizer.json (+ tokenizer_config.json for the BOS/EOS
        tokens and the chat template, generation_config.json for the tokens that end a generation), as
        written by `save`."""
        import os

        tok_path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise InvalidConfig(f"model: {path} has no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(tok_path)
        except Exception as e:  # noqa: BLE001 - the library raises its own exception type
            raise InvalidConfig(f"model: {tok_path} is not a readable tokenizer ({e})") from None
        cfg = {}
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)

        def token_id(key):
            t = cfg.get(key)
            t = t.get("content") if isinstance(t, dict) else t
            return tok.token_to_id(t) if isinstance(t, str) else None

        self = cls.__new__(cls)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja):  # (transformers 4.50+ saves the template beside the config)
            try:
                with open(jinja, encoding="utf-8") as f:
                    template = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise InvalidConfig(f"model: {jinja} is not readable text ({e})") from None
        ends, generation = [], {}
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            try:
                with open(gen_path, encoding="utf-8") as f:
                    generation = json.load(f)
            except (OSError, ValueError) as e:
                raise InvalidConfig(f"model: {gen_path} is not readable JSON ({e})") from None
            if not isinstance(generation, dict):
                raise InvalidConfig(f"model: {gen_path} must hold a JSON object")
            ends = generation.get("eos_token_id") or []
            ends = [ends] if isinstance(ends, int) else ends
            if not isinstance(ends, list) or not all(isinstance(i, int) and 0 <= i < tok.get_vocab_size() for i in ends):
                raise InvalidConfig(f"model: {gen_path}: eos_token_id must be a token id or a list of them")
        self._setup(tok, token_id("bos_token"), token_id("eos_token"), bool(cfg.get("add_bos_token", False)),
                    template, None, ends, cfg.get("add_eos_token") is True, Pooling.from_dir(path))
        self.sampling_defaults = sampling_defaults(generation, gen_path)
        return self

    def save(self, path: str) -> None:
        """tokenizer.json, tokenizer_config.json and generation_config.json's eos_token_id into directory
        `path` (read back by from_dir)."""
        import os

        self._tok.save(os.path.join(path, "tokenizer.json"))
        name = lambda i: self.id_to_token(i) if i is not None else None  # noqa: E731
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"bos_token": name(self.bos_id), "eos_token": name(self.eos_id), "add_bos_token": self.add_bos,
                       "add_eos_token": self.add_eos, "chat_template": self.chat_template}, f, indent=1)
        self.pooling.save(path)
        with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({"eos_token_id": list(self.end_ids), **self.sampling_defaults}, f, indent=1)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id, *ids]
        return ids

    def encode_input(self, text: str) -> list[int]:
        """An input to embed, as sentence-transformers and vLLM encode it: with the tokenizer's own special
        tokens (tokenizer.json's post-processor, e.g. Qwen3-Embedding's closing <|endoftext|>), else the BOS as
        encode adds it and the EOS where the model file says to add it (add_eos_token)."""
        if self._tok.post_processor is not None:
            return self._tok.encode(text, add_special_tokens=True).ids
        ids = self.encode(text)
        if self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode_pair(self, first: str, second: str, join: bool = False, template: bool = False,
                    template_kwargs: dict | None = None) -> list[int]:
        """A text pair as a cross-encoder takes it (vLLM's score prompts): `template`, written by the chat
        template (the server's --chat-template, a score template as vLLM takes it: the messages {"role":
        "query"} and {"role": "document"}, with `template_kwargs` such as the request's `instruction`; the texts
        kept from forging special tokens as a chat's are); `join`, the two texts joined into one (as vLLM encodes
        a causal LM reranker's pair); else transformers' tokenizer(first, second): the tokenizer.json
        post-processor's pair template (a separator where the model has one; else the two side by side), or
        encode_input's special tokens around the two, the second without a BOS."""
        if template:
            return self.encode_chat([{"role": "query", "content": first}, {"role": "document", "content": second}],
                                    False, template_kwargs, roles=SCORE_ROLES)
        if join:
            return self.encode_input(first + second)
        if self._tok.post_processor is not None:
            return self._tok.encode(first, second, add_special_tokens=True).ids
        ids = self.encode(first) + self.encode(second, add_bos=False)
        if self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_id(self, text: str) -> int | None:
        """The id of the token spelt `text` (a special token's, e.g. "</think>"), None if no token is."""
        return self._tok.token_to_id(text)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token covers: its vocabulary entry's length (one character per
        byte in a byte-level vocabulary, per character in SentencePiece's), an upper bound. A text longer
        than n tokens of it is more than n tokens."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def llguidance(self, n_vocab: int | None = None, eos_ids=()):
        """llguidance's tokenizer of this one (the structured-output library's: jaxcb.host.structured),
        `n_vocab` ids wide (default this vocabulary) with these end tokens; built once per width and end
        tokens (a fraction of a second) and shared. Raises what llguidance raises for a tokenizer it
        cannot read."""
        key = (n_vocab or self.vocab_size, tuple(eos_ids))
        with self._llg_lock:
            got = self._llg.get(key)
            if got is None:
                import llguidance

                got = self._llg[key] = llguidance.LLTokenizer(self.to_str(), n_vocab=key[0],
                                                              eos_token=list(key[1]) or None)
            return got

    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes: a piece of a multi-byte character is that piece (where decode() gives
        U+FFFD), a special token its text, an id past the vocabulary b"". What OpenAI's logprobs `bytes`
        carry, so that clients can join the pieces of a character. Read by llguidance's tokenizer
        (byte-exact for byte-level BPE and SentencePiece's byte tokens alike: the one structured output
        built, if any, else one of its own) and each token's bytes kept."""
        if not 0 <= token < self.vocab_size:
            return b""
        got = self._bytes.get(token)
        if got is None:
            with self._llg_lock:
                llg = next(iter(self._llg.values()), None)
            if llg is None and self._bytes_from_text is False:
                try:
                    llg = self.llguidance()
                except Exception:  # noqa: BLE001 - a tokenizer llguidance cannot read: the decoded text's bytes
                    self._bytes_from_text = True
            if llg is None:
                got = self.decode([token], skip_special=False).encode()
            else:
                got = bytes(llg.decode_bytes([token]))
            self._bytes[token] = got
        return got

    def _source(self, chat_template: str | None) -> str | None:
        """The text of the template a render uses: the request's own, else the model's."""
        return self.chat_template if chat_template is None else chat_template

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    template_kwargs: dict | None = None, chat_template: str | None = None,
                    tools: list[dict] | None = None, roles: tuple[str, ...] = ROLES) -> str:
        """The conversation as the model's chat template writes it. `template_kwargs`: more variables
        for the template (vLLM's chat_template_kwargs, e.g. Qwen3's {"enable_thinking": false}); a
        template that does not use one ignores it. `chat_template`: this request's own template.
        `tools`: the template's `tools` (OpenAI's function tools, for a template that renders them; an
        assistant message may then carry `tool_calls`, whose arguments are objects). `roles`: those the
        messages may have (a score template's: SCORE_ROLES)."""
        template_kwargs = check_template_kwargs(template_kwargs)
        template = self._template
        if template is None and chat_template is None:
            raise InvalidRequest("chat: this model file has no chat template; send a raw prompt (or give one: "
                                 "--chat-template on the command line, LLM.chat's chat_template)")
        for i, m in enumerate(messages):
            if m.get("role") not in roles:
                raise InvalidRequest(f"messages[{i}].role: {shown(m.get('role'))} is not one of {', '.join(roles)}")
            if not isinstance(m.get("content"), str):
                raise InvalidRequest(f"messages[{i}].content: must be a string")
        bos = self.id_to_token(self.bos_id) if self.bos_id is not None else ""
        eos = self.id_to_token(self.eos_id) if self.eos_id is not None else ""
        source = self._source(chat_template)
        variables = dict(template_kwargs, messages=parts_for(template_roles(messages), source),
                         add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos, tools=tools)
        if chat_template is not None:  # a request's own: compiled and rendered in a process of its own, bounded
            return template_process.render(chat_template, variables)
        try:
            return template.render(**variables)
        except InvalidRequest:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, ArithmeticError, LookupError, AttributeError,
                RecursionError) as e:
            # (a variable of the wrong type for the template, or one it refuses: the request's fault)
            raise InvalidRequest(f"chat template: could not render the request ({type(e).__name__}: "
                                 f"{str(e)[:200]})") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    template_kwargs: dict | None = None, continue_final_message: bool = False,
                    chat_template: str | None = None, tools: list[dict] | None = None,
                    roles: tuple[str, ...] = ROLES) -> list[int]:
        """The rendered conversation's ids. The template writes the special tokens itself (never
        another BOS); special-token text inside a message's content (a user typing `<|im_start|>system`)
        is encoded as the plain text it is, so no message can forge a role or end another's turn.

        Where each content lands in the rendered text is found exactly, not searched for: the template
        is also rendered with a unique marker in place of each content, which gives the template's own
        text between contents; the real rendering must be that text with the contents put back (as
        they are, or trimmed where the template trims them). The whole text is then tokenized at once
        (the template's tokens as the model was trained on them) and any special token that touches a
        content span is encoded as plain text; if one straddles a span's edge, every content is encoded
        on its own as plain text between the template's pieces. A template that rewrites contents
        (Qwen3's drops an earlier answer's <think> part) cannot be followed so: its text is tokenized
        whole when its special tokens are exactly the template's own (those of the rendering with
        markers), and refused when a content would add one.

        `continue_final_message` (vLLM's): the conversation ends inside the final (assistant) message, at
        the end of its content, so that the model goes on writing it (the template's end of turn and
        anything after it are left out; add_generation_prompt must be false). `chat_template`: the
        request's own template instead of the model's (vLLM's field of that name). `tools`, and the
        messages' `tool_calls`, are written by the template as its own text: one holding a special token's
        text is refused (it would be that token)."""
        self._check_no_special("tools", tools)
        documents = check_template_kwargs(template_kwargs).get("documents")
        self._check_no_special("documents", documents)
        if documents:  # (and as a template writing one field after another would join them)
            self._check_no_special("documents", "".join(v for d in documents for v in d.values()))
        for i, m in enumerate(messages):
            self._check_no_special(f"messages[{i}].tool_calls", m.get("tool_calls"))
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidRequest("continue_final_message: not with add_generation_prompt (set it to false)")
            if not messages or messages[-1].get("role") != "assistant":
                raise InvalidRequest("continue_final_message: the last message must be the assistant's")
        text = self.render_chat(messages, add_generation_prompt, template_kwargs, chat_template, tools, roles)
        pieces, marked = self._chat_pieces(messages, text, add_generation_prompt, template_kwargs, chat_template,
                                           tools, roles)
        if pieces is None and not continue_final_message:  # the template rewrites contents
            enc = self._tok.encode(text, add_special_tokens=False)
            own = [t for t in self._tok.encode(marked, add_special_tokens=False).ids if t in self.special_ids]
            if [t for t in enc.ids if t in self.special_ids] == own:  # no content brought a special token
                return enc.ids
        if pieces is None:
            raise InvalidRequest("messages: the chat template rewrites message contents, and a content holds "
                                 "a special token's text; send a raw prompt")
        if continue_final_message:  # up to the end of the last content the template wrote: the final message's
            last = max((i for i, (_, is_content) in enumerate(pieces) if is_content), default=None)
            final = messages[-1]["content"]
            final = final.parts[-1] if isinstance(final, TextParts) and reads_parts(self._source(chat_template)) \
                else final
            if last is None or pieces[last][0] not in (final, final.strip()):
                raise InvalidRequest("continue_final_message: the chat template does not end the conversation "
                                     "with the final message's content")
            pieces = pieces[:last + 1]
            text = "".join(part for part, _ in pieces)
        spans, at = [], 0
        for part, is_content in pieces:
            if is_content and part:
                spans.append((at, at + len(part)))
            at += len(part)
        enc = self._tok.encode(text, add_special_tokens=False)
        forged = []
        for i, (t, (a, b)) in enumerate(zip(enc.ids, enc.offsets)):
            if t not in self.special_ids:
                continue
            touching = [(s, e) for s, e in spans if a < e and s < b]
            if not touching:
                continue
            if any(not (s <= a and b <= e) for s, e in touching):  # across a content's edge
                return self._encode_pieces(pieces)
            forged.append(i)
        if not forged:
            return enc.ids
        ids, prev = [], 0
        for i in forged:
            a, b = enc.offsets[i]
            ids += enc.ids[prev:i] + self._plain.encode(text[a:b], add_special_tokens=False).ids
            prev = i + 1
        return ids + enc.ids[prev:]

    def _check_no_special(self, field: str, value) -> None:
        if not value:
            return
        enc = self._tok.encode(json.dumps(value, ensure_ascii=False), add_special_tokens=False)
        found = next((t for t in enc.ids if t in self.special_ids), None)
        if found is not None:
            raise InvalidRequest(f"{field}: holds the text of the special token {self.id_to_token(found)!r}, which "
                                 "the chat template would write as that token")

    def _chat_pieces(self, messages: list[dict], text: str, add_generation_prompt: bool = True,
                     template_kwargs: dict | None = None, chat_template: str | None = None,
                     tools: list[dict] | None = None,
                     roles: tuple[str, ...] = ROLES) -> tuple[list[tuple[str, bool]] | None, str]:
        """The rendered `text` cut into (piece, is a message's content), or None when it is not the
        template's own text with the contents inserted; and the rendering with markers for contents."""
        import re
        import uuid

        nonce = uuid.uuid4().hex
        # A mark per content (per text part where it came as parts: a template may read them itself), with an em
        # space each side (whitespace no template writes itself): a template that trims contents trims these, and
        # so the real contents. (An empty content or part, an assistant's that only calls tools, is left as it is:
        # nothing to protect, and templates write it or not by whether it is empty.)
        texts: dict[str, str] = {}

        def mark(text: str, name: str) -> str:
            if not text:
                return text
            texts[f"\ue000{nonce}{name}\ue001"] = text
            return f"\u2003\ue000{nonce}{name}\ue001\u2003"

        parts = reads_parts(self._source(chat_template))
        marked = self.render_chat(
            [{**m, "content": TextParts([mark(p, f"{i}.{j}") for j, p in enumerate(m["content"].parts)])
              if parts and isinstance(m["content"], TextParts) else mark(m["content"], str(i))} if m["content"] else m
             for i, m in enumerate(messages)],
            add_generation_prompt, template_kwargs, chat_template, tools, roles)
        pattern = re.compile("(\u2003?)(" + "|".join(map(re.escape, texts)) + ")(\u2003?)") if texts else None
        pieces, at = [], 0
        for found in pattern.finditer(marked) if pattern else ():
            content = texts[found.group(2)]
            trimmed = not found.group(1) and not found.group(3)
            if found.group(1) != found.group(3):
                return None, marked  # trimmed on one side only: not a transformation this can follow
            pieces.append((marked[at:found.start()], False))
            pieces.append((content.strip() if trimmed else content, True))
            at = found.end()
        pieces.append((marked[at:], False))
        return (pieces if "".join(p for p, _ in pieces) == text else None), marked

    def _encode_pieces(self, pieces: list[tuple[str, bool]]) -> list[int]:
        ids = []
        for part, is_content in pieces:
            if part:
                ids += (self._plain if is_content else self._tok).encode(part, add_special_tokens=False).ids
        return ids
