"""The device side of a step: params and KV pages on the accelerator, two jitted programs a step.

    kv_pages, logits, newest, pooled = forward_step(params, kv_pages, last_tokens, batch)   # one per step shape
    sampled, last_tokens = sample_step(logits, newest, last_tokens, sampling)      # one per row count

The forward pass is compiled for each step shape; the sampler only for each number of sampled rows
(and history length), shared by the step shapes that have them: compiled into every step program it
was most of the compile time of a small model's warm-up (jaxcb.device.export exports both). Both are
pure; the KV pages are donated so the cache is updated in place. `ModelRunner` owns the device state,
turns padded numpy batches into device arrays, dispatches asynchronously and counts XLA compilations
(which must stay flat after warm-up).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np

from jaxcb.device.sampling import SampleOutput, sample
from jaxcb.host.batch import SamplingInput, StepInput, StepShape, pack, pack_sampling
from jaxcb.host.errors import InvalidConfig, InvalidRequest
from jaxcb.host.runner_protocol import Runner
from jaxcb.model.config import ModelConfig
from jaxcb.model.llama import Attention, Params, forward_hidden, logits_at, rms_norm
from jaxcb.model.paged_attention import allocate_kv_pages

log = logging.getLogger("jaxcb.device.runner")

_compile_lock = threading.Lock()
_compilations = 0
# One XLA compilation at a time in this process: data-parallel replicas compile on their own threads,
# and on the CPU two threads compiling the same step at once crashed the process once (a segfault
# inside XLA's compile, in CI). Compiling is CPU-bound, so little is lost.
_compile_serial = threading.Lock()
# XLA options per EngineConfig.compile, given to each step's compilation (and part of its cache key).
# "fast": no LLVM optimisation and XLA:CPU's older loop emitters instead of its MLIR fusion emitters; on
# the 2-core CPU a tiny model's step compiles 2.6x faster (5.5 s -> 2.1 s for three shapes), while a real
# model's steps run about 3x slower (SmolLM2: 5.2 s -> 17 s of generation), with the same tokens.
# On the CPU "optimized" spells out XLA's defaults, so that it holds in a process that turned optimisation
# down for everything else (JAX_DISABLE_MOST_OPTIMIZATIONS, XLA_FLAGS; the test suite does, for its own
# small programs).
COMPILER_OPTIONS = {"optimized": {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False,
                                  "xla_cpu_use_fusion_emitters": True},
                    "fast": {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}}


def _count_compile(name, *args, **kwargs):
    global _compilations
    if name == "/jax/core/compile/backend_compile_duration":
        with _compile_lock:
            _compilations += 1


def _count_cache_load(name, *args, **kwargs):
    """A program loaded from the persistent compile cache instead of compiled: counted as a compilation
    too, so that "nothing compiled after warm-up" also means nothing new was loaded after it."""
    global _compilations
    if name == "/jax/compilation_cache/cache_hits":
        with _compile_lock:
            _compilations += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)
jax.monitoring.register_event_listener(_count_cache_load)


def compilation_count() -> int:
    """XLA programs this process compiled or loaded from the compile cache so far (all functions, all
    runners)."""
    return _compilations


def _forward(params: Params, kv_pages, last_tokens: jax.Array, batch: StepInput, lora=None, *,
             config: ModelConfig, attention: Attention = Attention()):
    """The model's part of a step. `last_tokens` [L] are the previous step's sampled tokens: a decode
    token the host has not fetched yet (async scheduling) is taken from there (batch.src_rows).
    `lora`: the LoRA adapter slots (jaxcb.device.lora), or None. Returns the new KV pages, the logits
    of the sampled rows [M + E, V] and each row's newest input token [M + E] (its place in the
    penalties' history when the host has not seen it), and what embeddings pool of the final norm's output
    (f32 [M, E] at each sequence's last row, f32 [M, E] summed over its rows; jaxcb.host.embedding)."""
    from_prev = batch.src_rows >= 0
    token_ids = jnp.where(from_prev, last_tokens[jnp.maximum(batch.src_rows, 0)], batch.token_ids)
    batch = dataclasses.replace(batch, token_ids=token_ids)
    m, e = batch.last_token.shape[0], batch.extra_rows.shape[0]
    newest = jnp.pad(token_ids[batch.last_token], (0, e))  # extra rows never wait for a token
    kv_pages, h = forward_hidden(params, kv_pages, batch, config, attention, lora)
    t = batch.token_ids.shape[0]

    if not e:
        logits = logits_at(params, h, batch.last_token, config, attention)
    elif t <= m + e:
        # A verifying program (a step with proposals; jaxcb.host.buckets): logits at the extra rows too.
        # In a small bucket the head runs once over every token row (fewer rows than M + E), and the
        # sampled rows are gathered from it. (One program choosing between the two by a lax.cond cost
        # XLA:CPU 5-7% of every step without proposals.)
        every = logits_at(params, h, jnp.arange(t), config, attention)
        logits = jnp.concatenate([every[batch.last_token], every[jnp.maximum(batch.extra_rows, 0)]])
    else:
        logits = logits_at(params, h, jnp.concatenate([batch.last_token, jnp.maximum(batch.extra_rows, 0)]),
                           config, attention)
    normed = rms_norm(h, params.final_norm, config.rms_norm_eps, config.norm_plus_one).astype(jnp.float32)  # [T, E]
    pooled = (normed[batch.last_token], jax.ops.segment_sum(normed, batch.seq_ids, num_segments=m + 1)[:m])
    return kv_pages, logits, newest, pooled


def _sample(logits, newest, last_tokens: jax.Array, sampling: SamplingInput, *, seqs: int,
            logprobs_mode: str = "raw_logprobs"):
    """The sampler's part of a step: the newest tokens into the penalties' history, one token for each
    of the logits' rows, and the new last_tokens (the first `seqs` rows' tokens, zeros after)."""
    rows = jnp.arange(logits.shape[0])
    col = jnp.maximum(sampling.pending_col, 0)
    history = sampling.history_ids.at[rows, col].set(
        jnp.where(sampling.pending_col >= 0, newest, sampling.history_ids[rows, col]))
    out = sample(logits, dataclasses.replace(sampling, history_ids=history), logprobs_mode)
    last_tokens = jax.lax.dynamic_update_slice(jnp.zeros_like(last_tokens), out.token_ids[:seqs], (0,))
    return out, last_tokens


def _host_copy(tree):
    """Device arrays to host ones. Across processes (multi-host) a step's outputs are replicated over the
    mesh: this process reads its own copy."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def step_functions(logprobs_mode: str = "raw_logprobs"):
    """The step's two jitted functions, made afresh for each runner: jax keeps the traces, lowerings and
    executables of a jitted function in caches keyed weakly on the Python function, so a runner's programs
    go when the runner does (module-level functions kept every program of every engine a process ever
    built: ~740 memory maps each, see tests/conftest.py)."""
    forward_step = jax.jit(functools.partial(_forward), static_argnames=("config", "attention"), donate_argnums=(1,))
    sample_step = jax.jit(functools.partial(_sample, logprobs_mode=logprobs_mode), static_argnames=("seqs",))
    return forward_step, sample_step


def _sampler_key(shape: StepShape) -> tuple[int, int, int]:
    """What the sampler's program depends on: the rows it samples and the history the penalties see."""
    return shape.seqs, shape.extra_rows, shape.history


def keep_freed_memory_on_cpu() -> bool:
    """On the CPU, have glibc's allocator keep freed memory for reuse instead of returning it to the OS.

    Every step allocates fresh intermediates of tens of MB (gathered pages, activations); by default
    glibc serves each from a new mmap and unmaps it afterwards, so every step pays a page fault per
    4 KiB touched. Measured here, that made gathering KV pages 5x slower (2.7 vs 13 GB/s). A server
    that runs the same steps over and over gains by keeping that memory mapped.
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    ok = libc.mallopt(m_mmap_threshold, 1 << 30) == 1
    ok &= libc.mallopt(m_trim_threshold, 2**31 - 1) == 1
    ok &= libc.mallopt(m_top_pad, 64 << 20) == 1
    return bool(ok)


PALLAS_KERNEL = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}  # platform -> Attention.kernel


def runs_pallas(choice: str, platform: str | None = None) -> bool:
    """Whether the engine config's `attention` runs the Pallas kernels on `platform` (default: this one): told
    without building the CPU's native kernels, as resolve_attention decides it."""
    return choice == "pallas" or (choice == "auto" and (platform or jax.default_backend()) in PALLAS_KERNEL)


def resolve_attention(choice: str, mesh=None) -> Attention:
    """The engine config's `attention` for this platform.

    "xla": the plain-JAX reference everywhere. "native": on the CPU, the step's attention, and on one
    device its float32 layer matmuls (with "auto": where the CPU has AVX-512), in the C++ kernels
    (kernels_cpu; an error where they cannot be built). "pallas": the Pallas kernels of the platform (on the CPU, the GPU kernel in interpret mode: for tests, slow). "auto": the
    Pallas kernels on GPU/TPU; on the CPU the native kernel when it builds, else the plain-JAX path.
    """
    platform = jax.default_backend()
    kernel = PALLAS_KERNEL.get(platform)
    if kernel is not None:  # a GPU or TPU: its experts grouped (llama.experts), whichever attention runs
        return dataclasses.replace(_resolve_attention(choice, mesh, platform, kernel), grouped_experts=True)
    return _resolve_attention(choice, mesh, platform, kernel)


def _resolve_attention(choice: str, mesh, platform: str, kernel: str | None) -> Attention:
    if choice == "native" or (choice == "auto" and kernel is None):
        import kernels_cpu

        if kernel is None and kernels_cpu.available():
            # "auto" takes the native matmul only where it beats XLA's dot (AVX-512); "native" always
            return Attention("cpu", mesh=mesh, native_matmul=mesh is None and (choice == "native" or kernels_cpu.matmul_pays()))
        if choice == "native":
            why = kernels_cpu.unavailable_reason() if kernel is None else f"the {platform} backend is not the CPU"
            raise InvalidConfig(f"attention: 'native' is not available here ({why})")
        return Attention("xla", mesh=mesh)
    if choice == "xla":
        return Attention("xla", mesh=mesh)
    if runs_pallas(choice, platform):
        return Attention(kernel or "gpu", interpret=kernel is None, mesh=mesh)
    raise InvalidConfig(f"attention: {choice!r} is not one of 'xla', 'native', 'pallas', 'auto'")


class ModelRunner(Runner):
    def __init__(self, config: ModelConfig, params: Params, num_pages: int, page_size: int, dtype=None,
                 attention: str = "auto", max_seqs: int = 256, mesh=None, num_window_pages: int | None = None,
                 kv_dtype=None, compile: str = "optimized", lora=None, release_params: bool = False,
                 logprobs_mode: str = "raw_logprobs"):
        if jax.default_backend() == "cpu":
            keep_freed_memory_on_cpu()
        self.mesh = mesh  # tensor parallelism (jaxcb.device.parallel); None = the default device
        self.attention = resolve_attention(attention, mesh)
        self._compiled: dict[StepShape, tuple] = {}  # step shape -> its compiled (forward pass, sampler)
        self._samplers: dict[tuple, object] = {}  # (seqs, extra rows, history, logits' and newest's shardings) -> sampler
        self._forward_step, self._sample_step = step_functions(logprobs_mode)
        self.compiler_options = COMPILER_OPTIONS[compile]
        if jax.default_backend() != "cpu":
            self.compiler_options = None  # XLA's defaults as they are: the options above are XLA:CPU's
        self.model_config = config  # the model as loaded
        self.kv_replication = 1
        if mesh is not None:
            from jaxcb.device import parallel

            tensor = mesh.shape[parallel.AXIS]
            self.kv_replication = parallel.kv_replication(config, tensor)
            if self.kv_replication > 1:
                log.info("tensor parallel %d over %d KV heads: each KV head is replicated %d times, one copy per "
                         "device", tensor, config.num_kv_heads, self.kv_replication)
            config, params = parallel.replicate_kv_heads(config, params, tensor)
        self.step_config = config  # the layout the step runs (KV heads replicated onto the mesh if needed)
        self.dtype = dtype or params.compute_dtype
        # The KV pages' dtype: the compute dtype, or cache.kv_dtype (int8: values and a scale per
        # token and head, jaxcb.model.paged_attention.quantize_kv).
        self.kv_dtype = jnp.dtype(kv_dtype or self.dtype)
        self.page_size = page_size
        self.num_pages = num_pages
        # The sliding layers' page group (jaxcb.host.window); by default as many pages as the full layers'.
        self.num_window_pages = (num_window_pages or num_pages) if config.windowed else 0
        if mesh is not None:
            from jaxcb.device import parallel

            params = parallel.shard_params(params, mesh)
        if self.attention.native_matmul:  # float32 stacks in the native matmul's blocks (kernels_cpu.block_stack)
            from jaxcb.model.quant import blocked_layers

            params = blocked_layers(params, release=release_params)  # (the unblocked stacks freed: the caller's only)
        self.params = params
        self._abstract = None  # (the weights' shapes, _weights_shape) and, asleep with them offloaded, their host copy
        self._host_params = None
        # LoRA adapter slots (jaxcb.device.lora), `lora` = (targets, slots, max rank); None: no adapters
        self.lora = None
        if lora is not None and lora[1] > 0:
            from jaxcb.device.lora import LoraSlots

            self.lora = LoraSlots(config, lora[0], lora[1], lora[2], self.dtype, mesh)
        self.last_tokens = self._zero_last_tokens(max_seqs)  # the previous step's sampled tokens, on the device
        self.kv_pages = self._allocate_kv()
        # Where this runner lives, read once: the page arrays themselves are donated to every step, so
        # another thread reading them (GetServerInfo) could meet a deleted array.
        devices = self.kv_arrays[0].devices()
        self.device_ids = sorted(d.id for d in devices)
        self.platform = next(iter(devices)).platform
        # The weights in 2 MiB pages, collapsed while the server starts (jaxcb.device.huge_pages; the KV pages
        # once the warm-up is done, warmed_up). The threads started, for wait_for_huge_pages.
        self.huge_pages: list = []
        self._kv_collapsed = False
        self._collapse(self.params, "weights")

    def warmed_up(self) -> None:
        """The KV pages into huge pages, now that the engine's shapes are compiled: collapsing SmolLM2's
        2.9 GB pool beside the compiles held the warm-up back (17 shapes in 15 s -> 22 s, 2-core Zen 4)."""
        if not self._kv_collapsed:
            self._kv_collapsed = True
            self._collapse(self.kv_pages, "KV pages")

    def wait_for_huge_pages(self, timeout: float | None = None) -> None:
        """Until every collapse started so far is done (benchmarks time the memory a running server has)."""
        for thread in self.huge_pages:
            thread.join(timeout)

    def _collapse(self, tree, what: str) -> None:
        if self.platform != "cpu":
            return
        from jaxcb.device import huge_pages

        thread = huge_pages.collapse_in_background(tree, what)
        if thread is not None:
            self.huge_pages.append(thread)

    def _zero_last_tokens(self, max_seqs: int) -> jax.Array:
        zeros = np.zeros(max_seqs, np.int32)
        if self.mesh is None:
            return jnp.asarray(zeros)
        from jaxcb.device import parallel

        return parallel.place(zeros, parallel.replicated(self.mesh))

    def _allocate_kv(self):
        """The page array [L, 2, K, P, S, D]; with sliding layers a pair (full layers' [Lf, ..., P, ...],
        sliding layers' [Ls, ..., P_window, ...])."""
        c = self.step_config
        groups = [(c.num_full_layers, self.num_pages)]
        if c.windowed:
            groups.append((c.num_sliding_layers, self.num_window_pages))
        arrays = []
        for layers, pages in groups:
            shape = (layers, c.num_kv_heads, pages, self.page_size, c.head_dim, self.kv_dtype)
            if self.mesh is None:
                kv = allocate_kv_pages(*shape)
                # One KV head: stored without its size-1 axis, which made XLA copy the cache every
                # layer (jaxcb.model.llama._with_head_axis).
                arrays.append(kv.reshape(kv.shape[:2] + kv.shape[3:]) if c.num_kv_heads == 1 else kv)
                continue
            from jaxcb.device import parallel  # allocated split over the devices, never whole on one

            arrays.append(jax.jit(allocate_kv_pages, static_argnums=range(6),
                                  out_shardings=parallel.kv_sharding(self.mesh))(*shape))
        return tuple(arrays) if c.windowed else arrays[0]

    @property
    def kv_arrays(self) -> list[jax.Array]:
        """The page arrays (one, or two with sliding layers)."""
        return jax.tree.leaves(self.kv_pages)

    def reset_kv_if_lost(self) -> bool:
        """After a failed step: if the KV pages were consumed (donated to the failed call) or hold an
        error (a device failure leaves the step's outputs in an error state), their contents are
        unknown: allocate fresh ones, and fresh last tokens (True)."""
        lost = any(a.is_deleted() for a in self.kv_arrays)
        if not lost:
            try:
                for a in self.kv_arrays:
                    a.block_until_ready()
                self.last_tokens.block_until_ready()
            except Exception:  # noqa: BLE001 - an error-carrying buffer: its state is unknown
                lost = True
        if not lost:
            return False
        self.kv_pages = self._allocate_kv()
        self._collapse(self.kv_pages, "new KV pages")
        self.last_tokens = self._zero_last_tokens(self.last_tokens.shape[0])
        return True

    def prepare_params(self, params: Params, release: bool = False, private: bool = False) -> Params:
        """New weights made as this runner made its own (KV heads repeated onto the mesh, split over it, blocked
        for the native matmul) and put where its own are: refused, naming the first difference, unless every
        array has the shape and dtype of the one it replaces (then no step compiles again). Any thread; the step
        takes them at use_params. `release`: nobody else reads `params` (what is rewritten is freed); `private`:
        the caller keeps using its arrays (each is copied, never served as it is)."""
        if self.mesh is not None:
            from jaxcb.device import parallel

            _, params = parallel.replicate_kv_heads(self.model_config, params, self.mesh.shape[parallel.AXIS])
            params = parallel.shard_params(params, self.mesh)
        if self.attention.native_matmul:
            from jaxcb.model.quant import blocked_layers

            params = blocked_layers(params, release=release)
        served = self._weights_shape()
        new, new_tree = jax.tree_util.tree_flatten_with_path(params)
        old, old_tree = jax.tree_util.tree_flatten_with_path(served)
        if new_tree != old_tree:
            names = lambda leaves: {jax.tree_util.keystr(k) for k, _ in leaves}  # noqa: E731
            differ = sorted(names(new) ^ names(old)) or ["the arrays' layout"]
            raise InvalidRequest(f"weights: not the served model's arrays (they differ at {', '.join(differ[:4])})")
        for (path, a), (_, b) in zip(new, old):
            if tuple(a.shape) != tuple(b.shape) or jnp.dtype(a.dtype) != jnp.dtype(b.dtype):
                raise InvalidRequest(f"weights: {jax.tree_util.keystr(path)} is {jnp.dtype(a.dtype).name}"
                                     f"{list(a.shape)}, the served model's {jnp.dtype(b.dtype).name}{list(b.shape)}")
        return jax.tree.map(lambda a, b: jax.device_put(a, b.sharding, may_alias=False if private else None),
                            params, served)

    def use_params(self, params: Params) -> None:
        """Step on `params` (made by prepare_params) from the next step on; the old ones are dropped (a sleeping
        runner's too: these are resident)."""
        self.params, self._host_params = params, None
        self._collapse(self.params, "new weights")

    # ---- sleep (vLLM's sleep mode: the device's memory lent to a trainer between rollouts) ----
    def _weights_shape(self):
        """The weights' arrays as shapes, dtypes and placements (what new ones must match; kept while asleep)."""
        if self.params is not None:
            self._abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                          self.params)
        return self._abstract

    @property
    def asleep(self) -> set[str]:
        """What is not on the devices: "weights", "kv_cache"."""
        return {part for part, gone in (("weights", self.params is None), ("kv_cache", self.kv_pages is None)) if gone}

    def release(self, weights: str | None) -> None:
        """Free the devices' memory (the engine is still): the KV pages dropped, and the weights copied to the host
        first ("offload") or dropped ("discard"; None: kept)."""
        self._weights_shape()
        self.kv_pages = None
        if weights == "discard":  # (asleep already with a host copy: dropped too)
            self._host_params = None
        if weights is not None and self.params is not None:
            # (copies the host owns: on the CPU a device_get may be a view that keeps the device's buffer)
            self._host_params = (jax.tree.map(lambda a: np.array(a, copy=True), self.params) if weights == "offload"
                                 else None)
            self.params = None
        if self.platform == "cpu":  # (freed, the memory goes back to the system: keep_freed_memory_on_cpu keeps it)
            from jaxcb.host.tokenizer import trim_heap

            trim_heap()

    def restore(self, parts: set[str]) -> None:
        """Back on the devices: "kv_cache" fresh pages; "weights" the offloaded ones, or zeros where they were
        discarded (new weights are to come: use_params)."""
        if "kv_cache" in parts and self.kv_pages is None:
            self.kv_pages = self._allocate_kv()
            self.last_tokens = self._zero_last_tokens(self.last_tokens.shape[0])
            if self._kv_collapsed:  # (into huge pages again, as after the warm-up)
                self._collapse(self.kv_pages, "KV pages")
        if "weights" in parts and self.params is None:
            host, self._host_params = self._host_params, None
            if host is None:
                log.warning("woken with the weights a level-2 sleep dropped: they are zeros until new ones come "
                            "(update_weights)")
            self.params = (jax.tree.map(lambda h, s: jax.device_put(h, s.sharding), host, self._abstract)
                           if host is not None else self.zeroed_params())
            self._collapse(self.params, "weights")

    def zeroed_params(self) -> Params:
        """Weights of zeros, shaped and placed as this runner's (vLLM's weight checker's reset; a wake after they
        were dropped)."""
        return jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding), self._weights_shape())

    def describe(self) -> dict[str, str]:
        """How the step computes (the start banner, GetServerInfo): platform, compute dtype, the weight
        matrices' format, KV dtype, and the attention path."""
        from jaxcb.model.quant import is_quantized

        w = self._weights_shape().layers.wq  # (their shapes: also while asleep)
        weights = f"int{w.bits}" if is_quantized(w) else jnp.dtype(w.dtype).name
        if getattr(w, "act_block", 0):
            weights += ", int8 activations"
        attention = {"cpu": "native", "xla": "xla"}.get(self.attention.kernel, "pallas")
        if self.attention.interpret:
            attention += " (interpreted)"
        return {"platform": self.platform, "compute_dtype": jnp.dtype(self.dtype).name,
                "weights": weights, "kv_dtype": self.kv_dtype.name, "attention": attention}

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.step_config
        from jaxcb.model.paged_attention import kv_slot_width

        return 2 * c.num_layers * c.num_kv_heads * kv_slot_width(c.head_dim, self.kv_dtype) * self.kv_dtype.itemsize

    def compile(self, shape: StepShape) -> None:
        """Compile the step for this shape ahead of time, without running it: a warm-up that executes
        nothing, and that the persistent compile cache turns into loading."""
        if shape.seqs > self.last_tokens.shape[0]:
            raise ValueError(f"a step of {shape.seqs} sequences does not fit this runner's "
                             f"{self.last_tokens.shape[0]} rows (max_seqs)")
        if shape in self._compiled:
            return
        window = self.step_config.sliding_window if self.step_config.windowed else 0
        with _compile_serial:
            lowered = self._forward_step.lower(
                self.params, self.kv_pages, self.last_tokens, pack([], shape, self.page_size, window),
                self._lora_arrays(), config=self.step_config, attention=self.attention)
            forward = lowered.compile(self.compiler_options)
            # The sampler takes the logits and newest tokens as this forward pass leaves them (split as XLA
            # chose on a mesh): one program per row count and those shardings.
            _, logits, newest, _ = jax.tree.map(
                lambda info, sharding: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding),
                lowered.out_info, forward.output_shardings)
            key = (*_sampler_key(shape), logits.sharding, newest.sharding)
            if key not in self._samplers:
                self._samplers[key] = self._sample_step.lower(
                    logits, newest, self.last_tokens, pack_sampling([], shape, self.model_config.vocab_size),
                    seqs=shape.seqs).compile(self.compiler_options)
            sampler = self._samplers[key]
            # Its last_tokens are every forward pass's input: they must come out as the forward takes them.
            made, taken = sampler.output_shardings[1], forward.input_shardings[0][2]
            if not made.is_equivalent_to(taken, 1):
                raise RuntimeError(f"step {shape}: the sampler leaves last_tokens as {made}, the forward pass "
                                   f"takes them as {taken}")
        self._compiled[shape] = (forward, sampler)

    def run(self, batch: StepInput, sampling: SamplingInput, shape: StepShape) -> SampleOutput:
        """Dispatch one step (its two programs); returns device arrays without waiting for them."""
        if shape not in self._compiled:  # a shape warm-up did not cover: compiled now (and counted)
            self.compile(shape)
        forward, sampler = self._compiled[shape]
        self.kv_pages, logits, newest, pooled = forward(self.params, self.kv_pages, self.last_tokens, batch,
                                                        self._lora_arrays())
        out, self.last_tokens = sampler(logits, newest, self.last_tokens, sampling)
        return out.replace(pooled=pooled)

    def _lora_arrays(self):
        return None if self.lora is None else self.lora.arrays

    def fill_lora_slot(self, slot: int, adapter) -> None:
        """Put a LoRA adapter (jaxcb.model.lora.Adapter) into device slot `slot` (queued behind the steps
        already dispatched, before the next)."""
        self.lora.fill(slot, adapter)

    def warmup_lora(self) -> None:
        if self.lora is not None:
            self.lora.warmup()

    @staticmethod
    def fetch(outputs: SampleOutput) -> SampleOutput:
        """The one device-to-host copy of a step (its pooled hidden states stay behind: fetch_pooled)."""
        return _host_copy(outputs.replace(pooled=None))

    @staticmethod
    def fetch_pooled(outputs: SampleOutput) -> tuple[np.ndarray, np.ndarray]:
        """A step's pooled hidden states (last rows, sums), for the steps that run embeddings."""
        return _host_copy(outputs.pooled)

    @staticmethod
    def compilations() -> int:
        """XLA compilations in this process so far (the engine's counter of compilations after warm-up)."""
        return compilation_count()

    def idle(self) -> None:
        """Called by the engine thread while it has no work (the multi-host leader pings)."""
