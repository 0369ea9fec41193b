"""The offline Python API: load a model, run a list of prompts through the engine, get completions.

    llm = LLM()                                   # the embedded SmolLM2 model
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    outs = llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=32))

All prompts are submitted at once and batched continuously; results come back in input order, with
SamplingParams(n=k) giving k consecutive completions per prompt (`index` 0..k-1).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time

import numpy as np

from jaxcb import weight_update
from jaxcb.device import cpu_dots
from jaxcb.host import classifier, harmony, tool_calls
from jaxcb.host.beam_search import BeamSearch
from jaxcb.host.chat_template import read_template
from jaxcb.host.classifier import Classification
from jaxcb.host.engine import Engine
from jaxcb.host.engine_config import EngineConfig, load_config
from jaxcb.host.embedding import Pooling, cosines
from jaxcb.host.errors import InvalidConfig, InvalidRequest, StepFailed, Unavailable
from jaxcb.host.replicas import Replicas
from jaxcb.host.request import FinishReason, SamplingParams, TokenEvent, check_unicode, resolve_bad_words


@dataclasses.dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list | None = None
    error: str | None = None
    index: int = 0  # which sample of the prompt (SamplingParams.n)
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed
    # SamplingParams.prompt_logprobs: None, then per prompt token after the first (logprob, rank,
    # ((token_id, logprob), ...top-n)) given the tokens before it
    prompt_logprobs: list | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (vLLM's); None otherwise
    cumulative_logprob: float | None = None  # beam search: the sum of the beam's tokens' logprobs
    embedding: "np.ndarray | None" = None  # SamplingParams.pooling: the prompt's pooled vector (not normalized)


def read_model_config(path: str | None = None, rope_scaling: str = ""):
    """The ModelConfig of a model (GGUF file, converted checkpoint or Hugging Face directory) without
    loading its weights; `rope_scaling`: EngineConfig.rope_scaling's override."""
    from jaxcb.model import checkpoint, gguf_loader, hf_loader
    from jaxcb.model.embedded import resolve_model
    from jaxcb.model.rope_scaling import override

    path = resolve_model(path)
    if checkpoint.is_checkpoint_dir(path):
        return override(checkpoint.read_config(path)[0], rope_scaling)
    if hf_loader.is_hf_dir(path):
        return override(hf_loader.read_config(path), rope_scaling)
    if os.path.isdir(path):
        raise InvalidConfig(f"model: {path} is neither a converted checkpoint ({checkpoint.MANIFEST}) nor a Hugging "
                         "Face directory (config.json)")
    return override(gguf_loader.read_config(gguf_loader.open_reader(path)), rope_scaling)


def load_model(path: str | None = None, dtype=None, check_config=None, weights: str = "auto", group: int = 0,
               rope_scaling: str = "", mesh=None):
    """(ModelConfig, Params, Tokenizer, eos ids) from a GGUF file (default: the embedded SmolLM2), a
    directory written by `jaxcb convert`, or a Hugging Face checkpoint directory. `check_config(config)`,
    if given, runs once the config is read and before any weight is (the memory plan's refusal).
    `weights`: "int8" / "int4" quantize the matrices as they load (jaxcb.model.quant; `group` input
    rows per scale, 0 = the mode's default). `rope_scaling`: EngineConfig.rope_scaling's override of the
    model's RoPE scaling. `mesh`: where the weights go, each split over it as it is read (tensor parallelism,
    jaxcb.device.parallel.Placement; default: the default device)."""
    from jaxcb.device.factory import default_dtype
    from jaxcb.host.tokenizer import Tokenizer
    from jaxcb.model import checkpoint, gguf_loader, hf_loader
    from jaxcb.model.embedded import resolve_model
    from jaxcb.model.llama import params_from_numpy

    from jaxcb.model.rope_scaling import override

    checked = check_config or (lambda config: None)
    check_config = lambda config: checked(override(config, rope_scaling))  # noqa: E731
    path = resolve_model(path)

    def placement(config):  # (each weight split over the mesh as it is read)
        from jaxcb.device.parallel import Placement

        return Placement(mesh, config) if mesh is not None else None

    if os.path.isdir(path):
        known = read_model_config(path)  # raises the explanation for a directory of neither kind
        check_config(known)
        if checkpoint.is_checkpoint_dir(path):
            config, loaded_weights = checkpoint.load(path, dtype, placement(known).shardings if mesh is not None else None)
            dtype = dtype or checkpoint.compute_dtype(loaded_weights)
        else:
            config = hf_loader.read_config(path)
            loaded_weights = hf_loader.load_weights(path, config)
        tokenizer = Tokenizer.from_dir(path) if os.path.isfile(os.path.join(path, "tokenizer.json")) else None
    else:
        loaded = gguf_loader.load_gguf(path, check_config)
        config, loaded_weights = loaded.config, loaded.weights
        tokenizer = Tokenizer(loaded.tokenizer) if loaded.tokenizer is not None else None
    config = override(config, rope_scaling)
    params = params_from_numpy(loaded_weights, dtype or default_dtype(), weights, group, placement(config))
    eos = tokenizer.end_ids if tokenizer is not None else ()
    return config, params, tokenizer, eos


def load_classifier(path: str | None, model_config, params, tokenizer, from_tokens: tuple[str, ...] = (),
                    method: str = "auto"):
    """The model's classifier head (jaxcb.host.classifier), None if it has none: a causal LM's rows of its output
    head for `from_tokens` (EngineConfig.classifier_from_tokens, read by `method`), else a Hugging Face sequence
    classifier's score head (`path`: the model's file or directory; None for weights given loaded)."""
    from jaxcb.model import checkpoint, hf_loader
    from jaxcb.model.llama import head_rows

    if from_tokens:
        if model_config.headless:
            raise InvalidConfig(f"model.classifier_from_tokens: {model_config.name} has no language-model head to read "
                                "the tokens' logits from")
        rows = head_rows(params, classifier.token_ids(tokenizer, from_tokens))
        return classifier.from_tokens(from_tokens, rows, model_config.logit_scale, model_config.final_softcap, method)
    if path is None or not os.path.isdir(path):
        return None
    if checkpoint.is_checkpoint_dir(path):
        return classifier.load(path)
    if not hf_loader.is_hf_dir(path):
        return None
    raw = hf_loader.config_json(path)
    if (raw.get("architectures") or [""])[0] not in hf_loader.SEQUENCE_CLASSIFIERS:
        return None  # (a causal LM's shards' headers are not read again for a head it does not have)
    return classifier.from_checkpoint(path, raw, hf_loader.classifier_tensors(path))


def draft_model_config(spec, target):
    """Speculative decoding's draft model config (a ModelConfig) for target `target`, before any weight is
    read: speculative.draft_model's (default the target's), its first speculative.draft_layers layers."""
    config = read_model_config(spec.draft_model) if spec.draft_model else target
    n = spec.draft_layers
    if not n or n == config.num_layers:
        return config
    if n > config.num_layers:
        raise InvalidConfig(f"speculative.draft_layers: {n} is more than the draft model's {config.num_layers} layers")
    moe = config.moe_layers[:n] if config.mixed_mlp else ()
    if moe and not any(moe):
        raise InvalidConfig(f"speculative.draft_layers: the first {n} layers of {config.name} have dense MLPs only; a "
                            "draft keeps at least one layer with experts")
    first = dataclasses.replace(config, num_layers=n, sliding_layers=config.sliding_layers[:n],
                                nope_layers=config.nope_layers[:n], moe_layers=() if all(moe) else moe,
                                dense_size=config.dense_size if not all(moe) else 0)
    if config.windowed and not first.num_full_layers:
        raise InvalidConfig(f"speculative.draft_layers: the first {n} layers of {config.name} are all sliding-window "
                            "layers; a draft keeps at least one full-attention layer")
    return first


def load_draft(spec, target_config, target_params, dtype=None, mesh=None):
    """(ModelConfig, Params) of speculative decoding's draft model: speculative.draft_model's weights (read onto
    `mesh`, the target's, if given), or the target's own (shared, no copy, when the draft keeps every layer in the
    target's format), cut to the first draft_layers layers and stored as draft_weights says."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxcb.model.llama import LayerParams, params_from_numpy, params_to_weights
    from jaxcb.model.quant import is_quantized

    config = draft_model_config(spec, target_config)
    n = config.num_layers
    mode = spec.draft_weights
    if mode in ("float32", "bfloat16"):
        from jaxcb.device.factory import float_weights_dtype

        dtype = float_weights_dtype(mode)
    if spec.draft_model:
        params = load_model(spec.draft_model, dtype or target_params.compute_dtype, weights=mode, mesh=mesh)[1]
    elif mode == "auto" or (mode in ("float32", "bfloat16") and not is_quantized(target_params.layers.wq)
                            and target_params.layers.wq.dtype == jnp.dtype(mode)):  # stored as the draft would be
        params = target_params
    elif is_quantized(target_params.layers.wq):
        raise InvalidConfig(f"speculative.draft_weights: {mode!r} needs the target's weights in float, and they are "
                            "quantized; leave it 'auto' or name a speculative.draft_model")
    else:  # the target's float weights, cut and stored in the draft's format
        layer_names = LayerParams.__dataclass_fields__
        weights = {name: np.asarray(_first_layers(name, a, config) if name in layer_names else a)
                   for name, a in params_to_weights(target_params).items() if name in config.weight_shapes()}
        return config, params_from_numpy(weights, dtype or target_params.compute_dtype, mode)
    if n < jax.tree.leaves(params.layers)[0].shape[0]:
        params = params.replace(layers=LayerParams(**{
            name: _first_layers(name, getattr(params.layers, name), config) for name in LayerParams.__dataclass_fields__}))
    return config, params


def _first_layers(name: str, stack, draft):
    """A target's stack of the layer weight `name`, cut to what the draft `draft` (its first layers) holds: as
    many as the draft stacks it over (ModelConfig.stacked_over: with dense layers among the experts', a part
    of one kind stacks over the layers of its kind); None for a part the draft does not have."""
    import jax

    if stack is None or name not in draft.weight_shapes():
        return None
    n = len(draft.stacked_over(name))
    return jax.tree.map(lambda a: a[:n], stack)


def adapter_reader(model_config, lora_config):
    """(name, path) -> the PEFT adapter at path, checked against the model and lora.max_rank."""
    from jaxcb.model.lora import read_adapter

    def read(name, path):
        adapter = read_adapter(path, model_config, name, lora_config.max_rank)
        unused = sorted(set(adapter.weights) - set(lora_config.targets))
        if unused:
            raise InvalidConfig(f"lora {name}: it adapts {unused}, which lora.targets {list(lora_config.targets)} "
                                "leaves out")
        return adapter

    return read


def build_engine(model: str | None = None, config: EngineConfig | str | None = None, dtype=None, *,
                 loaded=None) -> Engine:
    """The one way to an engine: config -> memory plan -> weights -> runner (KV pages) -> Engine.

    `model`: a GGUF file (default: the embedded SmolLM2), a converted checkpoint or a Hugging Face
    directory; `config`: an EngineConfig or a TOML path (default configs/default.toml); `loaded`: an
    already loaded (ModelConfig, Params, Tokenizer, eos ids) instead of `model`. A configuration that
    cannot fit is refused by the memory plan before any weight is read; the plan is made once.
    `engine.load_seconds` is the time spent loading the weights. With parallel.data > 1 this is the
    first replica only: see build_engines.
    """
    return build_engines(model, config, dtype, loaded=loaded, replicas=1)[0]


def build_engines(model: str | None = None, config: EngineConfig | str | None = None, dtype=None, *,
                  loaded=None, replicas: int | None = None, wrap_runner=None, agree_plan=None) -> list[Engine]:
    """config.data_parallel engines (or `replicas`), each on its own `tensor_parallel` devices
    (jaxcb.host.replicas), from one read of the weights and one memory plan (per device, the same for
    every replica). `wrap_runner(runner, config, draft=False)`: what the engine steps instead of the
    runner, and of the draft model's runner with draft=True (the multi-host leader's,
    jaxcb.device.multihost). `agree_plan(plan)`: the plan to use instead (every
    process of a multi-host cluster takes the same page counts, jaxcb.device.multihost.agree_plan)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxcb.device.factory import compute_dtype, make_runner, plan_memory
    from jaxcb.host.replicas import split_devices
    from jaxcb.model.embedded import resolve_model

    from jaxcb.device.factory import make_draft_runner
    from jaxcb.model import hf_loader

    if not isinstance(config, EngineConfig):
        config = load_config(config)
    cpu_dots.setup(config.cpu_dots)  # before the first device call: XLA reads its flags once
    count = config.data_parallel if replicas is None else replicas
    groups = split_devices(jax.devices(), config.tensor_parallel, count) if count > 1 else [None]
    spec = config.scheduler.speculative
    drafting = spec.method == "draft"

    def draft_of(c):
        return draft_model_config(spec, c) if drafting else None

    plans = []
    t0 = time.perf_counter()
    if loaded is not None:  # (LLM.from_params: the config's RoPE scaling on the model given)
        from jaxcb.model.rope_scaling import override

        loaded = (override(loaded[0], config.rope_scaling), *loaded[1:])
    mesh = None  # (the first replica's, as make_runner makes it: the weights are read onto it)
    if loaded is None and (config.tensor_parallel > 1 or groups[0] is not None):
        from jaxcb.device.parallel import make_mesh

        mesh = make_mesh(config.tensor_parallel, groups[0])
    model_config, params, tokenizer, eos = loaded or load_model(
        model, compute_dtype(config, dtype),
        check_config=lambda c: plans.append(plan_memory(c, config, dtype, draft=draft_of(c))),
        weights=config.weights, group=config.weight_group, rope_scaling=config.rope_scaling, mesh=mesh)
    # How these weights were made (jaxcb.weight_update): new ones, given while serving, are made alike
    path = resolve_model(model) if loaded is None else None
    mode, group = (config.weights, config.weight_group) if loaded is None else weight_update.format_of(params)
    made = params.compute_dtype

    def load(path, check, on):  # (a checkpoint read as these weights were)
        return load_model(path, made, check_config=check, weights=mode, group=group, rope_scaling=config.rope_scaling,
                          mesh=on)[1]

    def cut_draft(target, on):  # (speculative decoding's draft, cut from the target's layers as this one was)
        return load_draft(spec, model_config, target, compute_dtype(config, dtype), on)[1]

    origin = weight_update.Origin(model_config, made, mode, group,
                                  hf_loader.config_json(path) if path is not None and hf_loader.is_hf_dir(path) else {},
                                  load, cut_draft if drafting and not spec.draft_model else None)
    draft = load_draft(spec, model_config, params, compute_dtype(config, dtype), mesh) if drafting else None
    head = load_classifier(resolve_model(model) if loaded is None else None, model_config, params, tokenizer,
                           config.classifier_from_tokens, config.classifier_method)
    if head is not None and config.chat_template:  # (the server's template writes scored pairs, as vLLM's does)
        head = dataclasses.replace(head, templated=True)
    if config.chat_template:  # the server's template in place of the model file's
        if tokenizer is None:
            raise InvalidConfig("model.chat_template: this model has no tokenizer to write a chat with")
        tokenizer = copy.copy(tokenizer)  # (not the caller's: from_params may share one)
        tokenizer.set_chat_template(read_template(config.chat_template))
    load_seconds = time.perf_counter() - t0
    # The plan stands if the weights came in the dtype it assumed (a checkpoint may bring its own).
    if plans and jnp.dtype(params.compute_dtype) == compute_dtype(config, dtype):
        plan = plans[0]
    else:
        plan = plan_memory(model_config, config, params.compute_dtype, draft=draft and draft[0])
    if agree_plan is not None:
        plan = agree_plan(plan)
    engines = []
    # (weights read here for one runner alone: it may free what it rewrites, e.g. the native matmul's blocked copies)
    release = loaded is None and len(groups) == 1 and draft is None
    for i, devices in enumerate(groups):
        runner, resolved = make_runner(model_config, params, config, plan=plan, devices=devices, release_params=release)
        draft_runner = make_draft_runner(runner, *draft, resolved) if draft else None
        if wrap_runner is not None:
            runner = wrap_runner(runner, resolved)
            if draft_runner is not None:
                draft_runner = wrap_runner(draft_runner, resolved, draft=True)
        # Each replica draws the seeds of unseeded requests from its own generator.
        seed = None if config.seed is None else config.seed + i
        engine = Engine(runner, tokenizer, dataclasses.replace(resolved, seed=seed), eos_ids=eos,
                        load_seconds=load_seconds, draft_runner=draft_runner, classifier=head)
        engine.origin = origin
        if engine.adapters is not None:
            engine.adapters.reader = adapter_reader(model_config, config.lora)
        engines.append(engine)
    for text in config.lora.adapters:  # --lora NAME=PATH: read once, registered with every replica
        from jaxcb.model.lora import parse_spec

        name, path = parse_spec(text)
        adapter = engines[0].adapters.reader(name, path)
        for engine in engines:
            engine.adapters.add(name, adapter)
    return engines


class LLM:
    def __init__(self, model: str | None = None, *, config: EngineConfig | str | None = None, dtype=None,
                 _loaded=None):
        engines = build_engines(model, config, dtype, loaded=_loaded)
        self.engine = engines[0]
        # parallel.data > 1: the replicas step on their threads behind the router (jaxcb.host.replicas)
        self.replicas = Replicas(engines) if len(engines) > 1 else None
        self.load_seconds = self.engine.load_seconds
        self.model_config = self.engine.model_config
        self.tokenizer = self.engine.tokenizer
        # how the model's embeddings pool (jaxcb.host.embedding): its sentence-transformers configuration or GGUF's
        self.pooling = getattr(self.tokenizer, "pooling", None) or Pooling()
        # the model's classifier head (jaxcb.host.classifier): a sequence classifier's, or --classifier-from-tokens
        self.classifier = self.engine.classifier

    @classmethod
    def from_params(cls, model_config, params, tokenizer=None, *, config: EngineConfig, eos_ids=()):
        return cls(config=config, _loaded=(model_config, params, tokenizer, tuple(eos_ids)))

    # ---- prompts to ids ----
    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("prompt: this model has no tokenizer; pass token ids")
            check_unicode(prompt, "prompt")
            if chat:
                return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    # ---- generation ----
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, *,
                 chat: bool = False, priorities: list[int] | None = None) -> list[Completion]:
        """prompts: strings or token-id lists. Bad input raises InvalidRequest (a ValueError) before anything runs."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = [self.encode(p, chat) for p in prompts]
        return self._run(ids, params, priorities)

    def chat(self, conversations: list[list[dict]], params: SamplingParams | list[SamplingParams] | None = None, *,
             chat_template_kwargs: dict | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list[dict] | None = None):
        """Each conversation ([{role, content}, ...], as the OpenAI chat API takes messages: content parts,
        an assistant's tool_calls, tool results) through the model's chat template (or `chat_template`, a
        Jinja template of this call's own), with `chat_template_kwargs` as more template variables (e.g.
        {"enable_thinking": False}); `continue_final_message` (with add_generation_prompt False): the model
        goes on writing the final assistant message; `tools` (OpenAI's function tools) shown to the model as
        the chat API shows them (jaxcb.host.tool_calls; read the calls back from an answer's text with
        jaxcb.host.tool_parse.parse), as vLLM's LLM.chat takes them. Where the template writes OpenAI's harmony
        format (gpt-oss) the answers keep its markers (skip_special_tokens false): read their reasoning, content
        and calls with jaxcb.host.harmony.parse."""
        if self.tokenizer is None:
            raise InvalidRequest("messages: this model has no tokenizer")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(conversations)
        template = chat_template or self.tokenizer.chat_template
        if harmony.is_harmony(template):  # (its messages' markers, for harmony.parse)
            params = [dataclasses.replace(p, skip_special_tokens=False) for p in params]
        prompts = []
        check_unicode(conversations, "conversations")
        for m in conversations:
            _, messages, shown = tool_calls.prepare({} if tools is None else {"tools": tools}, m, template)
            prompts.append(self.tokenizer.encode_chat(messages, add_generation_prompt, chat_template_kwargs,
                                                      continue_final_message, chat_template, tools=shown))
        return self._run(prompts, params, None)

    def embed(self, prompts, *, dimensions: int | None = None, priorities: list[int] | None = None) -> list[np.ndarray]:
        """Each prompt's embedding, float32 [hidden size] (or its first `dimensions`, Matryoshka-style): the model's
        last hidden states pooled and normalized as the model says (self.pooling; by default the last token's,
        L2-normalized). Strings are encoded as embedding models take their inputs (Tokenizer.encode_input), token
        ids as they are. The requests run through the engine beside any others."""
        size = self.pooling.check(self.model_config.hidden_size, dimensions)
        outs = self._pooled([self._input_ids(p) for p in prompts], priorities, self.pooling.mode)
        return [self.pooling.finish(c.embedding, size) for c in outs]

    def classify(self, prompts, *, priorities: list[int] | None = None) -> list[Classification]:
        """Each prompt's labels' probabilities through the model's classifier head (self.classifier: a
        *ForSequenceClassification checkpoint's, or a causal LM's logits of EngineConfig.classifier_from_tokens),
        from the last prompt token's final hidden state. Strings are encoded as embedding inputs are."""
        if self.classifier is None:
            raise classifier.not_served("classify")
        outs = self._pooled([self._input_ids(p) for p in prompts], priorities)
        return [self.classifier.classify(c.embedding) for c in outs]

    def score(self, text_1, text_2, *, priorities: list[int] | None = None, instruction: str | None = None,
              chat_template_kwargs: dict | None = None) -> list[float]:
        """vLLM's LLM.score: text_1 (one text, or a list as long as text_2) against each of text_2, in order. With a
        cross-encoder (a one-label classifier head) each pair runs as one input (Tokenizer.encode_pair, as the head
        says) and scores its probability; otherwise the score is the cosine of the two texts' embeddings.
        `instruction` and `chat_template_kwargs`: variables of the score template (EngineConfig.chat_template with
        a classifier head, as vLLM's)."""
        kwargs = classifier.score_kwargs(self.classifier, instruction, chat_template_kwargs)
        first = [text_1] if isinstance(text_1, str) else list(text_1)
        second = [text_2] if isinstance(text_2, str) else list(text_2)
        pairs = classifier.score_pairs(len(first), len(second))
        texts = first + second
        if self.classifier is None:
            return cosines(self.embed(texts, priorities=priorities), pairs)
        head = self.classifier
        head.check_scores()
        if self.tokenizer is None:
            raise InvalidRequest("text_1: this model has no tokenizer to encode text pairs with")
        outs = self._pooled([self.tokenizer.encode_pair(texts[i], texts[j], head.joins_pairs, head.templated, kwargs)
                             for i, j in pairs], priorities)
        return [float(head.probs(c.embedding)[0]) for c in outs]

    def _input_ids(self, prompt) -> list[int]:
        """An embedding's or a classification's input as ids (Tokenizer.encode_input for a string)."""
        return self.tokenizer.encode_input(prompt) if isinstance(prompt, str) and self.tokenizer is not None \
            else self.encode(prompt)

    def _pooled(self, ids: list[list[int]], priorities, pooling: str = "last") -> list[Completion]:
        """Prompt-only requests pooled by `pooling`, each with its embedding (the pooled vector, not finished)."""
        out = self._run(ids, [SamplingParams(max_tokens=0, pooling=pooling)] * len(ids), priorities)
        for c in out:
            if c.embedding is None:
                raise StepFailed(f"request {c.request_id}: {c.error or 'no embedding came back'}")
        return out

    def beam_search(self, prompts, width: int = 4, max_tokens: int = 16, *, length_penalty: float = 1.0,
                    ignore_eos: bool = False, stop_token_ids=(), include_stop: bool = False, chat: bool = False,
                    lora: str = "") -> list[list[Completion]]:
        """For each prompt, the `width` best continuations by beam search (jaxcb.host.beam_search), best
        first, each with its `cumulative_logprob`; every round is one batch of one-token requests."""
        prompts = list(prompts)
        searches = [BeamSearch(self.encode(p, chat), width, max_tokens, self.engine.eos_ids, ignore_eos=ignore_eos,
                               stop_token_ids=tuple(stop_token_ids), length_penalty=length_penalty,
                               include_stop=include_stop, max_context=self.engine.max_context) for p in prompts]
        step = searches[0].round_params(lora) if searches else None
        for i, s in enumerate(searches):  # each prompt checked before anything runs
            try:
                self.engine.validate(s.prompt, s.checked_as(lora))
            except InvalidRequest as e:
                raise InvalidRequest(f"request {i}: {e}") from None
        while not all(s.done for s in searches):
            live = [s for s in searches if not s.done]
            outs = iter(self.generate([p for s in live for p in s.prompts()], step))
            for s in live:
                s.advance([list(next(outs).logprobs[0][1]) for _ in s.live])
        decode = self.tokenizer.decode if self.tokenizer is not None else (lambda ids: "")
        return [[Completion(f"beam-{i}", s.prompt, b.tokens, decode(s.shown(b)), b.finish_reason, index=k,
                            stop_reason=b.stop_token, cumulative_logprob=b.logprob) for k, b in enumerate(s.best())]
                for i, s in enumerate(searches)]

    def _run(self, ids: list[list[int]], params: list[SamplingParams], priorities) -> list[Completion]:
        params = list(params)
        for i, (p, sp) in enumerate(zip(ids, params)):
            try:
                params[i] = sp = resolve_bad_words(sp, self.engine.tokenizer)  # (spelt once: validated so, run so)
                self.engine.validate(p, sp)
            except InvalidRequest as e:
                raise InvalidRequest(f"request {i}: {e}") from None
        results: dict[tuple[str, int], Completion] = {}
        if self.replicas is not None:
            return self._run_replicas(ids, params, priorities, results)
        for i, (p, sp) in enumerate(zip(ids, params)):
            rid = self.engine.add_request(p, sp, priority=priorities[i] if priorities else 0, validated=True)
            for k in range(sp.n):
                results[rid, k] = Completion(rid, p, [], "", None, [] if sp.logprobs else None, index=k)
        while self.engine.has_work():
            for ev in self.engine.step():
                _apply(results[ev.request_id, ev.index], ev)
        return list(results.values())

    def _run_replicas(self, ids, params, priorities, results) -> list[Completion]:
        import queue

        events: queue.Queue[TokenEvent] = queue.Queue()
        if not self.replicas.started:
            self.replicas.start()
        for i, (p, sp) in enumerate(zip(ids, params)):
            rid = self.replicas.submit(p, sp, events.put, priority=priorities[i] if priorities else 0)
            for k in range(sp.n):
                results[rid, k] = Completion(rid, p, [], "", None, [] if sp.logprobs else None, index=k)
        left = len(results)
        while left:
            try:
                ev = events.get(timeout=1.0)
            except queue.Empty:
                if not self.replicas.alive:
                    raise Unavailable(f"a replica's engine died: {self.replicas.error!r}") from None
                continue
            _apply(results[ev.request_id, ev.index], ev)
            left -= ev.finished
        return list(results.values())

    # ---- new weights (a trainer's newest policy: jaxcb.weight_update) ----
    def update_weights(self, weights, *, version: str | None = None) -> None:
        """Generate with `weights` from now on: a checkpoint's path, arrays by name (a Hugging Face state dict's, or
        jaxcb's loader layout) or Params, of the served model's architecture shape for shape (nothing compiles
        again); the prefix cache is forgotten. `version`: what weight_version says from now on."""
        self._settle(weight_update.update(self._engines(), weights, version))

    def sleep(self, level: int = 1) -> None:
        """Free the devices' memory between rollouts (vLLM's sleep mode, Engine.sleep: level 1 the KV pages, the
        weights kept on the host; level 2 both dropped, new ones to come by update_weights) until wake_up."""
        self._settle([e.sleep(level) for e in self._engines()])

    def wake_up(self, tags=None) -> None:
        """Put back what sleep freed (`tags`: "weights", "kv_cache"; default both)."""
        self._settle([e.wake_up(tags) for e in self._engines()])

    def _engines(self) -> list[Engine]:
        return self.replicas.engines if self.replicas is not None else [self.engine]

    def _settle(self, futures: list) -> list:
        """What was put in the engines' inboxes, taken: by the replicas' threads, or by this one stepping."""
        if self.replicas is not None:
            if not self.replicas.started:
                self.replicas.start()
            self.replicas.woken(futures)
        else:
            while not futures[0].done():
                self.engine.step()
        return [f.result() for f in futures]

    @property
    def weight_version(self) -> str | None:
        """The version the newest weights came with (update_weights), None for those loaded at start."""
        return self.engine.weight_version

    def weight_checksums(self) -> dict[str, str]:
        """The served arrays' SHA-256 by name (jaxcb.weight_update.checksums)."""
        return weight_update.checksums(self.engine)

    def warmup(self, progress=None) -> int:
        return (self.replicas or self.engine).warmup(progress)

    def close(self) -> None:
        """Stop the replicas' threads (parallel.data > 1); nothing to do for one engine."""
        if self.replicas is not None:
            self.replicas.stop()


def _apply(out: Completion, ev: TokenEvent) -> None:
    out.token_ids.extend(ev.token_ids)
    out.text += ev.text
    out.num_cached_tokens = ev.num_cached_tokens
    if ev.logprobs and out.logprobs is not None:
        out.logprobs.extend(ev.logprobs)
    if ev.prompt_logprobs is not None:
        out.prompt_logprobs = [None, *ev.prompt_logprobs]
    if ev.embedding is not None:
        out.embedding = ev.embedding
    if ev.finished:
        out.finish_reason = ev.finish_reason.value if isinstance(ev.finish_reason, FinishReason) else ev.finish_reason
        out.error = ev.error
        out.stop_reason = ev.stop_reason
