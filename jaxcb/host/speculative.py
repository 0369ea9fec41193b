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
own would need the general rule (accept with min(1, p/q)); both proposers here propose one token per
position with certainty (q one-hot), so this walk is exact for each of them, at any temperature.

Proposers: `ngram` (prompt lookup): the longest suffix of the sequence, `min_n`..`max_n` tokens, that
occurred before in its prompt or output proposes the tokens that followed its latest occurrence.
`draft`: a smaller model with the target's vocabulary (jaxcb.host.draft: the target's own weights with
fewer layers or in int4, or any model jaxcb loads) decodes k tokens greedily on its own KV pages.

Backing off: each request keeps a moving average of the share of its proposed tokens accepted,
starting from the server's (a slower moving average over every request); the step keeps a proposal's
tokens only while they are expected to raise the step's output tokens per second, by the step times
measured per token bucket, what proposing costs (a draft model's steps) and the host's work that a
speculating step no longer overlaps (it needs the step before it finished; Proposer.keep). Proposing
may have an entry cost (a draft model catching up on the request's prompt and output): a request pays
it only if its share of what the steps save, over the tokens it is expected to have left (by its
max_tokens, or by how far the finished requests that outlived it went), wins it back. A request
whose proposals are rarely accepted only probes: after `probe_every` steps, then twice as long after
each probe that found nothing. Speculation runs only while at most `max_batch` requests are running,
and a step with proposals takes a verifying program of its bucket (jaxcb.host.buckets), compiled up to
the bucket of `max_batch` requests each bringing k: a step with more tokens keeps none.

Plain Python and numpy, no JAX.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

import numpy as np

from jaxcb.host.errors import InvalidConfig

METHODS = ("ngram", "draft")
DRAFT_WEIGHTS = ("auto", "float32", "bfloat16", "int8", "int4")  # speculative.draft_weights (jaxcb.model.quant)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """`[speculative]` in the engine config (flags --speculative, --num-speculative-tokens)."""

    method: str = ""  # "" = off; "ngram" or "draft"
    num_tokens: int = 4  # k: tokens proposed per speculating step, at most
    min_n: int = 1  # n-gram: the shortest suffix looked up
    max_n: int = 4  # n-gram: the longest
    max_batch: int = 8  # speculate only while at most this many requests run
    probe_every: int = 8  # a request whose proposals are rarely accepted tries again every this many steps
    adaptive: bool = True  # keep only the proposals that pay by the measured step times; False: keep all
    # method "draft": the draft model (a GGUF, a converted checkpoint, a Hugging Face directory or an
    # embedded model's name; "" = the target's own weights), its first `draft_layers` layers (0 = all)
    # and its weights' format (jaxcb.model.quant; "auto" = as loaded, or as the target's when shared)
    draft_model: str = ""
    draft_layers: int = 0
    draft_weights: str = "auto"

    def __post_init__(self):
        if self.method and self.method not in METHODS:
            raise InvalidConfig(f"speculative.method: {self.method!r} is not one of {METHODS}")
        if not isinstance(self.draft_model, str):
            raise InvalidConfig(f"speculative.draft_model: must be a path or a model name, got {self.draft_model!r}")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise InvalidConfig(f"speculative.draft_weights: {self.draft_weights!r} is not one of {DRAFT_WEIGHTS}")
        if isinstance(self.draft_layers, bool) or not isinstance(self.draft_layers, int) or self.draft_layers < 0:
            raise InvalidConfig(f"speculative.draft_layers: must be an integer >= 0 (0 = all), got {self.draft_layers!r}")
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

    @property
    def verify_tokens(self) -> int:
        """The tokens of a step in which every request that may speculate brings k proposals: the
        verifying programs cover the buckets up to the one that holds it (jaxcb.host.buckets), and a
        step with more tokens (prompt chunks beside them) keeps no proposals."""
        return (self.num_tokens + 1) * self.max_batch if self.enabled else 0


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
    misses: int = 0  # probes in a row that had nothing accepted (each doubles the wait for the next)
    proposed: int = 0
    accepted: int = 0
    draft_valid: int = 0  # method "draft": the draft model's KV holds the first this many tokens ...
    draft_epoch: object = None  # ... while (its preemption count, the draft's generation) is this


class Proposer:
    """Proposals for the scheduler, which of them a step keeps, and the record that backs them off.

    Which proposals pay: a step's time depends on its token bucket, measured as the engine runs
    (`observe_step`, a moving average per bucket), and a speculating step also costs the host's work
    between the step before it and its dispatch, which async scheduling would have overlapped
    (`observe_sync`). A proposal of k tokens by a request accepting a share p of its proposals is
    expected to add p + p^2 + ... + p^k tokens; `keep` takes the proposals' tokens in order of that
    gain as long as the step's expected tokens per second grow, so on a device where a
    bigger bucket costs nearly nothing (a memory-bound step) it keeps them all, and where the step is
    compute-bound (many rows, a slow CPU) it keeps fewer or none."""

    deferred = False  # True: propose() gives placeholders, fill() the tokens, for all rows of a step at once
    AVG_WEIGHT = 0.3  # weight of the newest step in the moving averages
    PRIOR_RATE = 0.7  # the expected acceptance before anything was proposed (and a probe's)
    BACKED_OFF = 0.1  # below this acceptance a request only probes
    GLOBAL_WEIGHT = 0.05  # weight of a speculating row in the server's acceptance, a new request's start
    LENGTHS = 256  # finished requests' output lengths kept to estimate how long a running one goes on

    def __init__(self, config: SpeculativeConfig, buckets: tuple[int, ...] = ()):
        self.config = config
        self.buckets = tuple(buckets)  # the token buckets (jaxcb.host.buckets); () = cost not considered
        self.max_step_tokens = 0  # the largest step a verifying program exists for (0: no limit)
        self.bucket_s: dict[int, float] = {}  # moving average of a step's seconds, per token bucket
        # moving average of the host's time from a step's tokens to a speculating step's dispatch: the
        # device idles through it, where without proposals the next step would have been queued already
        self.sync_s = 0.0
        self.global_rate = self.PRIOR_RATE  # moving average of every request's acceptance
        self.lengths = collections.deque(maxlen=self.LENGTHS)  # output lengths of the latest finished requests
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
            r.spec = SpecState(rate=self.global_rate)
        return r.spec

    def eligible(self, r) -> bool:
        """Whether decoding request `r` may propose now: it did not opt out, has no grammar to follow, bad
        words to keep out nor a thinking budget (each proposal's row would need its own mask), and is not backed
        off (or is due to probe)."""
        if (not r.params.speculative or r.matcher is not None or r.params.bad_word_ids
                or r.params.thinking_token_budget is not None):
            return False
        s = self.state(r)
        return s.rate >= self.BACKED_OFF or s.steps_since >= self.config.probe_every << min(s.misses, 6)

    def estimate(self, r) -> float:
        """The acceptance r's proposals are weighed with: its own, or for a backed-off request's probe
        the prior (a probe is there to find out)."""
        rate = self.state(r).rate
        return rate if rate >= self.BACKED_OFF else self.PRIOR_RATE

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

    def observe_finish(self, r) -> None:
        """r ended by itself (a stop or its length): its output length, for `remaining`."""
        self.lengths.append(len(r.output_ids))

    def remaining(self, r) -> float:
        """Tokens r is expected to produce still: what max_tokens leaves when it ignores end-of-sequence
        or no finished request went further than it has; otherwise the mean, over the latest finished
        requests that outlived its output so far, of what they produced beyond it (within its limit)."""
        done = len(r.output_ids)
        limit = max(0, r.params.max_tokens - done)
        if r.params.ignore_eos:
            return float(limit)
        beyond = [min(n - done, limit) for n in self.lengths if n > done]
        return sum(beyond) / len(beyond) if beyond else float(limit)

    def entry_cost(self, r) -> float:
        """Seconds of one-off work before r's proposals can start (a draft model's catch-up on r's tokens)."""
        return 0.0

    def fill(self, chunks) -> None:
        """Put the proposals into the kept speculating chunks (a deferred proposer); the n-gram
        proposals are there already."""

    def proposal_cost(self, depth: int) -> float:
        """Seconds that proposing `depth` tokens deep costs besides the step (a draft model's steps)."""
        return 0.0

    def expected(self, r, k: int) -> float:
        """Tokens a proposal of k tokens by r is expected to add: p + p^2 + ... + p^k."""
        p = self.estimate(r)
        return sum(p ** j for j in range(1, k + 1))

    def observe_step(self, padded_tokens: int, seconds: float) -> None:
        """A completed step's time, for its token bucket."""
        self.bucket_s[padded_tokens] = self.average(self.bucket_s.get(padded_tokens), seconds)

    def observe_sync(self, seconds: float) -> None:
        """A speculating step's wait: from the tokens of the step before it to its own dispatch."""
        self.sync_s = self.average(self.sync_s, seconds)

    @classmethod
    def average(cls, old: float | None, new: float) -> float:
        """The moving average every measured cost here keeps: `new` alone when nothing came before."""
        return new if old is None else old + cls.AVG_WEIGHT * (new - old)

    def _step_s(self, tokens: int) -> float | None:
        """The measured time of the bucket `tokens` falls in; a bucket not yet measured costs what the
        largest measured one below it does (so speculation tries it, and then knows); with none measured
        below, the smallest measured above it (a smaller step costs no more: a step that always
        speculates never measures the bucket it would take without proposals)."""
        i = bisect.bisect_left(self.buckets, tokens)
        if i == len(self.buckets):
            return None
        for b in reversed(self.buckets[:i + 1]):
            if b in self.bucket_s:
                return self.bucket_s[b]
        return next((self.bucket_s[b] for b in self.buckets[i + 1:] if b in self.bucket_s), None)

    def keep(self, proposals: list[tuple[object, int]], base_tokens: int, base_outputs: int) -> list[int]:
        """How many tokens of each proposal (request, k) to keep in a step that has `base_tokens`
        tokens and samples `base_outputs` tokens without them: the prefix of all proposals' tokens, in
        order of expected gain, that maximises expected output tokens per second of step, without the
        requests whose share of what that saves would not win back their entry cost (`entry_cost`)
        in the steps they have left."""
        base = self._step_s(base_tokens)
        left = set(range(len(proposals)))
        while True:
            gains = sorted(((self.estimate(r) ** j, -j, i) for i, (r, k) in enumerate(proposals) if i in left
                            for j in range(1, k + 1)), reverse=True)
            if self.max_step_tokens:  # no more than a verifying program holds
                gains = gains[:max(0, self.max_step_tokens - base_tokens)]
            n, seconds = self._best(gains, base_tokens, base_outputs, base)
            late = self._entry_unpaid(proposals, gains[:n], base, base_outputs, seconds)
            if late is None:
                break
            left.discard(late)
        counts = [0] * len(proposals)
        for _, _, i in gains[:n]:
            counts[i] += 1
        return counts

    def _best(self, gains, base_tokens: int, base_outputs: int, base: float | None) -> tuple[int, float | None]:
        """The number of `gains`' tokens that maximises the step's expected output tokens per second,
        and that step's expected seconds (None: not measured, and then all are kept, to find out)."""
        best_n, best_rate, best_s, expected, depth = 0, None, base, float(base_outputs), 0
        if base is not None:
            best_rate = expected / base
        for n, (gain, minus_j, _) in enumerate(gains, start=1):
            expected += gain
            depth = max(depth, -minus_j)
            seconds = self._step_s(base_tokens + n)
            if seconds is None:
                break
            seconds += self.proposal_cost(depth) + self.sync_s
            if best_rate is None or expected / seconds > best_rate:
                best_n, best_rate, best_s = n, expected / seconds, seconds
        if best_rate is None:  # nothing measured yet: try them all
            return len(gains), None
        return best_n, best_s

    def _entry_unpaid(self, proposals, kept, base: float | None, base_outputs: int, seconds: float | None) -> int | None:
        """The kept proposal whose request's entry cost is furthest from being won back, if any is not:
        a step saves the time its extra tokens would take at the rate without proposals, less its own
        extra time; each request is credited with its tokens' share of that, for every step it is
        expected to have left (its remaining tokens over 1 + its tokens per step)."""
        if not kept or base is None or seconds is None or base_outputs <= 0:
            return None
        per_row: dict[int, float] = {}
        for gain, _, i in kept:
            per_row[i] = per_row.get(i, 0.0) + gain
        total = sum(per_row.values())
        saved = (base_outputs + total) * base / base_outputs - seconds
        worst, worst_margin = None, 0.0
        for i, g in per_row.items():
            r = proposals[i][0]
            cost = self.entry_cost(r)
            if cost > 0:
                margin = saved * g / total * self.remaining(r) / (1 + g) - cost
                if margin < worst_margin:
                    worst, worst_margin = i, margin
        return worst

    def record(self, r, proposed: int, accepted: int) -> None:
        """A speculating step's outcome for r (its num_computed already counts the accepted tokens)."""
        s = self.state(r)
        s.steps_since = 0
        if s.rate < self.BACKED_OFF:  # a probe
            s.misses = 0 if accepted else s.misses + 1
        s.rate += self.AVG_WEIGHT * (accepted / proposed - s.rate)
        self.global_rate += self.GLOBAL_WEIGHT * (accepted / proposed - self.global_rate)
        s.proposed += proposed
        s.accepted += accepted
        self.num_rows += 1
        self.num_proposed += proposed
        self.num_accepted += accepted
