"""The packed batch: one engine step's tokens, laid out for one jitted call.

The scheduler's output (decode tokens and prefill chunks, any mix) becomes one token axis of T slots:
sequence i owns rows cu_q_lens[i]:cu_q_lens[i+1], decode sequences first, then prefill chunks, then
padding. Only the token count T is a bucket; the sequence axis is M = min(T, max batch) and the page
table is [M, N] with N the pages of the longest allowed context, both fixed by T. Padded tokens write
into the null page and padded page-table entries point at it.

For the plain-JAX attention on the CPU the step also carries a flat list of *items*, one per live page
of every sequence (decode sequences' pages first, then the prefill sequences'), so that attention loops
over the pages the context holds, not over rows x the longest row (see model.paged_attention).

Speculative decoding (jaxcb.host.speculative): a decoding sequence may bring its newest token and k
proposed ones as one chunk; the step samples at each of its positions, the first k at `extra_rows`
(sample rows M .. M+E of the step's output, sequence by sequence) and the last at `last_token` as usual.

Prompt logprobs (SamplingParams.prompt_logprobs): a prompt chunk's positions before its last are sampled
in the step's spare sequence rows (m .. M of `last_token`, which a step of m sequences leaves unused), each
row forced to the prompt's next token (an `allowed` mask of that token alone), so that the sampler gives
that token's logprob and the best alternatives: no program of its own, at most M - m positions a step.

With async scheduling a decode token may not be on the host yet (the step in flight samples it): its
slot holds a placeholder and `src_rows` names the row of the previous step's output that the jitted
step reads it from; `SamplingInput.pending_col` likewise fills its place in the penalties' history.

Plain numpy, no JAX: `StepInput` and `SamplingInput` are registered as pytrees by the device side.
Packing is vectorised: no Python loop runs per token.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxcb.host.page_pool import NULL_PAGE
from jaxcb.host.request import MAX_LOGIT_BIAS, SamplingParams


@dataclasses.dataclass
class StepInput:
    """One packed step (T tokens, M sequence slots, N pages per sequence, W page items)."""

    token_ids: np.ndarray  # i32 [T]
    src_rows: np.ndarray  # i32 [T], -1, or the row of the previous step's sampled tokens this token is
    positions: np.ndarray  # i32 [T], position of each token in its sequence
    slot_ids: np.ndarray  # i32 [T], flat KV slot to write (null page for padding)
    seq_ids: np.ndarray  # i32 [T], the token's sequence; M for padding
    dense: np.ndarray  # bool [T], the token belongs to a multi-token (prefill) chunk
    kv_lens: np.ndarray  # i32 [M], context once this step's tokens are written; 0 for padding
    last_token: np.ndarray  # i32 [M], row of each sequence's last token (its logits are sampled)
    cu_q_lens: np.ndarray  # i32 [M+1], sequence i's rows are cu_q_lens[i]:cu_q_lens[i+1]
    num_seqs: np.ndarray  # i32 [1]
    page_table: np.ndarray  # i32 [M, N]
    item_pages: np.ndarray  # i32 [W], page of each item (null page for padding)
    item_owner: np.ndarray  # i32 [W], the item's sequence; M for padding
    item_start: np.ndarray  # i32 [W], position of the item's first slot in its sequence
    item_bounds: np.ndarray  # i32 [2], (decode items, all items): [0, a) decode, [a, b) prefill
    extra_rows: np.ndarray  # i32 [E], token rows sampled besides each sequence's last (speculation); -1 none
    lora_slots: np.ndarray  # i32 [T], the LoRA adapter slot of each token's sequence (jaxcb.host.lora); -1 none
    window: "WindowPages | None" = None  # the sliding layers' page group (models with sliding layers)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]


@dataclasses.dataclass
class WindowPages:
    """The sliding-window layers' view of the step: the same tokens and lengths over their own page
    group (jaxcb.host.window). Pages before a sequence's window are no longer held (null in the table), and
    its items cover only the pages its queries can see."""

    page_table: np.ndarray  # i32 [M, N]
    slot_ids: np.ndarray  # i32 [T]
    item_pages: np.ndarray  # i32 [W]
    item_owner: np.ndarray  # i32 [W]
    item_start: np.ndarray  # i32 [W]
    item_bounds: np.ndarray  # i32 [2]

    def apply(self, batch: StepInput) -> StepInput:
        """`batch` with this group's pages in place of the full layers'."""
        return dataclasses.replace(batch, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


@dataclasses.dataclass
class SamplingInput:
    """Per-row sampling settings of one step, see jaxcb.device.sampling: row i < M samples sequence i's
    last token, row M + j the token at StepInput.extra_rows[j] (M + E rows in all)."""

    temperature: np.ndarray  # f32 [M]; 0 = greedy
    top_k: np.ndarray  # i32 [M]; 0 = off
    top_p: np.ndarray  # f32 [M]; 1 = off
    min_p: np.ndarray  # f32 [M]; 0 = off
    repetition_penalty: np.ndarray  # f32 [M]; 1 = off
    presence_penalty: np.ndarray  # f32 [M]
    frequency_penalty: np.ndarray  # f32 [M]
    seed: np.ndarray  # u32 [M, 2] (high, low words of the request's 64-bit seed)
    counter: np.ndarray  # i32 [M], index of the token being sampled in the request's output
    history_ids: np.ndarray  # i32 [M, C], the sequence's tokens so far (prompt and output), -1 padded
    history_is_output: np.ndarray  # bool [M, C], which of them are output tokens
    logprobs: np.ndarray  # i32 [M], top-n logprobs wanted (0 = none)
    pending_col: np.ndarray  # i32 [M], history column of the row's input token when the host does
    #                          not know it yet (it comes from the previous step on the device); -1 none
    allowed: np.ndarray  # i32 [M, ceil(V/32)], bit t of word t // 32: token t may be sampled (structured
    #                      output, jaxcb.host.structured); all ones (-1) for a row without a constraint
    bias_ids: np.ndarray  # i32 [M, MAX_LOGIT_BIAS], the tokens whose logits the row's logit_bias moves; -1 none
    bias: np.ndarray  # f32 [M, MAX_LOGIT_BIAS], what it adds to each


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The static shape of a packed step: what one compiled program takes."""

    tokens: int  # T
    seqs: int  # M
    pages_per_seq: int  # N
    history: int  # C, tokens of history the penalties can see (the context limit)
    extra_rows: int = 0  # E, sample positions besides each sequence's last (speculative decoding)

    @property
    def rows(self) -> int:  # sampled rows: M + E
        return self.seqs + self.extra_rows

    @property
    def items(self) -> int:  # W: every sequence slot may hold N pages
        return self.seqs * self.pages_per_seq


@dataclasses.dataclass(slots=True)
class SeqSpec:
    """One sequence's part of a step: `token_ids` start at position `start` of the sequence."""

    token_ids: list[int]
    start: int
    page_ids: list[int]
    src_row: int = -1  # >= 0: a decode token not yet on the host, row src_row of the previous step's output
    window_page_ids: list[int] | None = None  # the sliding layers' pages (null before the window)
    num_draft: int = 0  # speculation: the last num_draft tokens are proposals, each position sampled
    lora_slot: int = -1  # the device slot of the sequence's LoRA adapter (jaxcb.host.lora); -1 the base model
    num_scored: int = 0  # prompt logprobs: the num_scored positions before the last are sampled too (spare rows)


@dataclasses.dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    seed: int  # 64-bit
    prompt_ids: list[int]
    output_ids: list[int]
    samples: bool = True  # False for a prefill chunk that ends before the newest token
    pending: bool = False  # the newest token (this row's input) is still on the device
    forced: int = -1  # >= 0: a prompt position scored: the row takes this token (the prompt's next), greedily


def _items(page_table, live, q_lens, m, shape: StepShape, page_size: int):
    """(item_pages, item_owner, item_start, item_bounds): the `live` pages of each sequence, decode
    sequences' first."""
    n_max, m_max = shape.pages_per_seq, shape.seqs
    num_items = int(live.sum())
    w = shape.items
    item_pages = np.full(w, NULL_PAGE, np.int32)
    item_owner = np.full(w, m_max, np.int32)
    item_start = np.zeros(w, np.int32)
    item_pages[:num_items] = page_table[:m][live]
    item_owner[:num_items] = np.broadcast_to(np.arange(m, dtype=np.int32)[:, None], live.shape)[live]
    item_start[:num_items] = np.broadcast_to(np.arange(n_max, dtype=np.int32) * page_size, live.shape)[live]
    num_decode_items = int(live[q_lens == 1].sum()) if m else 0
    return item_pages, item_owner, item_start, np.array([num_decode_items, num_items], np.int32)


def pack(seqs: list[SeqSpec], shape: StepShape, page_size: int, window: int = 0) -> StepInput:
    """Lay the sequences (decode ones first, then prefill chunks) into one step of `shape`. `window`
    (> 0 for a model with sliding layers): also lay out their page group from each SeqSpec's
    window_page_ids."""
    t_max, m_max, n_max = shape.tokens, shape.seqs, shape.pages_per_seq
    m = len(seqs)
    assert m <= m_max, f"{m} sequences do not fit {m_max} slots"
    q_lens = np.fromiter((len(s.token_ids) for s in seqs), np.int32, m)
    starts = np.fromiter((s.start for s in seqs), np.int32, m)
    n_pages = np.fromiter((len(s.page_ids) for s in seqs), np.int32, m)
    total = int(q_lens.sum())
    assert total <= t_max, f"{total} tokens do not fit bucket {t_max}"
    assert (n_pages <= n_max).all(), f"a sequence holds more than {n_max} pages"
    assert (q_lens > 0).all(), "every sequence brings at least one token"
    kv_lens = np.zeros(m_max, np.int32)
    kv_lens[:m] = starts + q_lens
    assert (n_pages * page_size >= kv_lens[:m]).all(), "a sequence's pages do not cover its tokens"

    page_table = np.full((m_max, n_max), NULL_PAGE, np.int32)
    for i, s in enumerate(seqs):  # one row per sequence, no per-token work
        page_table[i, :len(s.page_ids)] = s.page_ids

    cu = np.zeros(m_max + 1, np.int32)
    cu[1:m + 1] = np.cumsum(q_lens)
    cu[m + 1:] = total
    seq_of_token = np.repeat(np.arange(m, dtype=np.int32), q_lens)
    positions = np.zeros(t_max, np.int32)
    positions[:total] = starts[seq_of_token] + np.arange(total, dtype=np.int32) - cu[seq_of_token]
    token_ids = np.zeros(t_max, np.int32)
    if total:
        token_ids[:total] = np.concatenate([np.asarray(s.token_ids, np.int32) for s in seqs])
    src_rows = np.full(t_max, -1, np.int32)
    src = np.fromiter((s.src_row for s in seqs), np.int32, m)
    from_device = src >= 0
    assert (q_lens[from_device] == 1).all(), "only a decode token can come from the previous step"
    src_rows[cu[:m][from_device]] = src[from_device]
    pos = positions[:total]
    slot_ids = np.full(t_max, NULL_PAGE * page_size, np.int32)
    slot_ids[:total] = page_table[seq_of_token, pos // page_size] * page_size + pos % page_size
    seq_ids = np.full(t_max, m_max, np.int32)
    seq_ids[:total] = seq_of_token
    lora_slots = np.full(t_max, -1, np.int32)
    slots = np.fromiter((s.lora_slot for s in seqs), np.int32, m)
    if (slots >= 0).any():
        lora_slots[:total] = slots[seq_of_token]
    dense = np.zeros(t_max, bool)
    dense[:total] = (q_lens > 1)[seq_of_token]
    last_token = np.zeros(m_max, np.int32)
    last_token[:m] = cu[1:m + 1] - 1
    # Scored prompt positions: the spare sequence rows m .. (prompt logprobs), sequence by sequence.
    scored = np.fromiter((s.num_scored for s in seqs), np.int32, m)
    num_scored = int(scored.sum())
    if num_scored:
        assert m + num_scored <= m_max, f"{m} sequences and {num_scored} scored positions do not fit {m_max} rows"
        assert (scored < q_lens).all(), "a scored position lies before its sequence's last token"
        owner = np.repeat(np.arange(m, dtype=np.int32), scored)
        first = np.cumsum(scored) - scored
        last_token[m:m + num_scored] = (cu[owner + 1] - 1 - scored[owner]) + np.arange(num_scored) - first[owner]
    # Speculating sequences: each position but the last is sampled too, at rows M + j of the output.
    drafts = np.fromiter((s.num_draft for s in seqs), np.int32, m)
    assert (drafts < q_lens).all(), "a speculating sequence brings its newest token before its proposals"
    num_extra = int(drafts.sum())
    assert num_extra <= shape.extra_rows, f"{num_extra} proposed tokens do not fit {shape.extra_rows} sample rows"
    extra_rows = np.full(shape.extra_rows, -1, np.int32)
    if num_extra:
        owner = np.repeat(np.arange(m, dtype=np.int32), drafts)
        first = np.cumsum(drafts) - drafts
        extra_rows[:num_extra] = cu[owner] + np.arange(num_extra, dtype=np.int32) - first[owner]

    # Items: the pages each sequence's context covers, decode sequences' first.
    live = np.arange(n_max)[None, :] < -(-kv_lens[:m] // page_size)[:, None]  # [m, N]
    item_pages, item_owner, item_start, item_bounds = _items(page_table, live, q_lens, m, shape, page_size)
    decode_first = q_lens.size == 0 or not (np.diff((q_lens > 1).astype(np.int8)) < 0).any()
    assert decode_first, "decode sequences must come before prefill chunks"
    pages = None
    if window:
        w_table = np.full((m_max, n_max), NULL_PAGE, np.int32)
        for i, s in enumerate(seqs):
            w_table[i, :len(s.window_page_ids)] = s.window_page_ids
        # The pages a sequence's queries can see: from the first query's window start on.
        first_seen = np.maximum(starts - window + 1, 0) // page_size
        w_live = live & (np.arange(n_max)[None, :] >= first_seen[:, None])
        assert (w_table[:m][w_live] != NULL_PAGE).all(), "a sliding page the step needs is not held"
        w_slots = np.full(t_max, NULL_PAGE * page_size, np.int32)
        w_slots[:total] = w_table[seq_of_token, pos // page_size] * page_size + pos % page_size
        pages = WindowPages(w_table, w_slots, *_items(w_table, w_live, q_lens, m, shape, page_size))
    return StepInput(
        token_ids=token_ids, src_rows=src_rows, positions=positions, slot_ids=slot_ids, seq_ids=seq_ids, dense=dense,
        kv_lens=kv_lens, last_token=last_token, cu_q_lens=cu, num_seqs=np.array([m], np.int32),
        page_table=page_table, item_pages=item_pages, item_owner=item_owner, item_start=item_start,
        item_bounds=item_bounds, extra_rows=extra_rows, lora_slots=lora_slots, window=pages,
    )


_PENALTY_FREE = (1.0, 0.0, 0.0)


def pack_sampling(rows: list[SamplingRow], shape: StepShape, vocab_size: int,
                  extra: list[SamplingRow] = (), eos_ids=(), scored: list[SamplingRow] = ()) -> SamplingInput:
    """Sampling settings for the step's sequences (row i = sequence i), its scored prompt positions
    (`scored`, the rows after the sequences') and its extra sample positions (`extra`, rows M ..:
    speculation). The token history that the penalties need is filled only for rows that use a penalty;
    it always fits (C = the context limit). `allowed` is all ones but where a row's request narrows it
    (narrow_row: allowed_token_ids, and min_tokens' held-back ends; `eos_ids`: the model's end-of-sequence
    tokens) or a scored position forces its token: the engine writes the constrained rows' masks into it."""
    m, c = shape.rows, shape.history
    assert len(rows) + len(scored) <= shape.seqs and len(extra) <= shape.extra_rows
    out = SamplingInput(
        temperature=np.zeros(m, np.float32), top_k=np.zeros(m, np.int32), top_p=np.ones(m, np.float32),
        min_p=np.zeros(m, np.float32), repetition_penalty=np.ones(m, np.float32),
        presence_penalty=np.zeros(m, np.float32), frequency_penalty=np.zeros(m, np.float32),
        seed=np.zeros((m, 2), np.uint32), counter=np.zeros(m, np.int32),
        history_ids=np.full((m, c), -1, np.int32), history_is_output=np.zeros((m, c), bool),
        logprobs=np.zeros(m, np.int32), pending_col=np.full(m, -1, np.int32),
        allowed=np.full((m, (vocab_size + 31) // 32), -1, np.int32),
        bias_ids=np.full((m, MAX_LOGIT_BIAS), -1, np.int32), bias=np.zeros((m, MAX_LOGIT_BIAS), np.float32),
    )
    _fill(out, 0, rows, c, eos_ids)
    _fill(out, len(rows), list(scored), c, eos_ids)
    _fill(out, shape.seqs, list(extra), c, eos_ids)
    return out


def narrow_row(allowed: np.ndarray, i: int, row: SamplingRow, eos_ids) -> None:
    """Row i of `allowed` narrowed to what `row`'s request allows besides any grammar: only its
    allowed_token_ids, and not yet its stop and end-of-sequence tokens (SamplingParams.held_ends, before
    min_tokens). Each narrowing that would leave nothing (a grammar that can only end, or allows none of
    the allowed ids) is not made: the grammar decides."""
    if not row.samples:
        return
    p = row.params
    words = allowed[i].view(np.uint32)
    if p.allowed_token_ids:
        only = words & _id_mask(p.allowed_token_ids, len(words))
        if only.any():
            words[:] = only
    ends = p.held_ends(eos_ids, len(row.output_ids) + row.pending)
    if ends:
        kept = words.copy()
        for t in ends:
            words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
        if not words.any():
            words[:] = kept


def force_row(allowed: np.ndarray, i: int, token: int) -> None:
    """Row i of `allowed` holds `token` only (a thinking budget's end tag)."""
    words = allowed[i].view(np.uint32)
    words[:] = 0
    words[token >> 5] = np.uint32(1 << (token & 31))


def ban_row(allowed: np.ndarray, i: int, banned) -> None:
    """Row i of `allowed` without the `banned` tokens (a request's bad words' next tokens, jaxcb.host.request.
    banned_tokens); a ban that would leave nothing is not made (a grammar's last choice, say, stays)."""
    words = allowed[i].view(np.uint32)
    kept = words.copy()
    for t in banned:
        words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
    if not words.any():
        words[:] = kept


_ID_MASKS: collections.OrderedDict[int, tuple[tuple, np.ndarray]] = collections.OrderedDict()


def _id_mask(ids: tuple[int, ...], words: int) -> np.ndarray:
    """The bitmask (uint32 words) of `ids`, made once per request's tuple (the last 1,024 kept, more than
    a step's rows: a step would otherwise scan each long list again)."""
    hit = _ID_MASKS.get(id(ids))
    if hit is not None and hit[0] is ids and len(hit[1]) == words:
        _ID_MASKS.move_to_end(id(ids))
        return hit[1]
    bits = np.zeros(words * 32, bool)
    bits[np.asarray(ids, np.int64)] = True
    mask = np.packbits(bits, bitorder="little").view("<u4")  # bit t of word t // 32
    _ID_MASKS[id(ids)] = (ids, mask)
    while len(_ID_MASKS) > 1024:
        _ID_MASKS.popitem(last=False)
    return mask


def pack_chunks(chunks, shape: StepShape, page_size: int, window: int, vocab_size: int, seed_of,
                step_id: int, eos_ids=()) -> tuple[StepInput, SamplingInput, list[SamplingRow]]:
    """One step of the scheduler's chunks (jaxcb.host.scheduler.Chunk, decode rows first) packed: its
    StepInput, its SamplingInput and each chunk's SamplingRow. A decode token still on the device (the
    step `step_id` in flight samples it) is read from that step's output; a chunk with proposals gets
    a sample row at each proposal's position (its `extra_row`, the first of them); a chunk of a prompt
    whose logprobs are wanted, a row forced to the next prompt token at each position it scores (its
    `score_rows`: spare rows, and its own row if its last position is one of them). seed_of(request):
    the request's sampling seed; eos_ids: the model's end-of-sequence tokens (min_tokens holds them back)."""
    specs, rows, extra, scored = [], [], [], []
    for c in chunks:
        r = c.request
        end = c.start + c.num_tokens - len(c.draft)
        pending = end > r.num_known
        seed = seed_of(r)
        if pending:
            assert c.num_tokens == 1 and r.pending_src is not None and r.pending_src[0] == step_id, (
                f"{r.key}: its input token is not in the previous step's output")
            specs.append(SeqSpec([0], c.start, r.page_ids, src_row=r.pending_src[1],
                                 window_page_ids=r.window_page_ids, lora_slot=r.lora_slot))
        else:
            specs.append(SeqSpec(r.token_slice(c.start, end) + list(c.draft), c.start, r.page_ids,
                                 window_page_ids=r.window_page_ids, num_draft=len(c.draft), lora_slot=r.lora_slot))
        forced = -1
        positions = r.positions_to_score(c.start, end)
        if positions:
            spare = range(positions.start, min(positions.stop, end - 1))  # the last position has the chunk's row
            c.score_first = positions.start
            c.score_rows = tuple(range(len(chunks) + len(scored), len(chunks) + len(scored) + len(spare)))
            scored.extend(SamplingRow(r.params, seed, r.prompt_ids, [], samples=False, forced=r.prompt_ids[p + 1])
                          for p in spare)
            specs[-1].num_scored = len(spare)
            if end - 1 in positions:
                forced = r.prompt_ids[end]
                c.score_rows += (len(rows),)
        if c.draft:  # a sample at each proposal's position, as if the proposals before it were output
            c.extra_row = shape.seqs + len(extra)
            extra.extend(SamplingRow(r.params, seed, r.prompt_ids, r.output_ids + list(c.draft[:j]))
                         for j in range(len(c.draft)))
        outputs = r.output_ids + list(c.draft) if c.draft else r.output_ids  # no copy for a plain row
        rows.append(SamplingRow(r.params, seed, r.prompt_ids, outputs, c.samples, pending=pending, forced=forced))
    return (pack(specs, shape, page_size, window), pack_sampling(rows, shape, vocab_size, extra, eos_ids, scored),
            rows)


def _fill(out: SamplingInput, first: int, rows: list[SamplingRow], c: int, eos_ids) -> None:
    """Rows first .. first + len(rows) of `out` from `rows`."""
    n = len(rows)
    if not n:
        return
    params = [r.params for r in rows]
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "logprobs"):
        getattr(out, name)[first:first + n] = [getattr(p, name) for p in params]
    seeds = np.array([r.seed for r in rows], np.uint64)
    out.seed[first:first + n, 0] = (seeds >> np.uint64(32)).astype(np.uint32)
    out.seed[first:first + n, 1] = (seeds & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    out.counter[first:first + n] = [len(r.output_ids) + r.pending for r in rows]
    for i, (row, p) in enumerate(zip(rows, params), start=first):
        if row.forced >= 0:  # a scored prompt position: its next token's logprob, the alternatives' too
            out.temperature[i] = 0.0
            out.logprobs[i] = max(1, p.prompt_logprobs or 0)
            words = out.allowed[i].view(np.uint32)
            words[:] = 0
            words[row.forced >> 5] = np.uint32(1 << (row.forced & 31))
            continue
        if p.min_tokens or p.allowed_token_ids:
            narrow_row(out.allowed, i, row, eos_ids)
        if row.samples and p.logit_bias:
            out.bias_ids[i, :len(p.logit_bias)], out.bias[i, :len(p.logit_bias)] = zip(*p.logit_bias)
        if row.samples and (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) != _PENALTY_FREE:
            n_prompt, n_out = len(row.prompt_ids), len(row.output_ids)
            assert n_prompt + n_out + row.pending <= c, "the token history does not fit the step's window"
            out.history_ids[i, :n_prompt] = row.prompt_ids
            out.history_ids[i, n_prompt:n_prompt + n_out] = row.output_ids
            out.history_is_output[i, n_prompt:n_prompt + n_out + row.pending] = True
            if row.pending:  # filled on the device from the step's input token
                out.pending_col[i] = n_prompt + n_out
