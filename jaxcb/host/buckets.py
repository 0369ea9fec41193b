"""Static-shape buckets: which shape a step is padded to, and the list of shapes warm-up compiles.

XLA compiles one program per input shape. A step is one packed batch of tokens (jaxcb.host.batch), and only
its token count is a bucket: T from `tokens`, a sorted tuple looked up with bisect. Everything else
follows from T (sequence slots M = min(T, max batch), page table width N = the context limit's pages),
so the shapes warm-up compiles are exactly the token buckets. By default the token buckets are the
decode batch sizes (steps of decode rows only) and max batch + each prefill bucket (a chunk with every
decode row beside it).

Plain Python, no JAX.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging

from jaxcb.host.batch import StepShape
from jaxcb.host.errors import InvalidConfig

log = logging.getLogger("jaxcb.host.buckets")


@dataclasses.dataclass(frozen=True)
class Buckets:
    decode_batch: tuple[int, ...]  # B for decode steps; last = max running requests
    pages_per_seq: tuple[int, ...]  # N; last = max pages one sequence can hold
    prefill_tokens: tuple[int, ...]  # chunk sizes; last = largest chunk (prompt tokens per step)
    tokens: tuple[int, ...] = ()  # T of a packed step; () = decode_batch + (max batch + each prefill bucket)

    def __post_init__(self):
        if not self.tokens:
            b = tuple(int(v) for v in self.decode_batch)
            derived = set(b) | {b[-1] + int(t) for t in self.prefill_tokens} if b else set()
            object.__setattr__(self, "tokens", tuple(sorted(derived)))
        for name in ("decode_batch", "pages_per_seq", "prefill_tokens", "tokens"):
            values = tuple(int(v) for v in getattr(self, name))
            object.__setattr__(self, name, values)
            if not values:
                raise InvalidConfig(f"buckets.{name}: must not be empty")
            if any(v < 1 for v in values):
                raise InvalidConfig(f"buckets.{name}: every bucket must be >= 1, got {list(values)}")
            if list(values) != sorted(set(values)):
                raise InvalidConfig(f"buckets.{name}: must be strictly increasing, got {list(values)}")

    @property
    def max_batch(self) -> int:
        return self.decode_batch[-1]

    @property
    def max_pages_per_seq(self) -> int:
        return self.pages_per_seq[-1]

    @property
    def max_prefill_tokens(self) -> int:
        return self.prefill_tokens[-1]

    def validate(self, *, max_batch: int, max_pages_per_seq: int, max_prefill_tokens: int,
                 step_prefill_tokens: int | None = None) -> None:
        """The largest bucket of each list must be exactly the configured maximum; the largest token
        bucket must hold a full step (every decode row and the prompt-token budget)."""
        for name, largest, want in (
            ("decode_batch", self.max_batch, max_batch),
            ("pages_per_seq", self.max_pages_per_seq, max_pages_per_seq),
            ("prefill_tokens", self.max_prefill_tokens, max_prefill_tokens),
        ):
            if largest != want:
                raise InvalidConfig(f"buckets.{name}: the largest bucket is {largest}, but the configured maximum is {want}")
        step_prefill = max_prefill_tokens if step_prefill_tokens is None else step_prefill_tokens
        if self.max_tokens < max_batch + step_prefill:
            raise InvalidConfig(f"buckets.tokens: the largest bucket is {self.max_tokens}, but a step can hold "
                             f"{max_batch + step_prefill} tokens (max batch {max_batch} + prompt tokens per step "
                             f"{step_prefill})")

    @property
    def max_tokens(self) -> int:
        return self.tokens[-1]

    def step_shape(self, num_tokens: int, page_size: int, max_context: int, extra_rows: int = 0) -> StepShape:
        """The shape a step of `num_tokens` live tokens is padded to. `extra_rows`: sample positions a
        step may need besides each sequence's last (speculative decoding; at most one per token but
        the sequence's first)."""
        t = bucket_for(self.tokens, max(1, num_tokens), "step tokens")
        return StepShape(tokens=t, seqs=min(t, self.max_batch), pages_per_seq=-(-max_context // page_size),
                         history=max_context, extra_rows=min(t - 1, extra_rows))

    def shapes(self, page_size: int, max_context: int, extra_rows: int = 0, verify_tokens: int = 0) -> list[StepShape]:
        """Every shape a step can take: what warm-up compiles (one program per token bucket). With
        speculative decoding (`extra_rows` > 0), also a verifying program, sampling at the proposals'
        positions too, for each bucket up to the one that holds `verify_tokens` (a step in which every
        speculating request brings its proposals): a step without proposals keeps the plain program,
        which pays nothing for them."""
        shapes = [self.step_shape(t, page_size, max_context) for t in self.tokens]
        if extra_rows and verify_tokens:
            top = self.verify_limit(verify_tokens)
            shapes += [self.step_shape(t, page_size, max_context, extra_rows) for t in self.tokens if 1 < t <= top]
        return shapes

    def verify_limit(self, verify_tokens: int) -> int:
        """The largest bucket a verifying step may take: the one that holds `verify_tokens`."""
        return bucket_for(self.tokens, min(max(1, verify_tokens), self.max_tokens), "verify tokens")


def bucket_for(buckets: tuple[int, ...], value: int, field: str) -> int:
    i = bisect.bisect_left(buckets, value)
    if i == len(buckets):
        raise ValueError(f"{field}: {value} is above the largest bucket {buckets[-1]}")
    return buckets[i]


class LengthLog:
    """Traffic's lengths for `jaxcb buckets` to choose buckets from (`--record-lengths PATH`): one JSON
    line {"prompt": tokens, "context": tokens} per finished request, appended to `path`. A write that
    fails (a full disk) stops the recording, said once: it never ends a request."""

    def __init__(self, path: str):
        self.file = open(path, "a", encoding="utf-8")

    def record(self, prompt_tokens: int, context_tokens: int) -> None:
        if self.file is None:
            return
        try:
            self.file.write(f'{{"prompt": {prompt_tokens}, "context": {context_tokens}}}\n')
            self.file.flush()
        except OSError as e:
            log.warning("--record-lengths: %s; no longer recording", e)
            self.file = None
