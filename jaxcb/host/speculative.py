"""Speculative decoding, the host side: what to propose, how much, and what the step's tokens accept.

A decoding request that speculates brings its newest token and k proposed tokens as one chunk of k+1
tokens to the packed step (jaxcb.host.batch): the step samples at every one of those positions, each
with the key of its own output position (seed, counter), exactly as it would sample them one step at a
time. The host then walks the positions: the token sampled at position j is emitted, and if it equals
the proposal j the next position saw the right context, so its token is emitted too, and so on; the
first disagreement ends the walk (its sampled token is still right: it followed the right context). So
every emitted token is the token non-speculative decoding would have produced, greedy or sampled with
the same seed, and the number accepted varies per row without changing any shape.

With a one-hot proposal this walk *is* rejection sampling: the proposal d is accepted with probability
p(d) (the sampled token equals d), and on rejection the sampled token follows p restricted to tokens
other than d, renormalised, which is the residual distribution. A draft model with probabilities of its
own would need the general rule (accept with min(1, p/q)); only the n-gram proposer exists so far.

Proposers: `ngram` (prompt lookup): the longest suffix of the sequence, `min_n`..`max_n` tokens, that
occurred before in its prompt or output proposes the tokens that followed its latest occurrence.

Backing off: each request keeps a moving average of the share of its proposed tokens accepted; the
step keeps a proposal's tokens only while they are expected to raise the step's output tokens per
second, by the step times measured per token bucket (Proposer.keep), and a request whose proposals
are rarely accepted proposes only every `probe_every` steps. Speculation runs only while at most
`max_batch` requests are running.

Plain Python and numpy, no JAX.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from jaxcb.host.errors import InvalidConfig

METHODS = ("ngram",)  # "draft" (a smaller model's proposals) is not implemented yet


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """`[speculative]` in the engine config (flags --speculative, --num-speculative-tokens)."""

    method: str = ""  # "" = off; "ngram"
    num_tokens: int = 4  # k: tokens proposed per speculating step, at most
    min_n: int = 2  # n-gram: the shortest suffix looked up
    max_n: int = 4  # n-gram: the longest
    max_batch: int = 8  # speculate only while at most this many requests run
    probe_every: int = 8  # a request whose proposals are rarely accepted tries again every this many steps
    adaptive: bool = True  # keep only the proposals that pay by the measured step times; False: keep all

    def __post_init__(self):
        if self.method and self.method not in METHODS:
            extra = " (a draft model's proposals are not implemented yet)" if self.method == "draft" else ""
            raise InvalidConfig(f"speculative.method: {self.method!r} is not one of {METHODS}{extra}")
        for name, low in (("num_tokens", 1), ("min_n", 1), ("max_n", 1), ("max_batch", 1), ("probe_every", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InvalidConfig(f"speculative.{name}: must be an integer >= {low}, got {v!r}")
        if self.max_n < self.min_n:
            raise InvalidConfig(f"speculative.max_n: {self.max_n} is below min_n {self.min_n}")
        if self.num_tokens > 32:
            raise InvalidConfig(f"speculative.num_tokens: at most 32, got {self.num_tokens}")

    @property
    def enabled(self) -> bool:
        return bool(self.method)

    @property
    def extra_rows(self) -> int:
        """Sample positions a step may need beyond one per sequence: k for each speculating row."""
        return self.num_tokens * self.max_batch if self.enabled else 0


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
    (min_n..max_n tokens long); empty when no suffix of min_n tokens occurred before."""
    n_total = tokens.shape[0]
    for n in range(min(max_n, n_total - 1), min_n - 1, -1):
        suffix = tokens[n_total - n:]
        # Windows starting at 0 .. n_total - n - 1: every occurrence that ends before the suffix's end.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:n_total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # what followed the latest occurrence
            return tokens[start:start + k]
    return tokens[:0]


@dataclasses.dataclass(slots=True)
class SpecState:
    """A request's speculation record (Request.spec)."""

    rate: float  # moving average of the share of its proposed tokens accepted
    steps_since: int = 0  # decode steps since it last speculated (probing while backed off)
    proposed: int = 0
    accepted: int = 0


class Proposer:
    """Proposals for the scheduler, which of them a step keeps, and the record that backs them off.

    Which proposals pay: a step's time depends on its token bucket, measured as the engine runs
    (`observe_step`, a moving average per bucket). A proposal of k tokens by a request accepting a share
    p of its proposals is expected to add p + p^2 + ... + p^k tokens; `keep` takes the proposals' tokens
    in order of that gain as long as the step's expected tokens per second grow, so on a device where a
    bigger bucket costs nearly nothing (a memory-bound step) it keeps them all, and where the step is
    compute-bound (many rows, a slow CPU) it keeps fewer or none."""

    AVG_WEIGHT = 0.3  # weight of the newest step in the moving averages
    PRIOR_RATE = 0.7  # a new request's expected acceptance, before it has proposed anything
    BACKED_OFF = 0.1  # below this acceptance a request proposes only every probe_every steps

    def __init__(self, config: SpeculativeConfig, buckets: tuple[int, ...] = ()):
        self.config = config
        self.buckets = tuple(buckets)  # the token buckets (jaxcb.host.buckets); () = cost not considered
        self.bucket_s: dict[int, float] = {}  # moving average of a step's seconds, per token bucket
        self.num_rows = 0  # speculating rows
        self.num_proposed = 0
        self.num_accepted = 0

    def reset_counters(self) -> None:
        self.num_rows = self.num_proposed = self.num_accepted = 0

    def active(self, num_running: int) -> bool:
        """Whether this step may speculate at all."""
        return self.config.enabled and 0 < num_running <= self.config.max_batch

    def state(self, r) -> SpecState:
        if r.spec is None:
            r.spec = SpecState(rate=self.PRIOR_RATE)
        return r.spec

    def eligible(self, r) -> bool:
        """Whether decoding request `r` may propose now: it did not opt out, has no grammar to follow,
        and is not backed off (or is due to probe)."""
        if not r.params.speculative or r.matcher is not None:
            return False
        s = self.state(r)
        return s.rate >= self.BACKED_OFF or s.steps_since >= self.config.probe_every

    def likely(self, r) -> bool:
        """Whether eligible `r` would find a proposal in its known tokens (its newest token may still be
        on the device): the engine waits for the step in flight only when some request would."""
        return self.eligible(r) and self._lookup(r, 1).size > 0

    def tick(self, r) -> None:
        """r decodes a step (speculating or not): a backed-off request counts towards its next probe."""
        self.state(r).steps_since += 1

    def _lookup(self, r, k: int) -> np.ndarray:
        tokens = np.asarray(r.prompt_ids + r.output_ids, np.int32)
        return propose_ngram(tokens, k, self.config.min_n, self.config.max_n)

    def propose(self, r, limit: int) -> list[int]:
        """Tokens to propose for eligible decoding request `r` (all of whose tokens are known), at most
        `limit`; [] when its sequence offers nothing (that costs nothing, so it is not held against it)."""
        k = min(limit, self.config.num_tokens)
        return self._lookup(r, k).tolist() if k > 0 else []

    def expected(self, r, k: int) -> float:
        """Tokens a proposal of k tokens by r is expected to add: p + p^2 + ... + p^k."""
        p = self.state(r).rate
        return sum(p ** j for j in range(1, k + 1))

    def observe_step(self, padded_tokens: int, seconds: float) -> None:
        """A completed step's time, for its token bucket."""
        old = self.bucket_s.get(padded_tokens)
        self.bucket_s[padded_tokens] = seconds if old is None else old + self.AVG_WEIGHT * (seconds - old)

    def _step_s(self, tokens: int) -> float | None:
        """The measured time of the bucket `tokens` falls in; a bucket not yet measured costs what the
        largest measured one below it does (so speculation tries it, and then knows)."""
        i = bisect.bisect_left(self.buckets, tokens)
        if i == len(self.buckets):
            return None
        for b in reversed(self.buckets[:i + 1]):
            if b in self.bucket_s:
                return self.bucket_s[b]
        return None

    def keep(self, proposals: list[tuple[object, int]], base_tokens: int, base_outputs: int) -> list[int]:
        """How many tokens of each proposal (request, k) to keep in a step that has `base_tokens`
        tokens and samples `base_outputs` tokens without them: the prefix of all proposals' tokens, in
        order of expected gain, that maximises expected output tokens per second of step."""
        gains = sorted(((self.state(r).rate ** j, i) for i, (r, k) in enumerate(proposals) for j in range(1, k + 1)),
                       reverse=True)
        best_n, best_rate, expected = 0, None, float(base_outputs)
        base = self._step_s(base_tokens)
        if base is not None:
            best_rate = expected / base
        for n, (gain, _) in enumerate(gains, start=1):
            expected += gain
            seconds = self._step_s(base_tokens + n)
            if seconds is None:
                break
            if best_rate is None or expected / seconds > best_rate:
                best_n, best_rate = n, expected / seconds
        if best_rate is None:  # nothing measured yet: try them all
            best_n = len(gains)
        counts = [0] * len(proposals)
        for _, i in gains[:best_n]:
            counts[i] += 1
        return counts

    def record(self, r, proposed: int, accepted: int) -> None:
        """A speculating step's outcome for r."""
        s = self.state(r)
        s.steps_since = 0
        s.rate += self.AVG_WEIGHT * (accepted / proposed - s.rate)
        s.proposed += proposed
        s.accepted += accepted
        self.num_rows += 1
        self.num_proposed += proposed
        self.num_accepted += accepted
