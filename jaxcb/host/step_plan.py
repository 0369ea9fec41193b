"""What the scheduler hands on: a step's plan (SchedulerOutput of Chunks) to the engine, which packs it
(jaxcb.host.batch.pack_chunks), and the tokens a finished step gave each request (Sampled) back.

Plain Python, no JAX.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from jaxcb.host.request import FinishReason, Request, Status


class Sampled(NamedTuple):
    """A token a step sampled for a request (Scheduler.on_step_done): its row in the step's output, the
    request it was appended to, the token (-1: none, a prompt only scored: max_tokens 0), and how the
    request ends with it (None: it goes on)."""

    row: int
    request: Request
    token: int
    finish: FinishReason | None


def live_chunks(chunks: list["Chunk"], epochs: list[int] | None):
    """(row, chunk) of a launched step's chunks whose request still runs as it did at the launch (`epochs`: the
    requests' preemption counts then; None: whatever the count): a chunk whose request ended or was preempted
    since is void."""
    for row, c in enumerate(chunks):
        r = c.request
        if r.status is Status.RUNNING and (epochs is None or r.num_preemptions == epochs[row]):
            yield row, c


@dataclasses.dataclass(slots=True)
class Chunk:
    """Tokens `request.all_ids[start:start + num_tokens]` run this step; when speculating, the last
    len(draft) of them are the proposals (jaxcb.host.speculative), known to nobody else."""

    request: Request
    start: int
    num_tokens: int
    draft: tuple[int, ...] = ()
    samples: bool = dataclasses.field(init=False)  # it reaches the newest token: it yields the next one
    extra_row: int = -1  # speculating: the step's output row of the first proposal's position
    # prompt logprobs: the step's output rows of the positions it scores, from position score_first on
    score_rows: tuple[int, ...] = ()
    score_first: int = 0

    def __post_init__(self):
        # Fixed when scheduled: by the time the step's tokens come back the request may have grown.
        self.samples = self.start + self.num_tokens - len(self.draft) == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        """One known token (and maybe proposals after it): a decode row, not a prompt chunk."""
        return self.num_tokens - len(self.draft) == 1

    @property
    def attention_pairs(self) -> int:
        """(query, key) pairs its causal attention computes: each token sees the context before it."""
        return self.num_tokens * self.start + self.num_tokens * (self.num_tokens + 1) // 2


@dataclasses.dataclass
class SchedulerOutput:
    decode: list[Chunk]  # one token each, batched in one decode step
    prefill: list[Chunk]  # more than one token each, one prefill step each
    preempted: list[Request]  # lost their pages this step; back in the waiting queue
    num_static_rows: int = 0  # static mode: rows the batch occupies, finished ones included
    speculative: list[Chunk] = dataclasses.field(default_factory=list)  # decode rows with proposals

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill and not self.speculative

    @property
    def chunks(self) -> list[Chunk]:
        """In the packed step's order: single tokens first (jaxcb.host.batch), then multi-token chunks."""
        return self.decode + self.speculative + self.prefill
