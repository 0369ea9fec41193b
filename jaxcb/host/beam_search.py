"""Beam search (vLLM's `use_beam_search`, `LLM.beam_search`): the W most likely continuations of a prompt
under a length penalty, found a token at a time. Plain Python, no JAX.

The search is a loop over ordinary one-token requests, as vLLM runs it: each round, every live beam
(the prompt and the beam's tokens) is a request for one token with its 2W most likely next tokens and
their logprobs (from the raw logits); the candidates are every live beam extended by each of those, the
W with the highest summed logprob stay live, and a candidate that ends in an end-of-sequence or stop
token is finished there. After max_tokens rounds (or when no beam is live) the finished and the live
beams are ranked by summed logprob / length ** length_penalty (the length counts the prompt, and not the
end token: vLLM's and transformers' score) and the best W are the answer. The prefix cache keeps each
beam's full pages, so a round recomputes at most its last partial page per beam.
"""

from __future__ import annotations

import dataclasses

from jaxcb.host.errors import InvalidRequest
from jaxcb.host.request import SamplingParams

MAX_WIDTH = 10  # 2W candidates a beam: the most logprobs a request may ask for (20)


@dataclasses.dataclass
class Beam:
    tokens: list[int]  # generated, after the prompt (with its end token when include_stop is asked for)
    logprob: float  # the sum of its tokens' logprobs (the end token's included)
    finish_reason: str | None = None  # "stop" (an end or stop token) or "length"
    stop_token: int | None = None  # the stop token that ended it (vLLM's stop_reason), not for EOS
    ended_by_token: bool = False  # the last scored token is an end or stop token (not counted in the length)


class BeamSearch:
    """One prompt's search. Each round: `prompts()` gives the live beams' token lists to score, and
    `advance()` takes, for each, its 2W most likely next tokens [(token, logprob), ...]."""

    def __init__(self, prompt_ids: list[int], width: int, max_tokens: int, eos_ids=(), *, ignore_eos: bool = False,
                 stop_token_ids=(), length_penalty: float = 1.0, include_stop: bool = False,
                 max_context: int | None = None):
        if not 1 <= width <= MAX_WIDTH:
            raise InvalidRequest(f"n: the beam width must be between 1 and {MAX_WIDTH} with beam search, got {width}")
        self.prompt = list(prompt_ids)
        self.width, self.max_tokens = width, max_tokens
        self.ends = frozenset(stop_token_ids) | (frozenset() if ignore_eos else frozenset(eos_ids))
        self.stop_ids = frozenset(stop_token_ids)
        self.length_penalty = length_penalty
        self.include_stop = include_stop
        self.max_context = max_context
        self.live = [Beam([], 0.0)]
        self.finished: list[Beam] = []
        self.rounds = 0

    @property
    def candidates_per_beam(self) -> int:
        return 2 * self.width

    def round_params(self, lora: str = "") -> SamplingParams:
        """Each round's request for a live beam: one token, with its 2W most likely next tokens."""
        return SamplingParams(max_tokens=1, logprobs=self.candidates_per_beam, ignore_eos=True, lora=lora)

    def checked_as(self, lora: str = "") -> SamplingParams:
        """The request the whole search is checked as before anything runs (Engine.validate): its prompt
        and max_tokens against the context, as any request's; each round's request is one token."""
        return dataclasses.replace(self.round_params(lora), max_tokens=max(1, self.max_tokens))

    def shown(self, beam: Beam) -> list[int]:
        """The tokens of a beam's text: its end token left out even where include_stop keeps it in its ids."""
        return beam.tokens[:-1] if beam.ended_by_token and self.include_stop else beam.tokens

    @property
    def done(self) -> bool:
        return not self.live

    def prompts(self) -> list[list[int]]:
        return [self.prompt + b.tokens for b in self.live]

    def advance(self, tops: list[list[tuple[int, float]]]) -> None:
        """One round's scores: tops[i] for live beam i."""
        assert len(tops) == len(self.live), "one list of candidates per live beam"
        extended = []
        for beam, top in zip(self.live, tops):
            for token, logprob in top:
                total = beam.logprob + logprob
                if token in self.ends:
                    self.finished.append(Beam(beam.tokens + [token] if self.include_stop else list(beam.tokens), total,
                                              "stop", token if token in self.stop_ids else None, True))
                else:
                    extended.append((total, beam, token))
        extended.sort(key=lambda c: -c[0])  # (stable: a beam's earlier, likelier candidates first on ties)
        self.live = [Beam(beam.tokens + [token], total) for total, beam, token in extended[:self.width]]
        self.rounds += 1
        full = self.max_context is not None and len(self.prompt) + self.rounds + 1 > self.max_context
        if self.rounds >= self.max_tokens or full:
            for b in self.live:
                b.finish_reason = "length"
            self.finished += self.live
            self.live = []

    def score(self, beam: Beam) -> float:
        length = len(self.prompt) + len(beam.tokens) - (1 if beam.ended_by_token and self.include_stop else 0)
        return beam.logprob / (max(length, 1) ** self.length_penalty)

    def best(self) -> list[Beam]:
        """The answer: the `width` best beams, best first."""
        assert self.done, "the search has not finished"
        return sorted(self.finished, key=self.score, reverse=True)[:self.width]
