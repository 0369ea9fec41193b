"""The latency controller: holds p99 TPOT (and TTFT) targets by moving the scheduler's running limit and
prefill budget from measured step and first-token times. Plain Python, no JAX."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxcb.host.policies import SchedulerConfig
    from jaxcb.host.request import Request
    from jaxcb.host.step_plan import Chunk


def quantile(values: list[float], q: float) -> float:
    """The q-quantile with linear interpolation (numpy's default), 0.0 for no values."""
    if not values:
        return 0.0
    v = sorted(values)
    x = q * (len(v) - 1)
    lo = int(x)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (x - lo)


class LatencyController:
    """Holds a p99 time-per-output-token target (and optionally a time-to-first-token one) by moving the
    running limit and the per-step prefill budget, from measured step times.

    A request's time per token is the mean of the step times over its life, and what makes a step slow
    is the prompt tokens it carries beside the decode rows. So the prefill budget is set from two
    running estimates, the time of a decode-only step and the time each prompt token adds: the most
    prompt tokens the next step can carry and keep the mean of the last `span` decode steps under
    `high` x target (at least `min_budget`). Prefill is
    then spread over the steps instead of arriving in bursts that a short request cannot average out,
    at the same cost per prompt token. The running limit is the backstop: once `span` steps ran since
    the last change, a mean of the last `span` decode steps above `high` x target shrinks it by target
    / mean (at most halving it, at least by 15%); every `every` steps, when the largest `span`-step mean
    over the last `window` steps is below `high` x target, it grows by one. A TTFT target above its
    measured p90 (first tokens of the last requests) grows the budget while the TPOT target leaves room,
    since queueing is what makes a first token late; the TPOT target wins a conflict.
    """

    high, window, span, every = 0.9, 64, 8, 8
    smoothing = 0.2  # weight of the newest step in the running estimates

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.running_limit = config.max_running
        self.min_budget = min(16, config.max_prefill_tokens)
        self.prefill_budget = config.max_prefill_tokens
        self._steps = collections.deque(maxlen=self.window)
        self._ttft = collections.deque(maxlen=32)
        self._tpot = collections.deque(maxlen=128)  # finished requests' mean time per token (the metric)
        self._since = 0  # steps since the last evaluation of growth
        self._fresh = 0  # steps since the last change of the limit
        self.decode_ms: float | None = None  # a decode-only step, smoothed
        self.prompt_token_ms: float | None = None  # what a prompt token adds to a step, smoothed
        self._extra = 0.0  # TTFT: the share of the room between the budget's step and the target to use
        self.signal_ms = 0.0  # the last signal: the largest mean of `span` consecutive decode steps
        self.num_adjustments = 0

    def observe_step_done(self, chunks: list[Chunk], seconds: float | None,
                          sampled: list[tuple[Request, bool]], now: float) -> None:
        """Take a completed step: its time when it had decode rows (`seconds`: None when it followed an
        idle spell), the wait for each first token, each finished request's mean time per token.
        `sampled`: (request, finished) for each token the step appended, with `first_token_time` set."""
        if seconds is not None:
            decode = sum(1 for c in chunks if c.is_decode)  # each waited this long for its token
            self.observe_step(seconds, decode, sum(c.num_tokens for c in chunks if not c.is_decode))
        for r, finished in sampled:
            n = len(r.output_ids)
            if n == 1:
                self.observe_first_token(r.first_token_time - r.arrival_time)
            if finished and n > 1:
                self.observe_finished((now - r.first_token_time) / (n - 1))

    def observe_step(self, seconds: float, decode_rows: int = 1, prompt_tokens: int = 0) -> None:
        """A completed step took `seconds`: `decode_rows` rows waited for their next token in it beside
        `prompt_tokens` tokens of prefill chunks."""
        ms, a = seconds * 1000, self.smoothing
        if prompt_tokens == 0:
            self.decode_ms = ms if self.decode_ms is None else (1 - a) * self.decode_ms + a * ms
        elif prompt_tokens >= self.min_budget // 2:  # enough tokens to tell their cost from the noise
            base = self.decode_ms if self.decode_ms is not None and decode_rows else 0.0
            per = max(ms - base, 0.0) / prompt_tokens
            self.prompt_token_ms = per if self.prompt_token_ms is None else (1 - a) * self.prompt_token_ms + a * per
        tpot = self.config.target_p99_tpot_ms
        if decode_rows:  # a prefill-only step: no row waited for a token
            self._steps.append(ms)
            self._since += 1
            self._fresh += 1
        if tpot is not None:
            self._budget_for(tpot)
        if not decode_rows:
            return
        k = self.span
        if self._fresh < k:
            return
        steps = list(self._steps)
        recent = sum(steps[-k:]) / k
        if tpot is not None and recent > self.high * tpot:
            self._set_limit(int(self.running_limit * min(0.85, max(0.5, self.high * tpot / recent))))
            return
        if self._since < self.every:
            return
        self._since = 0
        run = worst = sum(steps[:k])
        for i in range(k, len(steps)):
            run += steps[i] - steps[i - k]
            worst = max(worst, run)
        self.signal_ms = worst / k
        ttft, late = self.config.target_p99_ttft_ms, False
        if ttft is not None and len(self._ttft) >= 4:
            late = quantile(list(self._ttft), 0.9) > ttft
        if tpot is None:
            if late:  # only a TTFT target: queueing makes first tokens late; more of everything
                self._set_limit(self.running_limit + 1)
                self.prefill_budget = min(self.config.max_prefill_tokens, int(self.prefill_budget * 1.15) + 1)
            return
        if self.signal_ms < self.high * tpot:
            self._set_limit(self.running_limit + 1)
            if late:
                self._extra = min(1.0, self._extra + 0.25)
        elif not late:
            self._extra = 0.0

    def _budget_for(self, tpot: float) -> None:
        """The most prompt tokens the next step can carry and keep the mean of the last `span` decode
        steps under `high` x target: a big chunk is followed by decode-only steps until the window has
        room again, so prefill is spread over the steps instead of arriving in bursts."""
        if self.prompt_token_ms is None or self.prompt_token_ms <= 0:
            return
        k = self.span
        previous = list(self._steps)[-(k - 1):]
        previous_ms = sum(previous) + (k - 1 - len(previous)) * (self.decode_ms or 0.0)
        room = k * self.high * tpot - previous_ms - (self.decode_ms or 0.0)
        room += self._extra * k * (1 - self.high) * tpot  # a late TTFT may use the margin
        budget = int(room / self.prompt_token_ms + 1e-6)
        self.prefill_budget = min(max(self.min_budget, budget), self.config.max_prefill_tokens)

    def observe_first_token(self, seconds: float) -> None:
        self._ttft.append(seconds * 1000)

    def observe_finished(self, tpot_seconds: float) -> None:
        self._tpot.append(tpot_seconds * 1000)

    @property
    def measured_p99_tpot_ms(self) -> float:
        return quantile(list(self._tpot), 0.99)

    @property
    def measured_p99_ttft_ms(self) -> float:
        return quantile(list(self._ttft), 0.99)

    def _set_limit(self, limit: int) -> None:
        limit = min(max(1, limit), self.config.max_running)
        if limit != self.running_limit:
            self.num_adjustments += 1
            self._fresh = 0  # judge the new setting on its own steps
        self.running_limit = limit
