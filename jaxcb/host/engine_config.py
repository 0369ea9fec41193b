"""Engine configuration: cache size, scheduler settings and buckets, read from a TOML file.

Plain values, no JAX. The file's sections map onto `SchedulerConfig` and `Buckets`; everything is
validated here, at start, so a bad file fails before any device memory is touched.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib

from jaxcb.host.buckets import Buckets
from jaxcb.host.classifier import check_method, parse_tokens
from jaxcb.host.errors import InvalidConfig
from jaxcb.host.policies import SchedulerConfig
from jaxcb.host.lora import LoraConfig
from jaxcb.host.speculative import SpeculativeConfig

ATTENTION_CHOICES = ("xla", "native", "pallas", "auto")
WEIGHT_CHOICES = ("auto", "float32", "bfloat16", "int8", "int4")  # model.weights (jaxcb.model.quant)
KV_CHOICES = ("auto", "float32", "bfloat16", "int8")
# XLA:CPU's dot libraries (jaxcb.device.cpu_dots sets them up; "default" = whatever jaxlib does)
CPU_DOTS_CHOICES = ("auto", "default", "ynn", "xnn", "onednn", "eigen")
JSON_WHITESPACE_CHOICES = ("flexible", "compact")  # EngineConfig.json_whitespace
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # EngineConfig.logprobs_mode (vLLM's names)
# How XLA compiles each step program (jaxcb.device.runner.COMPILER_OPTIONS): "optimized" (XLA's defaults) or
# "fast" (its backend's optimisations off: a fraction of the compile time, slower steps on real models).
COMPILE_CHOICES = ("optimized", "fast")
ACTIVATION_CHOICES = ("float", "int8")  # model.activations (jaxcb.model.quant.quantize_activations)
ACTIVATION_BLOCK = 32  # int8 activations: input values per scale (jaxcb.model.quant takes it from here)
AUTO_PAGES = 0  # num_pages = "auto": as many as the memory plan fits (jaxcb.host.memory_plan)
KERNEL_PAGE_SIZES = (8, 16, 32, 64, 128, 256)  # = kernels_pallas.PAGE_SIZES (this module imports no JAX)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the source tree
DEFAULT_CONFIG = os.path.join(_ROOT, "configs", "default.toml")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    num_pages: int
    scheduler: SchedulerConfig
    buckets: Buckets
    seed: int | None = None  # draws seeds for requests that bring none; None = OS entropy
    attention: str = "auto"  # "xla" (plain JAX) | "native" (the C++ CPU kernels) | "pallas" (kernels) |
    #                          "auto" (Pallas on GPU/TPU, native on the CPU when it builds, else plain JAX)
    memory_fraction: float = 0.9  # of the memory budget the engine may use (weights, pages, step)
    memory_bytes: int = 0  # the memory budget; 0 = the device's memory
    tensor_parallel: int = 1  # devices one step is split over by heads (jaxcb.device.parallel); 1 = one device
    data_parallel: int = 1  # engine replicas on disjoint devices behind one router (jaxcb.host.replicas)
    # How the weight matrices are stored (jaxcb.model.quant): "auto" = the compute dtype; "float32" /
    # "bfloat16" also set the compute dtype unless --dtype does; "int8" / "int4" quantized at load.
    weights: str = "auto"
    weight_group: int = 0  # quantized weights: input rows per scale; 0 = per column for int8, 32 for int4
    # "int8": each row entering a layer matrix is quantized to int8 per 32 values and the dot sums
    # integers (w8a8; needs int8 weights per column); "float": the compute dtype.
    activations: str = "float"
    # The KV pages' dtype: "auto" = the compute dtype; "int8": values and a float32 scale per token and
    # head side by side in the page (jaxcb.model.paged_attention.quantize_kv).
    kv_dtype: str = "auto"
    # XLA:CPU's dot library (jaxcb.device.cpu_dots): "auto" = chosen for the CPU at start; or one of
    # "default", "ynn", "xnn", "onednn", "eigen". Takes effect only before JAX's CPU backend starts.
    cpu_dots: str = "auto"
    compile: str = "optimized"  # COMPILE_CHOICES: "fast" for quick starts (development, tiny test models)
    lora: LoraConfig = LoraConfig()  # LoRA adapter slots (jaxcb.host.lora); none by default
    # The names a server answers to for the model (requests' `model`; answers carry the first); () = the
    # default (jaxcb.model.embedded.served_name: the embedded model's short name, or the file's name).
    served_model_name: tuple[str, ...] = ()
    # The chat template in place of the model file's: a file's path, or the template itself ("" = the
    # model's; jaxcb.host.chat_template.read_template reads it when the engine is built).
    chat_template: str = ""
    # The full-attention layers' RoPE scaling in place of the model file's: transformers' rope_scaling as JSON
    # text (jaxcb.model.rope_scaling: e.g. YaRN past Qwen3's 32K); "" = the model's own.
    rope_scaling: str = ""
    # A causal LM served as a classifier by the logits of these tokens (vLLM's classifier_from_token; e.g.
    # Qwen3-Reranker's ("no", "yes"): one relevance score, jaxcb.host.classifier); () = none.
    classifier_from_tokens: tuple[str, ...] = ()
    # How they are read (jaxcb.host.classifier.FROM_TOKEN_METHODS, vLLM's names): "auto" = two tokens as one label
    # (from_2_way_softmax), else a label per token (no_post_processing).
    classifier_method: str = "auto"
    # The whitespace JSON output (response_format, structured_outputs' json) may have: "flexible", as pretty-printed
    # JSON writes it, bounded (jaxcb.host.structured.JSON_WHITESPACE; vLLM's default), or "compact", none (vLLM's
    # disable_any_whitespace for every request). A request's own choice or its schema's x-guidance comes first.
    json_whitespace: str = "flexible"
    # What a sampled token's logprobs are of (vLLM's --logprobs-mode): "raw_logprobs", the model's own distribution
    # (before logit_bias, penalties, grammars, temperature and filters), or "processed_logprobs", the one it was
    # drawn from (after all of them: an RL trainer's importance weights); filtered-out tokens -9999.0, as OpenAI's.
    logprobs_mode: str = "raw_logprobs"

    @property
    def page_size(self) -> int:
        return self.scheduler.page_size

    def max_context_for(self, model) -> int:
        """The one context limit for everything (the engine, its memory plan, `jaxcb plan`): the
        configured scheduler.max_context, or the model's (a ModelConfig) if that is smaller."""
        return min(self.scheduler.max_context, model.max_context)

    def __post_init__(self):
        s, b = self.scheduler, self.buckets
        if s.max_context % s.page_size:
            raise InvalidConfig(f"scheduler.max_context: {s.max_context} is not a multiple of page_size {s.page_size}")
        b.validate(max_batch=s.max_running, max_pages_per_seq=s.max_context // s.page_size,
                   max_prefill_tokens=s.max_chunk, step_prefill_tokens=s.max_prefill_tokens)
        if self.num_pages != AUTO_PAGES and self.num_pages < 2:
            raise InvalidConfig(f"cache.num_pages: must be >= 2 or \"auto\", got {self.num_pages}")
        if not 0 < self.memory_fraction <= 1:
            raise InvalidConfig(f"cache.memory_fraction: must be in (0, 1], got {self.memory_fraction}")
        if not isinstance(self.tensor_parallel, int) or isinstance(self.tensor_parallel, bool) or self.tensor_parallel < 1:
            raise InvalidConfig(f"parallel.tensor: must be an integer >= 1, got {self.tensor_parallel!r}")
        if not isinstance(self.data_parallel, int) or isinstance(self.data_parallel, bool) or self.data_parallel < 1:
            raise InvalidConfig(f"parallel.data: must be an integer >= 1, got {self.data_parallel!r}")
        if self.weights not in WEIGHT_CHOICES:
            raise InvalidConfig(f"model.weights: {self.weights!r} is not one of {WEIGHT_CHOICES}")
        if (not isinstance(self.weight_group, int) or isinstance(self.weight_group, bool) or self.weight_group < 0
                or self.weight_group % 2):
            raise InvalidConfig(f"model.weight_group: must be 0 or an even number of input rows, got {self.weight_group!r}")
        if self.activations not in ACTIVATION_CHOICES:
            raise InvalidConfig(f"model.activations: {self.activations!r} is not one of {ACTIVATION_CHOICES}")
        if self.activations == "int8" and not (
                (self.weights in ("int8", "auto") and not self.weight_group)
                or (self.weights == "int4" and self.weight_group % ACTIVATION_BLOCK == 0)):
            raise InvalidConfig(f"model.activations: int8 activations need int8 weights with one scale per column "
                             f"(model.weights = \"int8\", weight_group = 0) or int4 weights in groups of a "
                             f"multiple of {ACTIVATION_BLOCK} (model.weights = \"int4\"), got {self.weights!r}"
                             + (f" in groups of {self.weight_group}" if self.weight_group else ""))
        if self.kv_dtype not in KV_CHOICES:
            raise InvalidConfig(f"cache.kv_dtype: {self.kv_dtype!r} is not one of {KV_CHOICES}")
        if self.cpu_dots not in CPU_DOTS_CHOICES:
            raise InvalidConfig(f"model.cpu_dots: {self.cpu_dots!r} is not one of {CPU_DOTS_CHOICES}")
        if self.json_whitespace not in JSON_WHITESPACE_CHOICES:
            raise InvalidConfig(f"model.json_whitespace: {self.json_whitespace!r} is not one of "
                                f"{JSON_WHITESPACE_CHOICES}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidConfig(f"model.logprobs_mode: {self.logprobs_mode!r} is not one of {LOGPROBS_MODES}")
        if self.compile not in COMPILE_CHOICES:
            raise InvalidConfig(f"model.compile: {self.compile!r} is not one of {COMPILE_CHOICES}")
        if self.attention not in ATTENTION_CHOICES:
            raise InvalidConfig(f"model.attention: {self.attention!r} is not one of {ATTENTION_CHOICES}")
        check_served_names(self.served_model_name, self.lora.adapters)
        if not isinstance(self.chat_template, str):
            raise InvalidConfig(f"model.chat_template: must be a file's path or a template, got {self.chat_template!r}")
        if self.rope_scaling:
            parse_rope_scaling(self.rope_scaling)
        if self.classifier_from_tokens:
            parse_tokens(self.classifier_from_tokens)
        check_method(self.classifier_method, self.classifier_from_tokens)
        if self.attention == "pallas" and s.page_size not in KERNEL_PAGE_SIZES:
            raise InvalidConfig(f"cache.page_size: the Pallas kernels take {KERNEL_PAGE_SIZES}, got "
                             f"{s.page_size} (or set model.attention = 'xla')")

    def replace(self, *, num_pages=None, buckets=None, attention=None, tensor_parallel=None, data_parallel=None,
                weights=None, weight_group=None, kv_dtype=None, cpu_dots=None, activations=None,
                compile=None, lora=None, served_model_name=None, chat_template=None, rope_scaling=None,
                classifier_from_tokens=None, classifier_method=None, json_whitespace=None, logprobs_mode=None,
                **scheduler_changes) -> "EngineConfig":
        return EngineConfig(
            num_pages=self.num_pages if num_pages is None else num_pages,
            scheduler=dataclasses.replace(self.scheduler, **scheduler_changes),
            buckets=self.buckets if buckets is None else buckets,
            seed=self.seed,
            attention=self.attention if attention is None else attention,
            memory_fraction=self.memory_fraction, memory_bytes=self.memory_bytes,
            tensor_parallel=self.tensor_parallel if tensor_parallel is None else tensor_parallel,
            data_parallel=self.data_parallel if data_parallel is None else data_parallel,
            weights=self.weights if weights is None else weights,
            weight_group=self.weight_group if weight_group is None else weight_group,
            kv_dtype=self.kv_dtype if kv_dtype is None else kv_dtype,
            cpu_dots=self.cpu_dots if cpu_dots is None else cpu_dots,
            activations=self.activations if activations is None else activations,
            compile=self.compile if compile is None else compile,
            lora=self.lora if lora is None else lora,
            served_model_name=self.served_model_name if served_model_name is None else tuple(served_model_name),
            chat_template=self.chat_template if chat_template is None else chat_template,
            rope_scaling=self.rope_scaling if rope_scaling is None else rope_scaling,
            classifier_from_tokens=(self.classifier_from_tokens if classifier_from_tokens is None
                                    else tuple(classifier_from_tokens)),
            classifier_method=self.classifier_method if classifier_method is None else classifier_method,
            json_whitespace=self.json_whitespace if json_whitespace is None else json_whitespace,
            logprobs_mode=self.logprobs_mode if logprobs_mode is None else logprobs_mode,
        )


MAX_NAME_CHARS = 256


def parse_rope_scaling(text: str, where: str = "model.rope_scaling") -> dict:
    """`--rope-scaling` / model.rope_scaling: transformers' rope_scaling dict as JSON text, its kind one that
    jaxcb.model.rope_scaling runs (checked when the config is read, before any model is)."""
    import json

    try:
        scaling = json.loads(text)
    except (TypeError, ValueError) as e:
        raise InvalidConfig(f"{where}: not JSON ({e})") from None
    kinds = ("default", "linear", "llama3", "yarn")
    if not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) not in kinds:
        raise InvalidConfig(f"{where}: must be an object with rope_type default, linear, llama3 or yarn "
                            f"(transformers' rope_scaling), got {text[:200]!r}")
    return scaling


def _rope_scaling_text(value) -> str:
    """model.rope_scaling as EngineConfig keeps it: JSON text (a TOML table is written out as JSON)."""
    import json

    return json.dumps(value, sort_keys=True) if isinstance(value, dict) else str(value)


def check_served_names(names: tuple[str, ...], adapters: tuple[str, ...] = ()) -> None:
    """The served model names: distinct non-empty strings without whitespace, none an adapter's name
    (adapters: the --lora NAME=PATH specs)."""
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
        raise InvalidConfig(f"model.served_model_name: must be a list of names, got {names!r}")
    for n in names:
        if not n or len(n) > MAX_NAME_CHARS or any(c.isspace() for c in n):
            raise InvalidConfig(f"model.served_model_name: {n!r} must be 1 to {MAX_NAME_CHARS} characters "
                                "without whitespace")
    if len(set(names)) != len(names):
        raise InvalidConfig(f"model.served_model_name: {list(names)} names one model twice")
    clash = sorted(set(names) & {spec.partition("=")[0] for spec in adapters})
    if clash:
        raise InvalidConfig(f"model.served_model_name: {clash[0]!r} is also a LoRA adapter's name")


def make_config(*, page_size=16, num_pages=4096, max_context=2048, decode_batch=(1, 2, 4, 8, 16, 32),
                pages_per_seq=None, prefill_tokens=(32, 64, 128, 256, 512), max_prefill_tokens=None,
                tokens=None, attention="auto", tensor_parallel=1, data_parallel=1, weights="auto",
                weight_group=0, kv_dtype="auto", cpu_dots="auto", activations="float", compile="optimized",
                lora=None, logprobs_mode="raw_logprobs", **scheduler) -> EngineConfig:
    """An EngineConfig from keyword values (tests and the Python API)."""
    if pages_per_seq is None:
        pages_per_seq = (max_context // page_size,)
    if tokens is None:
        budget = prefill_tokens[-1] if max_prefill_tokens is None else max_prefill_tokens
        b = decode_batch[-1]
        tokens = sorted(set(decode_batch) | {b + t for t in prefill_tokens if t < budget} | {b + budget})
    sched = SchedulerConfig(
        page_size=page_size, max_running=decode_batch[-1], max_context=max_context,
        max_chunk=prefill_tokens[-1],
        max_prefill_tokens=prefill_tokens[-1] if max_prefill_tokens is None else max_prefill_tokens,
        **scheduler,
    )
    return EngineConfig(num_pages=num_pages, scheduler=sched, attention=attention, tensor_parallel=tensor_parallel,
                        data_parallel=data_parallel, weights=weights, weight_group=weight_group,
                        kv_dtype=kv_dtype, cpu_dots=cpu_dots, activations=activations, compile=compile,
                        logprobs_mode=logprobs_mode, lora=lora or LoraConfig(), buckets=Buckets(tuple(decode_batch), tuple(pages_per_seq), tuple(prefill_tokens),
                                        tuple(tokens)))


def _names(value) -> tuple:
    """A name or a list of names (the TOML's served_model_name) as a tuple (checked by EngineConfig)."""
    return (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list) else value


def load_config(path: str | None = None) -> EngineConfig:
    if path is None:
        if not os.path.isfile(DEFAULT_CONFIG):  # installed without the source tree's configs/
            return make_config()
        path = DEFAULT_CONFIG
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise InvalidConfig(f"config: file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise InvalidConfig(f"config: {path} is not valid TOML ({e})") from None
    cache, sched, buckets = raw.get("cache", {}), dict(raw.get("scheduler", {})), raw.get("buckets", {})
    page_size = int(cache.get("page_size", 16))
    max_context = int(sched.get("max_context", 2048))
    unknown = set(buckets) - {"decode_batch", "pages_per_seq", "prefill_tokens", "tokens"}
    if unknown:
        raise InvalidConfig(f"config: unknown setting in [buckets]: {sorted(unknown)}")
    try:
        b = Buckets(tuple(buckets["decode_batch"]),
                    tuple(buckets.get("pages_per_seq", (max(1, max_context // page_size),))),
                    tuple(buckets["prefill_tokens"]), tuple(buckets.get("tokens", ())))
    except KeyError as e:
        raise InvalidConfig(f"config: buckets.{e.args[0]} is missing") from None
    if "target_tpot_ms" in sched:  # the name before the controller took a TTFT target too
        sched.setdefault("target_p99_tpot_ms", sched.pop("target_tpot_ms"))
    if "length_bounds" in sched:
        sched["length_bounds"] = tuple(sched["length_bounds"])
    prefix_caching = cache.get("prefix_caching", True)
    if not isinstance(prefix_caching, bool):
        raise InvalidConfig(f"config: cache.prefix_caching must be true or false, got {prefix_caching!r}")
    sched.setdefault("max_running", b.max_batch)
    sched.setdefault("max_chunk", b.max_prefill_tokens)
    sched.setdefault("max_prefill_tokens", b.max_prefill_tokens)  # the per-step budget: the largest chunk
    speculative = dict(raw.get("speculative", {}))
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    if set(speculative) - known:
        raise InvalidConfig(f"config: unknown setting in [speculative]: {sorted(set(speculative) - known)}")
    sched["speculative"] = SpeculativeConfig(**speculative)
    try:
        sc = SchedulerConfig(page_size=page_size, prefix_caching=prefix_caching, **sched)
    except TypeError as e:
        raise InvalidConfig(f"config: unknown setting in [scheduler] ({e})") from None
    lora = dict(raw.get("lora", {}))
    known = {f.name for f in dataclasses.fields(LoraConfig)}
    if set(lora) - known:
        raise InvalidConfig(f"config: unknown setting in [lora]: {sorted(set(lora) - known)}")
    lora = LoraConfig(**lora)
    model = raw.get("model", {})
    unknown = set(model) - {"attention", "weights", "weight_group", "cpu_dots", "activations", "compile",
                            "served_model_name", "chat_template", "rope_scaling", "classifier_from_tokens",
                            "classifier_method", "json_whitespace", "logprobs_mode"}
    if unknown:
        raise InvalidConfig(f"config: unknown setting in [model]: {sorted(unknown)}")
    parallel = raw.get("parallel", {})
    unknown = set(parallel) - {"tensor", "data"}
    if unknown:
        raise InvalidConfig(f"config: unknown setting in [parallel]: {sorted(unknown)}")
    from jaxcb.host.memory_plan import parse_bytes

    num_pages = cache.get("num_pages", 4096)
    if num_pages == "auto":
        num_pages = AUTO_PAGES
    elif not isinstance(num_pages, int) or isinstance(num_pages, bool):
        raise InvalidConfig(f"config: cache.num_pages must be an integer or \"auto\", got {num_pages!r}")
    return EngineConfig(num_pages=num_pages, scheduler=sc, buckets=b, seed=int(raw["seed"]) if "seed" in raw else None,
                        attention=str(model.get("attention", "auto")), weights=str(model.get("weights", "auto")),
                        weight_group=model.get("weight_group", 0), kv_dtype=str(cache.get("kv_dtype", "auto")),
                        cpu_dots=str(model.get("cpu_dots", "auto")), activations=str(model.get("activations", "float")),
                        compile=str(model.get("compile", "optimized")), lora=lora,
                        served_model_name=_names(model.get("served_model_name", ())),
                        chat_template=model.get("chat_template", ""),
                        rope_scaling=_rope_scaling_text(model.get("rope_scaling", "")),
                        classifier_from_tokens=parse_tokens(model.get("classifier_from_tokens", ())),
                        classifier_method=str(model.get("classifier_method", "auto")),
                        json_whitespace=str(model.get("json_whitespace", "flexible")),
                        logprobs_mode=str(model.get("logprobs_mode", "raw_logprobs")),
                        memory_fraction=float(cache.get("memory_fraction", 0.9)),
                        memory_bytes=parse_bytes(cache["memory"]) if "memory" in cache else 0,
                        tensor_parallel=parallel.get("tensor", 1), data_parallel=parallel.get("data", 1))
