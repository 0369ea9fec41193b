"""Requests as the engine sees them: sampling parameters, lifecycle state, and the events it emits.

Plain Python, no JAX. Bad input is a ValueError that names the field and the limit.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
import math
import re
import time

import numpy as np

from jaxcb.host.embedding import POOLING_MODES
from jaxcb.host.errors import ContextTooLong, InvalidRequest, shown
from jaxcb.host.structured import Constraint

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_REPEATED_PATTERN = 256  # repetition_detection's max_pattern_size (each token's check is at most ~this x min_count)
MAX_BAD_WORDS = 128  # bad_words' token sequences (vLLM's VLLM_MAX_NUM_BAD_WORDS), and the words given
MAX_BAD_WORD_TOKENS = 64  # tokens of one bad word (a word or a phrase; each step compares the output's end with it)
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # allowed_token_ids: a vocabulary's worth (Gemma 3's is 262,144)
MAX_LOGPROBS = 20
MAX_SAMPLES = 16
MAX_LOGIT_BIAS = 300  # token ids a request may bias (OpenAI's limit); the sampler's static width
LOGIT_BIAS_RANGE = 100.0  # |bias| at most (OpenAI's range: -100 bans a token, +100 all but forces it)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached (or the context limit)
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # failed inside the engine; other requests go on
    REPETITION = "repetition"  # the output's end repeats a pattern (SamplingParams.repetition_detection; vLLM's)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings. Every value becomes an array in the jitted step."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off (-1 too: vLLM's spelling, taken as 0)
    top_p: float = 1.0  # in (0, 1]
    min_p: float = 0.0  # in [0, 1)
    repetition_penalty: float = 1.0  # > 0; 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # any 64-bit integer (a negative one is taken modulo 2**63, as vLLM takes them all); -1: none, as vLLM reads it
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0  # top-n logprobs per generated token; 0 = none
    n: int = 1  # independent samples of the same prompt (they share its KV pages)
    structured: Constraint | None = None  # what the output must match (jaxcb.host.structured)
    speculative: bool = True  # False: never speculate for this request (when the server does)
    lora: str = ""  # the LoRA adapter to generate with (jaxcb.host.lora); "" = the base model
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits; a dict is taken too
    min_tokens: int = 0  # tokens before an end-of-sequence or stop token may be sampled and a stop string ends it
    include_stop_str_in_output: bool = False  # the stop string that ends the text ends it included
    skip_special_tokens: bool = True  # special tokens left out of the text (vLLM's); False: their text shown
    allowed_token_ids: tuple[int, ...] = ()  # the only tokens a sample may be (vLLM's); () = any
    # The prompt's own logprobs (vLLM's prompt_logprobs): each prompt token's logprob given the tokens
    # before it, with this many of the best alternatives (0: the token's alone); None = not computed.
    # max_tokens may then be 0: the prompt is scored and nothing is generated.
    prompt_logprobs: int | None = None
    # `structured` applies only after this token (a reasoning part's end, e.g. </think>: the model thinks
    # freely, then answers under the grammar, as vLLM does with a reasoning parser); None: from the start.
    structured_after: int | None = None
    # An embedding (jaxcb.host.embedding): the prompt's last hidden states pooled, "last" (its last token's)
    # or "mean" (over its tokens), carried by the final event; max_tokens must be 0. None: not an embedding.
    pooling: str | None = None
    # Words the output never completes (vLLM's bad_words): a word's last token is banned from the step that
    # would sample it after the rest of the word's tokens at the output's end (a one-token word: always). Each
    # word counts as its tokens at the start of a text and, where they differ, after a space (bad_word_ids: the
    # engine makes them from bad_words with the model's tokenizer; offline, either may be given).
    bad_words: tuple[str, ...] = ()
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's repetition_detection, (max_pattern_size, min_pattern_size, min_count): the request ends, finish
    # reason REPETITION, once (from min_tokens on) its output ends with a pattern of min..max tokens repeated
    # min_count times in a row (min_pattern_size 0: 1). None, or max_pattern_size 0: never.
    repetition_detection: tuple[int, int, int] | None = None
    # vLLM's thinking_token_budget: once the thinking (the tokens after the last start tag, the prompt's and the
    # output's, with no end tag after it) holds this many tokens, the end tag is the next token. thinking_tags:
    # the (start, end) tags' token ids (the server's reasoning parser's <think> and </think>). None: no budget.
    thinking_token_budget: int | None = None
    thinking_tags: tuple[int, int] | None = None

    def __post_init__(self):
        stop = self.stop or ()
        object.__setattr__(self, "stop", (stop,) if isinstance(stop, str) else tuple(stop))  # "END": one stop
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        check_allowed_count(len(self.allowed_token_ids or ()))
        words = self.bad_words or ()
        object.__setattr__(self, "bad_words", (words,) if isinstance(words, str) else tuple(words))
        check_bad_words(self.bad_words)
        if len(self.bad_word_ids or ()) > MAX_BAD_WORDS:
            raise InvalidRequest(f"bad_words: at most {MAX_BAD_WORDS} token sequences, got {len(self.bad_word_ids)}")
        object.__setattr__(self, "bad_word_ids", tuple(tuple(int(t) for t in w) for w in self.bad_word_ids or ()))
        if any(not w for w in self.bad_word_ids):
            raise InvalidRequest("bad_word_ids: each word must have at least one token")
        longest = max(map(len, self.bad_word_ids), default=0)
        if longest > MAX_BAD_WORD_TOKENS:
            raise InvalidRequest(f"bad_words: a word of {longest} tokens; the limit is {MAX_BAD_WORD_TOKENS} a word")
        if self.repetition_detection is not None:
            check_repetition_detection(*self.repetition_detection)
        if self.thinking_token_budget == -1:  # (vLLM's "unlimited")
            object.__setattr__(self, "thinking_token_budget", None)
        if self.thinking_token_budget is not None:
            _check_int("thinking_token_budget", self.thinking_token_budget, low=0)
            if self.thinking_tags is None:
                raise InvalidRequest("thinking_token_budget: this model has no thinking tags to count by (serve it "
                                     "with --reasoning-parser)")
        object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in (self.allowed_token_ids or ())))
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        if self.structured_after is not None:
            _check_int("structured_after", self.structured_after, low=0)
        if self.pooling is not None:
            if self.pooling not in POOLING_MODES:
                raise InvalidRequest(f"pooling: must be {' or '.join(map(repr, POOLING_MODES))}, got "
                                     f"{str(self.pooling)[:40]!r}")
            if self.max_tokens != 0:
                raise InvalidRequest(f"max_tokens: must be 0 for an embedding (pooling), got {self.max_tokens!r}")
            if self.n != 1:
                raise InvalidRequest(f"n: must be 1 for an embedding (pooling), got {self.n!r}")
        _check_int("max_tokens", self.max_tokens,
                   low=0 if self.prompt_logprobs is not None or self.pooling is not None else 1)
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        _check_finite("temperature", self.temperature, low=0.0)
        if self.top_k == -1 and not isinstance(self.top_k, bool):  # (vLLM's "off", which its clients send)
            object.__setattr__(self, "top_k", 0)
        _check_int("top_k", self.top_k, low=-1, high=2**31 - 1)
        _check_finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p: must be in (0, 1], got {self.top_p}")
        _check_finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:  # (1: only the most likely token, and its equals)
            raise InvalidRequest(f"min_p: must be in [0, 1], got {self.min_p}")
        _check_finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidRequest(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
        _check_finite("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_finite("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed == -1:  # vLLM's "no seed" (clients send it for a random one)
            object.__setattr__(self, "seed", None)
        if self.seed is not None:
            _check_int("seed", self.seed, low=-2**63, high=2**63 - 1)
            object.__setattr__(self, "seed", self.seed % 2**63)
        check_stop_counts(len(self.stop), len(self.stop_token_ids))
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequest(f"stop: each stop string must be 1..{MAX_STOP_STRING_CHARS} characters")
        _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        _check_int("n", self.n, low=1, high=MAX_SAMPLES)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InvalidRequest("include_stop_str_in_output: must be true or false, got "
                                 f"{self.include_stop_str_in_output!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise InvalidRequest(f"skip_special_tokens: must be true or false, got {self.skip_special_tokens!r}")
        if not isinstance(self.speculative, bool):
            raise InvalidRequest(f"speculative: must be true or false, got {self.speculative!r}")
        if not isinstance(self.lora, str) or len(self.lora) > 256:
            raise InvalidRequest("lora: must be an adapter name of at most 256 characters")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.structured is not None and not isinstance(self.structured, Constraint):
            raise InvalidRequest(f"structured: must be a Constraint, got {type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def held_ends(self, eos_ids, num_output: int) -> tuple[int, ...]:
        """The tokens a sample with `num_output` tokens so far must not sample next: its stop tokens and
        the model's end-of-sequence tokens (unless ignore_eos) while it has fewer than min_tokens."""
        if num_output >= self.min_tokens:
            return ()
        return self.stop_token_ids + (() if self.ignore_eos else tuple(eos_ids))


# The request limits that every API checks before it copies or tokenizes anything (the engine checks
# them again): one function each, so the limit and its message are written once.

def not_a_number(name: str):
    """json.loads' parse_constant: Python's json takes NaN and Infinity; JSON does not."""
    raise ValueError(f"{name} is not a JSON number")


def jsonl_lines(path: str):
    """(line number, the line's JSON value) of each non-blank line of a JSONL file: lines end at newlines only (a
    JSON string may hold U+2028), a byte-order mark is allowed, each line is decoded apart; a line of bad bytes or
    bad JSON is a ValueError naming `path:line`, as is a file that cannot be opened."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                if line.strip():
                    yield lineno, json.loads(line)
            except ValueError as e:  # (UnicodeDecodeError and json's errors are ValueErrors)
                raise ValueError(f"{path}:{lineno}: {e}") from None


def read_json(text: str | bytes, field: str, path: str = ""):
    """The value of JSON text a request carries (an HTTP body, gRPC's template kwargs), read as JSON reads:
    UTF-8 strictly (json.loads would pass a lone surrogate's bytes), no NaN or Infinity, nesting within
    Python's recursion limit, every string text (check_unicode, its fields named from `path`). Raises
    InvalidRequest naming `field`."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        value = json.loads(text, parse_constant=not_a_number)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, NaN, an integer past Python's digit limit
        raise InvalidRequest(f"{field}: not valid JSON ({str(e)[:200]})") from None
    except RecursionError:
        raise InvalidRequest(f"{field}: JSON nested too deeply") from None
    if "\\u" in text and _ESCAPED_SURROGATE.search(text):  # (an escaped surrogate: paired, or not)
        check_unicode(value, path)
    return value


_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(obj, path: str = "") -> None:
    """Every string of a request parsed from JSON (keys too) is text: JSON's \\ud800-\\udfff escapes
    unpaired give Python strings that no tokenizer (nor UTF-8) takes. Raises InvalidRequest naming the
    first field that holds one."""
    found = _lone_surrogate(obj, path)
    if found is not None:
        raise InvalidRequest(f"{found}: holds a lone surrogate (a \\ud800-\\udfff escape without its pair): "
                             "not text")


def _lone_surrogate(obj, path: str) -> str | None:
    if isinstance(obj, str):
        return path if _SURROGATE.search(obj) else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        if isinstance(key, str) and _SURROGATE.search(key):
            return where.encode("ascii", "backslashreplace").decode()
        found = _lone_surrogate(value, where)
        if found is not None:
            return found
    return None


def check_stop_counts(stop: int, stop_token_ids: int) -> None:
    """The number of stop strings and stop token ids."""
    if stop > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {stop}")
    if stop_token_ids > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, got {stop_token_ids}")


def check_logit_bias_count(entries: int) -> None:
    if entries > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias: at most {MAX_LOGIT_BIAS} token ids, got {entries}")


def logit_bias_from_json(bias) -> list[tuple[int, object]]:
    """OpenAI's logit_bias as JSON has it, {"token id": bias}, as (id, bias) pairs for SamplingParams
    (which checks the values); the HTTP API and `jaxcb generate --input` lines take it so."""
    if bias is None:
        return []
    if not isinstance(bias, dict):
        raise InvalidRequest("logit_bias: must be an object mapping token ids to numbers")
    check_logit_bias_count(len(bias))
    pairs = []
    for key, value in bias.items():
        if not isinstance(key, str) or not re.fullmatch(r"[0-9]{1,10}", key):
            raise InvalidRequest(f"logit_bias: {str(key)[:32]!r} is not a token id")
        pairs.append((int(key), value))
    return pairs


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs, sorted by id, from pairs or a {token id: bias} dict: each id once, each
    bias a finite number in [-100, 100] (ids against the vocabulary: check_tokens)."""
    if isinstance(bias, dict):
        bias = bias.items()
    try:
        pairs = list(bias or ())
    except TypeError:
        raise InvalidRequest(f"logit_bias: must map token ids to numbers, got {type(bias).__name__}") from None
    check_logit_bias_count(len(pairs))
    out = {}
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise InvalidRequest("logit_bias: must map token ids to numbers")
        token, value = pair
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < 2**31:
            raise InvalidRequest(f"logit_bias: {token!r} is not a token id")
        if int(token) in out:
            raise InvalidRequest(f"logit_bias: token id {int(token)} is given twice")
        _check_finite(f"logit_bias[{int(token)}]", value, low=-LOGIT_BIAS_RANGE, high=LOGIT_BIAS_RANGE)
        out[int(token)] = float(value)
    return tuple(sorted(out.items()))


def check_priority(priority) -> None:
    if isinstance(priority, bool) or not isinstance(priority, int) or not -2**31 <= priority < 2**31:
        raise InvalidRequest(f"priority: must be an integer in [-2**31, 2**31), got {priority!r}")


def check_prompt_length(field: str, tokens: int, max_context: int) -> None:
    """A prompt of `tokens` tokens under a context of `max_context`: at least one token must be left
    to generate."""
    if not tokens:
        raise InvalidRequest(f"{field}: must not be empty")
    if tokens >= max_context:
        raise ContextTooLong(f"{field}: {tokens} tokens; the limit is {max_context - 1} "
                             f"(context {max_context} tokens, at least one generated)", max_context)


def check_tokens(prompt_ids, params: SamplingParams, max_context: int, vocab_size: int) -> None:
    """A request's token ids against the context and the vocabulary: sizes first (nothing is scanned
    past a limit), then every id."""
    check_prompt_length("prompt", len(prompt_ids), max_context)
    if len(prompt_ids) + params.max_tokens > max_context:
        raise ContextTooLong(f"max_tokens: prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds the "
                             f"context limit of {max_context} tokens", max_context)
    bad = outside_vocabulary(prompt_ids, vocab_size)
    if bad is not None:
        raise InvalidRequest(f"prompt_token_ids: token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    check_param_ids(params, vocab_size)


def outside_vocabulary(ids, vocab_size: int):
    """The first of `ids` that is not a token id of the vocabulary (None: every one is)."""
    return next((t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))
                 or not 0 <= int(t) < vocab_size), None)


def check_allowed_count(n: int) -> None:
    """The number of allowed_token_ids."""
    if n > MAX_ALLOWED_TOKEN_IDS:
        raise InvalidRequest(f"allowed_token_ids: at most {MAX_ALLOWED_TOKEN_IDS}, got {n}")


def check_repetition_detection(max_pattern_size, min_pattern_size, min_count) -> None:
    """repetition_detection's three numbers, as vLLM checks them (and max_pattern_size at most
    MAX_REPEATED_PATTERN, min_count at most MAX_REPEATED_PATTERN)."""
    for name, value in (("max_pattern_size", max_pattern_size), ("min_pattern_size", min_pattern_size),
                        ("min_count", min_count)):
        _check_int(f"repetition_detection.{name}", value, low=0, high=MAX_REPEATED_PATTERN)
    if min_pattern_size > max_pattern_size:
        raise InvalidRequest(f"repetition_detection.min_pattern_size: must be <= max_pattern_size "
                             f"({max_pattern_size}), got {min_pattern_size}")
    if max_pattern_size > 0 and min_count < 2:
        raise InvalidRequest(f"repetition_detection.min_count: must be >= 2 with a max_pattern_size, got {min_count}")


def repeats(tokens, detection) -> bool:
    """Whether `tokens` end with a pattern of min_pattern_size..max_pattern_size tokens repeated min_count
    times in a row (vLLM's check_sequence_repetition; `detection` as SamplingParams.repetition_detection)."""
    most, least, count = detection
    if most <= 0 or count < 2:
        return False
    for size in range(max(1, least), most + 1):
        if size * count > len(tokens):
            return False
        tail = tokens[-size:]
        if all(tokens[-size * (m + 1):len(tokens) - size * m] == tail for m in range(1, count)):
            return True
    return False


def check_bad_words(words) -> None:
    """bad_words as a request gives them: at most MAX_BAD_WORDS strings, each 1..MAX_STOP_STRING_CHARS
    characters and not only spaces."""
    if len(words) > MAX_BAD_WORDS:
        raise InvalidRequest(f"bad_words: at most {MAX_BAD_WORDS} words, got {len(words)}")
    for w in words:
        if not isinstance(w, str) or not w.strip() or len(w) > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(f"bad_words: each word must be a string of 1..{MAX_STOP_STRING_CHARS} characters, "
                                 f"not only spaces, got {shown(w)}")


def resolve_bad_words(params: SamplingParams, tokenizer) -> SamplingParams:
    """`params` with bad_word_ids made from bad_words, as vLLM makes them: each word (its leading spaces
    dropped) encoded without special tokens, and again after a space where that gives other tokens of the
    same count (a tokenizer whose words carry their space); at most MAX_BAD_WORDS sequences in all."""
    if not params.bad_words or params.bad_word_ids:
        return params
    if tokenizer is None:
        raise InvalidRequest("bad_words: this model has no tokenizer to spell them with")
    sequences = []
    for word in params.bad_words:
        plain = tokenizer.encode(word.lstrip(), add_bos=False)
        if not plain:
            raise InvalidRequest(f"bad_words: {shown(word)} has no tokens")
        if len(plain) > MAX_BAD_WORD_TOKENS:  # (refused at the first such word: the others are not spelt)
            raise InvalidRequest(f"bad_words: a word of {len(plain)} tokens; the limit is {MAX_BAD_WORD_TOKENS} a word")
        sequences.append(tuple(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_bos=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(tuple(spaced))
    if len(sequences) > MAX_BAD_WORDS:
        raise InvalidRequest(f"bad_words: {len(sequences)} token sequences (each word's, and again after a space); "
                             f"the limit is {MAX_BAD_WORDS}")
    return dataclasses.replace(params, bad_word_ids=tuple(sequences))


def banned_tokens(bad_word_ids, output_ids) -> list[int]:
    """The tokens that would complete a bad word after `output_ids` (vLLM's: a word's last token where the
    output ends with the rest of the word; a one-token word's always)."""
    banned = []
    for word in bad_word_ids:
        k = len(word) - 1
        if k == 0 or (k <= len(output_ids) and output_ids[-1] == word[-2] and tuple(output_ids[-k:]) == word[:-1]):
            banned.append(word[-1])
    return banned


def check_param_ids(params: SamplingParams, vocab_size: int) -> None:
    """The token ids a request's settings name (stop_token_ids, allowed_token_ids, logit_bias,
    structured_after, bad_word_ids) against the vocabulary."""
    if params.structured_after is not None and params.structured_after >= vocab_size:
        raise InvalidRequest(f"structured_after: token id {params.structured_after} is outside the vocabulary "
                             f"[0, {vocab_size})")
    for name in ("stop_token_ids", "allowed_token_ids"):
        bad = next((t for t in getattr(params, name) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for t, _ in params.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for w in params.bad_word_ids for t in w if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"bad_words: token id {bad} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for t in params.thinking_tags or () if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"thinking_tags: token id {bad} is outside the vocabulary [0, {vocab_size})")


def _check_int(name, value, low=None, high=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name}: must be an integer, got {value!r}")
    if low is not None and value < low:
        raise InvalidRequest(f"{name}: must be >= {low}, got {value}")
    if high is not None and value > high:
        raise InvalidRequest(f"{name}: must be <= {high}, got {value}")


def _check_finite(name, value, low=None, high=None):
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**1000:  # math.isfinite overflows
        raise InvalidRequest(f"{name}: must be a finite number, got an integer too large")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(f"{name}: must be a finite number, got {value!r}")
    if low is not None and value < low:
        raise InvalidRequest(f"{name}: must be >= {low}, got {value}")
    if high is not None and value > high:
        raise InvalidRequest(f"{name}: must be <= {high}, got {value}")


_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request and its progress. Owned by the engine thread."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    priority: int = 0  # larger runs earlier under the priority policy
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    cache_salt: str = ""  # requests share cached prefixes only with requests of the same salt
    client: str = ""  # whose request (a bearer token, a gateway's fairness id): the fair policy's flows

    status: Status = Status.WAITING
    output_ids: list[int] = dataclasses.field(default_factory=list)
    page_ids: list[int] = dataclasses.field(default_factory=list)  # the page table
    window_page_ids: list[int] = dataclasses.field(default_factory=list)  # sliding layers' (jaxcb.host.window)
    num_computed: int = 0  # tokens whose K/V are in the cache (or being written by a step in flight)
    num_pending: int = 0  # tokens sampled by a step in flight, not yet in output_ids
    pending_src: tuple[int, int] | None = None  # (step, row) of the newest pending token's output
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)  # chained hashes of full pages
    num_registered: int = 0  # leading pages offered to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache at the first admission
    sample_index: int = 0  # n > 1: which sample this is
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0  # times it lost its pages (out of pages, or a round-robin switch): the epoch
    queued_time: float | None = None  # when it last joined the waiting queue (round-robin order)
    admitted_output: int = 0  # its generated tokens when it was last admitted (round-robin quantum)
    lost_tokens: int = 0  # tokens it had computed when it last lost its pages (recompute accounting)
    lost_by_switch: bool = False  # ... by a round-robin switch rather than a preemption
    seq_no: int = dataclasses.field(default_factory=lambda: next(_ids))  # FCFS tie-break
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # when it first got a batch slot (queue time ends)
    error: str | None = None
    matcher: object = None  # structured output: this sample's grammar state (jaxcb.host.structured)
    grammar_after: int | None = None  # the matcher waits for this token (params.structured_after) to start
    spec: object = None  # speculative decoding: its acceptance record (jaxcb.host.speculative.SpecState)
    lora: object = None  # its LoRA adapter's registry entry (jaxcb.host.lora.Entry), None the base model
    lora_slot: int = -1  # the device slot its adapter sits in while it runs
    # params.prompt_logprobs: entry p is prompt token p + 1's (logprob, rank, ((id, logprob), ...top-n)),
    # from the logits at position p (a prompt position is scored once, whatever recomputes it)
    prompt_logprobs: list = dataclasses.field(default_factory=list)
    # params.pooling: what the steps so far gave of its embedding (jaxcb.host.embedding.take_pooled), and the
    # prompt positions they covered; both start again when it loses its pages
    pooled: np.ndarray | None = None
    pooled_upto: int = 0
    thinking: list | None = None  # params.thinking_token_budget: [thinking, tokens thought, output tokens read]

    def __post_init__(self):
        if not self.request_id:
            self.request_id = f"req-{self.seq_no}"

    @property
    def key(self) -> tuple[str, int]:
        """Unique among live requests: (request id, sample index)."""
        return (self.request_id, self.sample_index)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def _thought(self) -> list:
        """Its thinking so far (params.thinking_token_budget), read from the tokens not read yet: whether the
        sequence is inside a start tag with no end tag after it, and how many tokens follow that start tag."""
        start, end = self.params.thinking_tags
        if self.thinking is None:
            last_start = max((i for i, t in enumerate(self.prompt_ids) if t == start), default=-1)
            last_end = max((i for i, t in enumerate(self.prompt_ids) if t == end), default=-1)
            inside = last_start > last_end
            self.thinking = [inside, len(self.prompt_ids) - last_start - 1 if inside else 0, 0]
        state = self.thinking
        for t in self.output_ids[state[2]:]:
            if t == end:
                state[0], state[1] = False, 0
            elif t == start:
                state[0], state[1] = True, 0
            elif state[0]:
                state[1] += 1
        state[2] = len(self.output_ids)
        return state

    def thinking_end(self) -> int | None:
        """The token its thinking_token_budget makes its next one (the end tag, the budget spent), else None."""
        inside, count, _ = self._thought()
        return self.params.thinking_tags[1] if inside and count >= self.params.thinking_token_budget else None

    def thinking_due(self) -> bool:
        """Whether its newest token, still on the device, may decide what the budget forces next (the step before
        must finish first): inside the thinking with the budget spent by then, or outside with a budget of 0."""
        inside, count, _ = self._thought()
        budget = self.params.thinking_token_budget
        return count + self.num_pending >= budget if inside else budget == 0

    def token_slice(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end) without building prompt + output whole."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence as the scheduler sees it: known ones plus those still in flight."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host has (prompt and fetched output)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_in_flight(self) -> bool:
        """Its final token (max_tokens) is being sampled by a step in flight: nothing left to run."""
        return self.num_pending > 0 and self.num_tokens >= self.max_total_tokens

    def positions_to_score(self, start: int, end: int) -> range:
        """The positions in [start, end) whose logits give a prompt token's logprob this request still
        needs (params.prompt_logprobs): position p scores prompt token p + 1."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs)), min(end, len(self.prompt_ids) - 1))

    @property
    def scoring(self) -> bool:
        """It still needs logprobs of its prompt: a position is computed with its logits, or its entry
        taken from a cached page that kept it (jaxcb.host.prefix_cache.PageScores)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens


@dataclasses.dataclass(slots=True)  # one per token: cheap to make (a frozen dataclass costs 3x)
class TokenEvent:
    """What the engine tells a caller after each step that touched a request."""

    request_id: str
    token_ids: tuple[int, ...]  # new tokens of this step (may be empty on the final event)
    text: str  # the text delta (stop strings and what follows are never included)
    finished: bool
    finish_reason: FinishReason | None = None
    logprobs: tuple | None = None  # per new token: (logprob, ((token_id, logprob), ...top-n))
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    queue_s: float | None = None  # on the first event: seconds from arrival to first scheduling
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)
    index: int = 0  # which sample of an n > 1 request
    # on the first event of a request with params.prompt_logprobs: per prompt token after the first,
    # (logprob, rank, ((token_id, logprob), ...top-n)) given the tokens before it
    prompt_logprobs: tuple | None = None
    stop_reason: int | str | None = None  # on a final event: the stop token id or stop string that ended it
    request_error: bool = False  # an ERROR that is the request's own (its constraint failed), not the step's
    embedding: np.ndarray | None = None  # on the final event of a pooling request: its pooled vector, f32 [E]

    def then(self, later: "TokenEvent") -> "TokenEvent":
        """This event and the `later` one of the same sample as one (a stream that sends several tokens a
        chunk): their tokens, text and logprobs joined; the later's counts and finish."""
        logprobs = (self.logprobs or ()) + (later.logprobs or ()) if self.logprobs or later.logprobs else None
        return dataclasses.replace(later, token_ids=self.token_ids + later.token_ids, text=self.text + later.text,
                                   logprobs=logprobs, queue_s=self.queue_s if self.queue_s is not None else later.queue_s,
                                   prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None
                                   else later.prompt_logprobs)
