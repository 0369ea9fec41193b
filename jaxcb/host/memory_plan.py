"""How many KV pages fit on the device, decided before anything is allocated.

Plain Python, no JAX. The budget is the device's memory (or one given) times a fraction; from it go
the weights, a reserve for the largest step's temporaries, and the rest is KV pages:

    pages = (budget * fraction - weights - reserve) // bytes per page

Under tensor parallelism over N devices every figure is per device: the weights are split N ways, a
page holds the KV heads of one device (K/N of them, or one copy of a replicated head when N > K),
and the step's temporaries are those of one device's heads and columns. Every device holds the same
number of pages (page p spans all devices).

A configuration that cannot hold even one request of the maximum context next to the largest step is
refused with the numbers, before the engine allocates a byte.
"""

from __future__ import annotations

import dataclasses
import re

from jaxcb.host.errors import InvalidConfig
from jaxcb.host.lora import check_targets
from jaxcb.host.window import sliding_pages_per_chunk

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'80GiB', '80 GB', '512MiB', '1e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidConfig(f"memory: {text!r} is not a size like 80GiB, 24GB or 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int  # memory the engine may use: device (or given) memory x fraction
    weight_bytes: int
    reserve_bytes: int  # temporaries of the largest step (activations, attention blocks, logits)
    kv_bytes_per_token: int  # keys and values of one token, all layers
    page_size: int
    num_pages: int  # pages that fit, the null page included
    tensor: int = 1  # devices the model is split over; every byte figure above is per device
    kv_replication: int = 1  # copies of each KV head on the mesh (tensor > KV heads)
    # Models with sliding-window layers (jaxcb.host.window): their pages are a second group. Then
    # kv_bytes_per_token and num_pages are the full-attention layers' and these the sliding layers'.
    window: int = 0  # keys a sliding layer sees; 0: no sliding group
    window_bytes_per_token: int = 0
    num_window_pages: int = 0  # the null page included
    kv_bytes_per_token_all: int = 0  # every layer's: what a page would cost with no group of its own
    # Speculative decoding's draft model (jaxcb.host.draft), counted in the figures above: its weights
    # (those it does not share with the target) and its keys and values of a token in the same pages.
    draft_weight_bytes: int = 0
    draft_kv_bytes_per_token: int = 0
    lora_bytes: int = 0  # LoRA adapter slots (jaxcb.device.lora), counted in weight_bytes

    @property
    def page_bytes(self) -> int:
        return self.kv_bytes_per_token * self.page_size

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_bytes + self.num_window_pages * self.window_bytes_per_token * self.page_size

    def window_pages_held(self, context: int) -> int:
        """Sliding pages a decoding sequence of `context` tokens holds: those its window touches."""
        return min(-(-context // self.page_size), -(-self.window // self.page_size) + 1)

    def max_batch_at(self, context: int) -> int:
        """Requests of `context` tokens that fit in the pages at once."""
        full = (self.num_pages - 1) // -(-context // self.page_size)
        if not self.window:
            return full
        return min(full, (self.num_window_pages - 1) // self.window_pages_held(context))

    def max_batch_without_window(self, context: int) -> int:
        """The same if every layer kept every page (no group of its own for the sliding layers)."""
        pages = self.kv_bytes // (self.kv_bytes_per_token_all * self.page_size)
        return (pages - 1) // -(-context // self.page_size)

    def describe(self, contexts=(512, 2048, 8192)) -> str:
        lines = [f"tensor parallel {self.tensor}: every figure below is per device"] if self.tensor > 1 else []
        if self.kv_replication > 1:
            lines.append(f"KV heads replicated: {self.tensor} devices outnumber the KV heads, each head is held "
                         f"{self.kv_replication} times (one copy per device)")
        lines += [
            f"budget        {fmt_bytes(self.budget_bytes)}",
            f"weights       {fmt_bytes(self.weight_bytes)}",
            f"step reserve  {fmt_bytes(self.reserve_bytes)}",
            f"KV per token  {fmt_bytes(self.kv_bytes_per_token)} ({fmt_bytes(self.page_bytes)} per page of "
            f"{self.page_size} tokens)",
            f"KV pages      {self.num_pages} = {fmt_bytes(self.num_pages * self.page_bytes)}, "
            f"{(self.num_pages - 1) * self.page_size} tokens cached",
        ]
        if self.lora_bytes:
            lines.insert(-3, f"  of which LoRA adapter slots: {fmt_bytes(self.lora_bytes)}")
        if self.draft_weight_bytes or self.draft_kv_bytes_per_token:
            lines.insert(-3, f"  of which the draft model's: weights {fmt_bytes(self.draft_weight_bytes)}, KV "
                             f"{fmt_bytes(self.draft_kv_bytes_per_token)} per token")
        if self.window:
            lines[-2] = lines[-2].replace("KV per token ", "KV per token (full-attention layers)")
            lines.append(
                f"sliding pages {self.num_window_pages} = "
                f"{fmt_bytes(self.num_window_pages * self.window_bytes_per_token * self.page_size)} "
                f"({fmt_bytes(self.window_bytes_per_token)} per token; window {self.window}: a sequence holds at "
                f"most {self.window_pages_held(1 << 30)} pages, the rest go back as it decodes)")
        for c in contexts:
            extra = (f" ({self.max_batch_without_window(c)} if the sliding layers kept every page)"
                     if self.window else "")
            lines.append(f"largest batch at context {c}: {self.max_batch_at(c)}{extra}")
        return "\n".join(lines)


def plan(*, budget_bytes: int, fraction: float, weight_bytes: int, num_layers: int, num_kv_heads: int,
         head_dim: int, hidden_size: int, intermediate_size: int, vocab_size: int, dtype_bytes: int,
         page_size: int, max_context: int, max_batch: int, max_prefill_tokens: int,
         num_pages: int | None = None, num_heads: int | None = None, tensor: int = 1,
         sliding_layers: int = 0, window: int = 0, kv_dtype: str = "auto", dequant_bytes: int = 0,
         extra_rows: int = 0, draft_weight_bytes: int = 0, draft_kv_per_token: int = 0,
         draft_window_per_token: int = 0) -> MemoryPlan:
    """The plan for these sizes (the whole model's; `tensor` devices split it), per device; num_pages
    None = as many as fit, else check that many fit. Raises ValueError with the numbers when one
    request of max_context cannot be held. `draft_*`: a draft model's weights (included in
    weight_bytes) and its keys and values per token in the full-attention and sliding pages."""
    if not 0 < fraction <= 1:
        raise InvalidConfig(f"cache.memory_fraction: must be in (0, 1], got {fraction}")
    replication = max(1, tensor // num_kv_heads)
    kv_heads = num_kv_heads * replication // tensor  # per device
    weight_bytes = -(-weight_bytes // tensor)
    heads = (num_heads or max(1, hidden_size // head_dim)) // tensor
    intermediate_size //= tensor
    layer_token = 2 * kv_heads * kv_slot_bytes(head_dim, kv_dtype, dtype_bytes)  # one layer's keys and values of one token
    window = window if sliding_layers else 0
    kv_per_token = (num_layers - (sliding_layers if window else 0)) * layer_token + draft_kv_per_token
    pages_per_seq = -(-max_context // page_size)
    # A sliding layer's sequence holds the pages its window and one prefill chunk touch.
    window_per_seq = min(pages_per_seq, sliding_pages_per_chunk(window, page_size, max_prefill_tokens)) if window else 0
    # The largest step's temporaries, an upper estimate. The step is one packed batch of up to
    # max_batch decode tokens and max_prefill_tokens prompt tokens: its activations, the plain-JAX
    # attention's working set for one layer (a block of 256 pages of keys and values in float32, and the
    # prefill scores of every token against a 256-key block; the pages themselves are read in place,
    # never copied whole), and the float32 logits with the sampler's sorted copies.
    tokens = max_batch + max_prefill_tokens
    attention = 256 * page_size * 2 * kv_heads * head_dim * 4 + 3 * tokens * heads * 256 * 4
    activations = tokens * (4 * hidden_size + 3 * intermediate_size) * 4
    logits = (max(max_batch, 1) + extra_rows) * vocab_size * 4 * 4  # extra rows: speculation's proposals
    # Quantized weights: the step dequantizes one layer's matrices next to their dots (dequant_bytes,
    # the two largest in the compute dtype), split like the weights.
    reserve = attention + activations + logits + dequant_bytes // tensor
    usable = int(budget_bytes * fraction) - weight_bytes - reserve
    page_bytes = kv_per_token * page_size
    # With a sliding group, both groups are sized for the same number of max-context sequences (each
    # full page comes with window_per_seq / pages_per_seq sliding pages), and the sliding group holds at
    # least what a full batch of sequences shorter than the window needs (each holds as many sliding
    # pages as full ones, up to window_per_seq): for short requests the sliding group never runs out
    # before the full pages or the batch do.
    window_token = sliding_layers * layer_token + draft_window_per_token if window else 0
    window_page_bytes = window_token * page_size

    def window_pages_for(pages: int) -> int:
        if not window:
            return 0
        proportional = -(-(pages - 1) * window_per_seq // pages_per_seq)
        return max(window_per_seq, proportional, min(pages - 1, max_batch * window_per_seq)) + 1

    fit = max(0, int(usable // (page_bytes + window_page_bytes * window_per_seq / pages_per_seq)))
    if window:  # the largest page count whose two groups fit (the batch floor can lower the proportional fit)
        low, high = 0, fit
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if mid * page_bytes + window_pages_for(mid) * window_page_bytes <= usable else (low, mid - 1)
        fit = low
    need = pages_per_seq + 1  # one request of the maximum context, and the null page
    if fit < need or (num_pages is not None and num_pages > fit):
        wanted = need if num_pages is None or num_pages < need else num_pages
        where = f" per device at tensor parallel {tensor}" if tensor > 1 else ""
        raise InvalidConfig(
            f"memory{where}: {fmt_bytes(budget_bytes)} x {fraction:g} = {fmt_bytes(budget_bytes * fraction)} holds the "
            f"weights ({fmt_bytes(weight_bytes)}) and the largest step ({fmt_bytes(reserve)}: batch {max_batch}, "
            f"{max_prefill_tokens}-token prefill) with room for {fit} KV pages of {fmt_bytes(page_bytes)}, but "
            f"{wanted} are needed ({'cache.num_pages' if num_pages else f'one request of {max_context} tokens + the null page'}); "
            f"lower the context, batch or page count, or give more memory")
    pages = fit if num_pages is None else num_pages
    window_pages = window_pages_for(pages)
    return MemoryPlan(budget_bytes, weight_bytes, reserve, kv_per_token, page_size, pages, tensor, replication,
                      window, window_token, window_pages,
                      num_layers * layer_token + draft_kv_per_token + draft_window_per_token, draft_weight_bytes,
                      draft_kv_per_token + draft_window_per_token)


INT4_GROUP = 32  # int4 weights: input rows per scale (jaxcb.model.quant takes it from here)
ROW_GROUP = 32  # the int8 embedding's values per scale along a row (likewise)


def kv_slot_bytes(head_dim: int, kv_dtype: str, dtype_bytes: int) -> int:
    """Bytes of one token's keys (or values) of one head in the pages: `dtype_bytes` a value for
    "auto", int8's a byte a value and a float32 scale (jaxcb.model.paged_attention.kv_slot_width)."""
    if kv_dtype == "int8":
        return head_dim + 4
    return head_dim * {"float32": 4, "bfloat16": 2}.get(kv_dtype, dtype_bytes)


def weight_bytes(c, mode: str, dtype_bytes: int, group: int = 0) -> int:
    """Bytes of a model's (a ModelConfig's) weights stored in `mode` (jaxcb.model.quant): "auto"
    `dtype_bytes` a value, float32 four bytes; bfloat16 two bytes a value of the layers' matrices and
    the embedding, the rest `dtype_bytes`; int8 one byte a value of every matrix and the
    embedding, plus a scale (`dtype_bytes`) per output column or per `group` values of one, and per
    32 values of an embedding row; int4 half a byte a value of the layers' matrices plus a float16 scale and offset per
    `group` (default 32) values, the embedding and head as in int8. Norms and biases in `dtype_bytes`."""
    e = c.hidden_size
    # (how many, in, out) of each of the layers' matrices: one a layer, an expert's one an expert a layer
    # (= jaxcb.model.quant.MATRICES and EXPERTS; this module imports no JAX); the router is of the rest
    shapes = c.weight_shapes()
    matrices = [(shape[0] * (shape[1] if len(shape) == 4 else 1), *shape[-2:]) for n, shape in shapes.items()
                if n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "dense_gate", "dense_up", "dense_down",
                         "wq_a", "wq_b", "wkv_a", "experts_gate", "experts_up", "experts_down")]
    values = sum(n * i * o for n, i, o in matrices)
    if mode == "bfloat16":  # the matrices and the embedding; the rest in the compute dtype (float32 on the CPU)
        embed = c.vocab_size * e
        return int((values + embed) * 2 + (c.num_params - values - embed) * dtype_bytes)
    if mode not in ("int8", "int4"):
        return c.num_params * {"float32": 4}.get(mode, dtype_bytes)
    if mode == "int8":
        scales = sum(n * (i // group if group else 1) * o for n, i, o in matrices)
        stored = values + scales * dtype_bytes
    else:
        stored = values // 2 + sum(n * (i // (group or INT4_GROUP)) * o for n, i, o in matrices) * 2 * 2
    row_scales = e // ROW_GROUP if e % ROW_GROUP == 0 else 1
    embed = c.vocab_size * (e + row_scales * dtype_bytes)  # int8, a scale per 32 values of a row
    head = 0 if c.tie_embeddings else c.vocab_size * (e + dtype_bytes)  # an untied head: int8 per column
    rest = c.num_params - values - c.vocab_size * e * (1 if c.tie_embeddings else 2)
    return int(stored + embed + head + rest * dtype_bytes)


def draft_bytes(draft, model, config, mode: str, dtype_bytes: int, tensor: int = 1) -> tuple[int, int, int]:
    """(weight bytes, KV bytes per token per device in the full pages, in the sliding pages) of
    speculative decoding's draft model `draft` (a ModelConfig) for target `model`, split over `tensor`
    devices as the target is (its KV heads replicated where the devices outnumber them). A draft made
    of the target's own weights (no draft_model, draft_weights "auto") shares the embedding and head,
    and with every layer all of it."""
    spec = config.scheduler.speculative
    kv_dtype = getattr(config, "kv_dtype", "auto")
    kv_heads = draft.num_kv_heads * max(1, tensor // draft.num_kv_heads) // tensor
    token = 2 * kv_heads * kv_slot_bytes(draft.head_dim, kv_dtype, dtype_bytes)
    if not spec.draft_model and spec.draft_weights == "auto":
        layers = model.num_layers - draft.num_layers  # weight bytes are affine in the layer count
        full = weight_bytes(model, mode, dtype_bytes, config.weight_group)
        per_layer = (full - weight_bytes(draft, mode, dtype_bytes, config.weight_group)) / layers if layers else 0
        weights = int(per_layer * draft.num_layers) if layers else 0
    else:
        weights = weight_bytes(draft, spec.draft_weights if spec.draft_weights != "auto" else mode, dtype_bytes)
    return weights, token * draft.num_full_layers, token * draft.num_sliding_layers


def lora_slot_bytes(model, lora, dtype_bytes: int) -> int:
    """Bytes of the LoRA adapter slots (jaxcb.device.lora) of `lora` (a LoraConfig) for a ModelConfig:
    per slot and target, A [L, in, R] and B [L, R, out]."""
    if not lora.enabled:
        return 0
    shapes = model.adapter_shapes()
    check_targets(lora.targets, shapes)
    per_slot = sum((shapes[t][1] + shapes[t][2]) * lora.max_rank for t in lora.targets) * model.num_layers
    return lora.max_loras * per_slot * dtype_bytes


def plan_for_model(model, config, *, budget_bytes: int, dtype_bytes: int, max_context: int | None = None,
                   tensor: int | None = None, weights: str | None = None, draft=None) -> MemoryPlan:
    """The plan for a model (a ModelConfig) under an EngineConfig: what the engine sizes its cache with
    (jaxcb.device.factory.plan_memory) and what `jaxcb plan` prints. `max_context` / `tensor` / `weights`
    override the config's; `draft`: speculative decoding's draft model (a ModelConfig), whose weights and
    KV are counted too."""
    s, c = config.scheduler, model
    mode = config.weights if weights is None else weights
    tensor = config.tensor_parallel if tensor is None else tensor
    d_weights, d_kv, d_window = (draft_bytes(draft, model, config, mode, dtype_bytes, tensor) if draft is not None
                                 else (0, 0, 0))
    lora = lora_slot_bytes(model, config.lora, dtype_bytes) if hasattr(config, "lora") else 0
    result = plan(
        draft_weight_bytes=d_weights, draft_kv_per_token=d_kv, draft_window_per_token=d_window,
        budget_bytes=budget_bytes, fraction=config.memory_fraction,
        weight_bytes=weight_bytes(c, mode, dtype_bytes, config.weight_group) + d_weights + lora,
        num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, hidden_size=c.hidden_size,
        intermediate_size=max(c.intermediate_size, c.dense_size), vocab_size=c.vocab_size, dtype_bytes=dtype_bytes,
        page_size=s.page_size, max_context=max_context or config.max_context_for(c),
        max_batch=config.buckets.max_batch, max_prefill_tokens=s.max_prefill_tokens,
        num_pages=config.num_pages or None, num_heads=c.num_heads, tensor=tensor,
        sliding_layers=c.num_sliding_layers, window=c.sliding_window, kv_dtype=getattr(config, "kv_dtype", "auto"),
        dequant_bytes=2 * c.hidden_size * max(c.intermediate_size, c.dense_size, c.num_heads * c.head_dim) * dtype_bytes
        if mode in ("int8", "int4") else 0, extra_rows=s.speculative.extra_rows)
    return dataclasses.replace(result, lora_bytes=-(-lora // result.tensor))