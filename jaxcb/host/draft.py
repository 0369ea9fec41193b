"""Speculative decoding's draft model, the host side: what the draft runs, on which pages, and what it knows.

A draft model (a smaller model with the target's vocabulary: the target's first layers, the target in
int4, or any model jaxcb loads) proposes k tokens for a decoding request by decoding them greedily. It
runs on a runner of its own (jaxcb.device.runner.ModelRunner with the draft's weights), through the same
packed, bucketed step as the target, and its KV pages mirror the target's: page p of the draft's cache
holds the draft's keys and values of the tokens that page p of the target's holds. So the draft needs no
allocator of its own: a request's page ids (both groups, with sliding layers) are the draft's too, and
they are allocated, trimmed, freed and preempted with the request.

What the draft knows: each request keeps `draft_valid`, how many of its first tokens the draft's KV
holds (jaxcb.host.speculative.SpecState). Proposing for a step is then
  1. a catch-up: the tokens the draft has not seen ([draft_valid, the newest token]) in one packed
     step with every proposing row, sampling the first proposal at each row's last token (a long
     catch-up, after a prompt or a preemption, runs its earlier part in steps of the largest bucket
     first);
  2. k - 1 one-token steps, each feeding the token the step before sampled (read on the device, as
     async scheduling does: nothing comes back to the host until all k are dispatched).
After the target's verifying step accepts a of the k proposals, the draft's KV holds the newest token
and the accepted proposals it was fed: draft_valid = newest + 1 + min(a, k - 1). A preemption (the
request's pages are gone) starts it over at 0, and so does a new request whose prompt came from the
prefix cache (the pages' draft KV may never have been written).

Proposals are the draft's greedy tokens: a one-hot draft distribution, for which the verifier's walk
(jaxcb.host.speculative) is exact rejection sampling at any temperature. A draft's KV may be stale or
approximate (a shared prefix page rewritten by another request's draft, a sliding window whose old
pages were released before a long catch-up): that changes only what is proposed, never what is
emitted.

Plain Python and numpy, no JAX: the draft runner is a jaxcb.host.runner_protocol.Runner.
"""

from __future__ import annotations

import time

from jaxcb.host.batch import SamplingRow, SeqSpec, pack, pack_sampling
from jaxcb.host.errors import InvalidConfig
from jaxcb.host.page_pool import NULL_PAGE
from jaxcb.host.request import SamplingParams
from jaxcb.host.speculative import Proposer, SpeculativeConfig

GREEDY = SamplingParams(temperature=0.0)
PLACEHOLDER = -1  # a proposal's token until fill() runs the draft


class DraftProposer(Proposer):
    """Proposals by a draft model on its own runner (see the module docstring)."""

    deferred = True

    def __init__(self, config: SpeculativeConfig, runner, buckets, page_size: int, max_context: int,
                 window: int = 0):
        super().__init__(config)
        self.runner = runner  # the draft's: compile(shape), run(batch, sampling, shape), fetch(outputs)
        self.step_buckets = buckets  # jaxcb.host.buckets.Buckets: the draft's steps take the target's buckets
        self.page_size = page_size
        self.max_context = max_context
        self.window = window  # > 0: the model has sliding layers (the request's second page group)
        self.vocab_size = runner.model_config.vocab_size
        self.token_s: float | None = None  # moving average of one proposed token's draft time
        self.catch_up_s: float | None = None  # moving average of the draft's time per token it catches up on
        self.last_fill_s = 0.0  # the draft's time in the latest step's proposals
        self.num_draft_steps = 0
        self.draft_s = 0.0
        self.generation = 0  # bumped when a draft step fails: every request's draft KV counts as lost

    def reset_counters(self) -> None:
        super().reset_counters()
        self.num_draft_steps, self.draft_s = 0, 0.0

    def shapes(self) -> list:
        """The draft's step shapes: one per token bucket, sampling one token per row."""
        return self.step_buckets.shapes(self.page_size, self.max_context)

    def likely(self, r) -> bool:
        return self.eligible(r)  # a draft model always has something to propose

    def propose(self, r, limit: int) -> list[int]:
        k = min(limit, self.config.num_tokens)
        return [PLACEHOLDER] * k if k > 0 else []

    def proposal_cost(self, depth: int) -> float:
        return depth * self.token_s if self.token_s is not None else 0.0

    def _behind(self, r) -> int:
        """Tokens the draft would be fed for r before its first proposal: from what it holds of r to
        r's newest token."""
        return r.num_computed + 1 - self._begin(r, r.num_computed)

    def _begin(self, r, newest: int) -> int:
        """The first position the draft is fed for r when r's newest token is at `newest`."""
        return min(max(self.valid(r), self._earliest(r)), newest)

    def entry_cost(self, r) -> float:
        """A catch-up on r's prompt and output (its first proposal, or after a preemption or a spell
        without proposals) at the measured time per token; the newest token and an accepted proposal
        are part of every proposal's cost. Before any catch-up was measured, a token costs what one
        costs the target in its largest step measured so far (a draft is no dearer than its target)."""
        behind = self._behind(r)
        per_token = self.catch_up_s
        if per_token is None and self.bucket_s:
            largest = max(self.bucket_s)
            per_token = self.bucket_s[largest] / largest
        return behind * per_token if behind > 2 and per_token is not None else 0.0

    def observe_sync(self, seconds: float) -> None:
        super().observe_sync(max(0.0, seconds - self.last_fill_s))  # the draft's own steps count in proposal_cost

    def valid(self, r) -> int:
        s = self.state(r)
        return s.draft_valid if s.draft_epoch == (r.num_preemptions, self.generation) else 0

    def record(self, r, proposed: int, accepted: int) -> None:
        super().record(r, proposed, accepted)
        s = self.state(r)
        # The draft was fed the newest token and proposals 1 .. k-1; the accepted ones among them hold.
        s.draft_valid = r.num_computed - (1 if accepted == proposed else 0)
        s.draft_epoch = (r.num_preemptions, self.generation)

    def _earliest(self, r) -> int:
        """The first position the draft can compute for r now: with sliding layers, the first whose
        window's pages r still holds (those before went back as r's window moved on; the draft's KV
        there stays unwritten, which only makes its proposals worse)."""
        if not self.window or not r.window_page_ids:
            return 0
        held = next((i for i, p in enumerate(r.window_page_ids) if p != NULL_PAGE), len(r.window_page_ids))
        return held * self.page_size + self.window - 1 if held else 0

    def _run(self, specs: list[SeqSpec], samples: list[bool]):
        """One draft step over `specs` (one-token sequences first); returns its output handle."""
        shape = self.step_buckets.step_shape(sum(len(s.token_ids) for s in specs), self.page_size, self.max_context)
        batch = pack(specs, shape, self.page_size, self.window)
        rows = [SamplingRow(GREEDY, 0, [], [], samples=x) for x in samples]
        sampling = pack_sampling(rows, shape, self.vocab_size)
        self.num_draft_steps += 1
        return self.runner.run(batch, sampling, shape)

    def _spec(self, r, start: int, tokens: list[int], src_row: int = -1) -> SeqSpec:
        return SeqSpec(tokens, start, r.page_ids, src_row=src_row, window_page_ids=r.window_page_ids)

    def fill(self, chunks) -> None:
        """Run the draft for the kept speculating chunks (each a decode row whose newest token is at
        c.start, with len(c.draft) placeholders after it) and put its tokens in their place. If a draft
        step fails, the draft's KV is forgotten (every request catches up from its start) and the error
        goes to the scheduler, which decodes these rows without proposals."""
        if not chunks:
            return
        try:
            self._fill(chunks)
        except Exception:
            self.generation += 1  # what any request's draft KV holds is unknown now
            self.runner.reset_kv_if_lost()
            raise

    def _fill(self, chunks) -> None:
        t0 = time.perf_counter()
        largest, max_seqs = self.step_buckets.max_tokens, self.step_buckets.max_batch
        # The final catch-up step holds every row's last piece; what comes before goes first.
        share = max(1, largest // len(chunks))
        todo = []  # [request, next position, end] of each row's earlier part
        final = []  # (chunk, start of its last piece)
        catch_up = []  # the tokens each row feeds the draft before its first proposal
        for c in chunks:
            r, end = c.request, c.start + 1
            begin = self._begin(r, c.start)
            catch_up.append(end - begin)
            last = max(begin, end - share)
            final.append((c, last))
            if last > begin:
                todo.append([r, begin, last])
        while todo:  # long catch-ups: steps of the largest bucket, one piece per row each
            specs, budget = [], largest
            for item in todo:
                if budget == 0 or len(specs) == max_seqs:
                    break
                r, pos, stop = item
                n = min(budget, stop - pos)
                specs.append(self._spec(r, pos, r.token_slice(pos, pos + n)))
                item[1] += n
                budget -= n
            specs.sort(key=lambda s: len(s.token_ids) != 1)
            self._run(specs, [False] * len(specs))
            todo = [item for item in todo if item[1] < item[2]]
        # The last piece of each row, sampling the first proposal; one-token rows first (packed layout).
        final.sort(key=lambda x: x[0].start + 1 - x[1] != 1)
        specs = [self._spec(c.request, last, c.request.token_slice(last, c.start + 1)) for c, last in final]
        outputs = [self._run(specs, [True] * len(specs))]
        order = [c for c, _ in final]  # the rows of the step just run
        for j in range(1, max(len(c.draft) for c in chunks)):
            # Rows still proposing, each fed the token its row of the previous step sampled.
            rows = [(i, c) for i, c in enumerate(order) if len(c.draft) > j]
            specs = [self._spec(c.request, c.start + j, [0], src_row=i) for i, c in rows]
            outputs.append(self._run(specs, [True] * len(specs)))
            order = [c for _, c in rows]
        tokens = [self.runner.fetch(o).token_ids for o in outputs]
        order = [c for c, _ in final]
        for j, sampled in enumerate(tokens):
            if j:
                order = [c for c in order if len(c.draft) > j]
            for i, c in enumerate(order):
                draft = list(c.draft)
                draft[j] = int(sampled[i])
                c.draft = tuple(draft)
        seconds = time.perf_counter() - t0
        self.draft_s += seconds
        self.last_fill_s = seconds
        # What a proposed token costs, learnt from fills that were all proposing (at most the newest token
        # and an accepted proposal to feed): a row catching up on a prompt (once per request, or after a
        # preemption) would make every later proposal look dear. What a catch-up costs per token, from
        # fills with one, less their proposals' part.
        depth = max(len(c.draft) for c in chunks)
        if max(catch_up) <= 2:
            self.token_s = self.average(self.token_s, seconds / depth)
        else:
            self.catch_up_s = self.average(self.catch_up_s, max(0.0, seconds - depth * (self.token_s or 0.0))
                                           / sum(n for n in catch_up if n > 2))


def proposer_for(config, target, draft, max_context: int) -> Proposer | None:
    """An engine's speculative proposer (config: its EngineConfig): the draft model's or the n-gram one,
    sized to the buckets' verifying steps (and, when adaptive, weighing its tokens by the buckets' step
    times); None when speculative decoding is off."""
    spec = config.scheduler.speculative
    if not spec.enabled:
        return None
    proposer = draft_proposer(config, target, draft, max_context) or Proposer(spec)
    proposer.max_step_tokens = config.buckets.verify_limit(spec.verify_tokens)
    if spec.adaptive:
        proposer.buckets = config.buckets.tokens
    return proposer


def draft_proposer(config, target, draft, max_context: int) -> DraftProposer | None:
    """speculative.method "draft": the draft model's proposer for an engine (config: its EngineConfig),
    the draft's runner checked against the target's (the same vocabulary, and page layout: it writes the
    request's own page ids); else None."""
    spec = config.scheduler.speculative
    if spec.method != "draft":
        return None
    d, t = draft, target
    if d is None:
        raise InvalidConfig("speculative.method: 'draft' needs a draft model (built by jaxcb.llm.build_engines "
                            "from speculative.draft_model)")
    if d.model_config.vocab_size != t.model_config.vocab_size:
        raise InvalidConfig(f"speculative.draft_model: its vocabulary ({d.model_config.vocab_size} tokens) is not "
                            f"the target's ({t.model_config.vocab_size}); a draft must share the tokenizer")
    if (d.step_config.windowed, d.step_config.sliding_window) != (t.step_config.windowed, t.step_config.sliding_window):
        raise InvalidConfig("speculative.draft_model: its sliding window "
                            f"({d.step_config.sliding_window if d.step_config.windowed else 'none'}) is not the "
                            f"target's ({t.step_config.sliding_window if t.step_config.windowed else 'none'}): a "
                            "draft shares the request's page groups")
    if (d.num_pages, d.page_size, d.num_window_pages) != (t.num_pages, t.page_size, t.num_window_pages):
        raise InvalidConfig(f"speculative.draft_model: its runner has {d.num_pages} pages of {d.page_size} tokens "
                            f"({d.num_window_pages} sliding), the target's {t.num_pages} of {t.page_size} "
                            f"({t.num_window_pages}): a draft mirrors the target's pages")
    window = t.step_config.sliding_window if t.step_config.windowed else 0
    return DraftProposer(spec, d, config.buckets, config.page_size, max_context, window)


def describe_speculation(spec: SpeculativeConfig, draft=None) -> str:
    """Speculative decoding as configured ("" off), with the draft model's runner if it has one."""
    if not spec.enabled:
        return ""
    what = spec.method
    if draft is not None:
        what += (f" (draft model {spec.draft_model or draft.model_config.name}: {draft.model_config.num_layers} "
                 f"layers, weights {draft.describe()['weights']})")
    return f"{what}, up to {spec.num_tokens} tokens per step"
