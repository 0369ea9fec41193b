"""New weights for a model being served, without a restart: a reinforcement-learning trainer's newest policy for
the engine that makes its rollouts (vLLM's and SGLang's weight updates, over HTTP or in the trainer's process).

    source -> read_weights (Params, made as the served ones were) -> each replica's runner: prepare_weights
           -> Engine.swap_weights (between two steps; running requests computed again, the prefix cache forgotten)

A source is a checkpoint (a path of the kinds jaxcb.llm.load_model reads: GGUF, a converted checkpoint, a Hugging
Face directory), a mapping of arrays by name (a Hugging Face state dict's names, or jaxcb's loader layout, e.g. from
jaxcb.model.llama.params_to_weights), or Params themselves (a JAX trainer's, laid out as the served model's). It must
be the served model's architecture, shape for shape: the new arrays take the old ones' places, so nothing compiles
again. Host side (reading, converting); the arrays are put on the devices the served ones are on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Mapping

import numpy as np

from jaxcb.host.errors import InvalidConfig, InvalidRequest, shown
from jaxcb.model.config import ModelConfig

MAX_VERSION_CHARS = 256  # a weight version's length (it is echoed by /weight_info and GetServerInfo)


@dataclasses.dataclass(frozen=True)
class Origin:
    """How an engine's weights were made, so that new ones are made alike: the model as loaded (before the served
    context's and the kernels' changes), the compute dtype, the weight format (EngineConfig.weights and
    weight_group), the checkpoint's config.json ({} for a GGUF file or weights given); and the build sequence's own
    steps (jaxcb.llm.build_engines): `load(path, check_config, mesh)` a checkpoint's Params read so (its RoPE
    override too), `cut_draft(params, mesh)` the draft model speculative decoding cuts from the target's weights
    (None: none)."""

    model_config: ModelConfig
    dtype: object
    weights: str = "auto"
    group: int = 0
    settings: dict = dataclasses.field(default_factory=dict)
    load: Callable | None = None
    cut_draft: Callable | None = None


def format_of(params) -> tuple[str, int]:
    """(EngineConfig.weights, weight_group) that made `params` (weights given loaded, LLM.from_params: their own
    format, whatever the config says)."""
    import jax.numpy as jnp

    from jaxcb.model.quant import is_quantized

    w = params.layers.wq if params.layers.wq is not None else params.layers.w_up
    if w is None:
        return "auto", 0
    if is_quantized(w):
        rows = w.q.shape[-2] * (2 if w.bits == 4 else 1)  # (int4 packs two input rows a byte)
        groups = w.scale.shape[-2]
        return f"int{w.bits}", 0 if w.bits == 8 and groups == 1 else rows // groups
    if jnp.dtype(w.dtype) == jnp.bfloat16 and jnp.dtype(params.compute_dtype) != jnp.bfloat16:
        return "bfloat16", 0
    return "auto", 0


def check_version(version) -> str | None:
    if version is not None and (not isinstance(version, str) or len(version) > MAX_VERSION_CHARS
                                or not version.isprintable()):
        raise InvalidRequest(f"weight_version: a string of at most {MAX_VERSION_CHARS} printable characters, or null")
    return version


def checked_path(source) -> str:
    """A checkpoint's path as given (str or os.PathLike), refused unless something is there."""
    path = os.fspath(source)
    if not os.path.exists(path):
        raise InvalidRequest(f"model_path: {shown(path)} does not exist")
    return path


def check_finite(params) -> None:
    """Refuse weights with a NaN or an infinity (every token after them would be garbage and its logprobs not
    numbers JSON can write), naming the first such array. Each process reads its own shards on the host (no
    program to compile, no collective: a multi-host cluster agrees on the outcome after reading)."""
    import jax

    for path, a in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not np.issubdtype(a.dtype, np.floating) and str(a.dtype) != "bfloat16":
            continue
        shards = [s.data for s in a.addressable_shards] if isinstance(a, jax.Array) else [a]
        if not all(np.isfinite(np.asarray(x, np.float32)).all() for x in shards):
            raise InvalidRequest(f"weights: {jax.tree_util.keystr(path).lstrip('.')} holds values that are not "
                                 "finite (NaN or infinity)")


def same_model(new: ModelConfig, served: ModelConfig, where: str) -> None:
    """Refuse another model's weights (before any is read), naming what differs."""
    differ = [f.name for f in dataclasses.fields(served)
              if f.name != "name" and getattr(new, f.name) != getattr(served, f.name)]
    if differ:
        shown = ", ".join(f"{n} {getattr(new, n)!r} (served: {getattr(served, n)!r})" for n in differ[:3])
        raise InvalidRequest(f"model_path: {where} is not the served model's architecture: {shown}")


def read_weights(source, origin: Origin, mesh=None):
    """Params from `source` (see the module), in the served weights' dtype and format, put on `mesh` (the first
    replica's, under tensor parallelism; default: the default device). Refused, naming the part, unless it is the
    served model's architecture with every weight there and none left over."""
    from jaxcb.model.llama import Params, params_from_numpy

    if isinstance(source, Params):
        return source
    try:
        if isinstance(source, (str, os.PathLike)):
            path = checked_path(source)
            return origin.load(path, lambda c: same_model(c, origin.model_config, path), mesh)
        if not isinstance(source, Mapping):
            raise InvalidRequest(f"weights: a checkpoint's path, arrays by name or Params, not {type(source).__name__}")
        config = origin.model_config
        shapes = config.weight_shapes()
        if set(source) <= set(shapes):  # jaxcb's loader layout
            missing = sorted(set(shapes) - set(source))
            if missing:
                raise InvalidRequest(f"weights: {', '.join(missing[:4])} missing (the loader layout needs every one of "
                                     f"{len(shapes)})")
            for name, shape in shapes.items():
                if tuple(np.shape(source[name])) != tuple(shape):
                    raise InvalidRequest(f"weights: {name} has shape {list(np.shape(source[name]))}, the served "
                                         f"model's {list(shape)}")
            weights = dict(source)
        else:  # a Hugging Face state dict's names
            from jaxcb.model import hf_loader

            weights = hf_loader.weights_from_tensors(source, origin.settings, config, "the weights given")
        place = None
        if mesh is not None:
            from jaxcb.device.parallel import Placement

            place = Placement(mesh, config)
        return params_from_numpy(weights, origin.dtype, origin.weights, origin.group, place)
    except InvalidConfig as e:  # (the loaders' words, "model: ...": a request's error here, of the path it gave)
        message = str(e)
        if isinstance(source, (str, os.PathLike)) and message.startswith("model: "):
            message = "model_path: " + message[len("model: "):]
        raise InvalidRequest(message) from None


def update(engines: list, source, version: str | None = None) -> list:
    """New weights for every replica's engine: read once, made for each runner, taken at each one's next step.
    Returns one future per engine (Engine.swap_weights). Any thread but the engines'; the reading and the
    conversion happen here, so the engines go on stepping meanwhile. A multi-host cluster's leader (its runner
    sends every step to the followers) takes a checkpoint's path alone: at the swap, on its engine thread, every
    process reads its own shards of it (read_checked), agrees with the others, and makes them (prepare_for)."""
    check_version(version)
    first = engines[0]
    if first.origin is None or not all(hasattr(e.runner, "prepare_params") or hasattr(e.runner, "reload")
                                       for e in engines):
        raise InvalidRequest("weights: this engine cannot take new weights (it was not built from weights it can "
                             "read again)")
    if first.config.classifier_from_tokens:
        raise InvalidRequest("weights: not with model.classifier_from_tokens (its head is read from the weights once)")
    if hasattr(first.runner, "reload"):
        if not isinstance(source, (str, os.PathLike)):
            raise InvalidRequest("weights: a multi-host cluster takes a checkpoint's path (every process reads its "
                                 "own shards of it), not arrays in one process")
        path = checked_path(source)
        return [e.swap_weights(lambda e=e: e.runner.reload(path, lambda p: read_checked(e, p),
                                                           lambda params: prepare_for([e], params, True)[0]), version)
                for e in engines]
    import jax

    fresh = isinstance(source, (str, os.PathLike)) or (
        isinstance(source, Mapping) and not any(isinstance(v, jax.Array) for v in source.values()))
    made = prepare_for(engines, read_checked(first, source), fresh)
    return [e.swap_weights(p, version, draft) for e, (p, draft) in zip(engines, made)]


def _model_runner(runner):
    return getattr(runner, "runner", runner)  # (a multi-host leader's: the one it wraps)


def read_for(engine, source):
    """Params from `source` as `engine`'s were made, on its runner's devices (a multi-host process: its shards)."""
    return read_weights(source, engine.origin, mesh=_model_runner(engine.runner).mesh)


def read_checked(engine, source):
    """read_for, then check_finite: a multi-host process's reading (its own shards) before the cluster agrees."""
    params = read_for(engine, source)
    check_finite(params)
    return params


def prepare_for(engines: list, params, fresh: bool) -> list[tuple]:
    """For each engine, (params, the draft model's params or None), made from `params` for its runners. `fresh`:
    nobody else holds `params` (read from a file, or from numpy): else a caller's JAX arrays are copied (a trainer
    may donate or delete its own); rewritten ones are freed only where nobody else reads them."""
    from jaxcb.device.factory import prepare_weights

    first = engines[0]
    runners = [_model_runner(e.runner) for e in engines]
    drafts = [None] * len(engines)
    if first.origin.cut_draft is not None:  # a draft cut from the target's weights: cut anew
        cut = first.origin.cut_draft(params, runners[0].mesh)
        drafts = [_model_runner(e.draft_runner).prepare_params(cut, private=not fresh) for e in engines]
    own = fresh and len(engines) == 1 and drafts[0] is None
    return [(prepare_weights(r, params, e.config, release=own, private=not fresh), draft)
            for e, r, draft in zip(engines, runners, drafts)]


def checksums(engine) -> dict[str, str]:
    """The served arrays' SHA-256 by their place in the weights (vLLM's weight checker): equal weights give equal
    sums on equal servers."""
    import jax

    if getattr(engine.runner, "params", None) is None:
        raise InvalidRequest("action: the weights are asleep (off the devices): wake them first")
    leaves = jax.tree_util.tree_flatten_with_path(engine.runner.params)[0]
    return {jax.tree_util.keystr(path).lstrip("."): hashlib.sha256(np.asarray(jax.device_get(a)).tobytes()).hexdigest()
            for path, a in leaves}
