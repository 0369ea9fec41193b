"""Multi-host serving: one step program over the devices of several processes, one scheduler.

Every process (host) runs `jaxcb serve` with the same model and config and joins one JAX cluster
(`jax.distributed.initialize`; on the CPU the collectives go over gloo). The mesh is every device of
every process, split by tensor parallelism (jaxcb.device.parallel). Process 0, the leader, runs the gRPC
server, the scheduler and the page pool; the others, followers, hold their shards of the weights and
KV pages and run whatever step the leader runs, in the same order:

    leader, every step:  broadcast header [op, bucket, step no., runner]  then the step's padded input
                         as one byte buffer (its size follows from the bucket), then run the step
                         (runner 0: the model's; 1: speculative decoding's draft model's)
    leader, a LoRA slot: broadcast header [LORA, slot, step no.]  then the adapter's A and B padded
                         to the slots' rank as one byte buffer (its size follows from the config),
                         then fill the slot
    leader, new weights: broadcast header [UPDATE, path bytes, step no.]  then the checkpoint's path (a
                         file every process reads, jaxcb.weight_update), then read it and step on it
    follower, forever:   receive the header; RUN: receive the input, run the same compiled step on the
                         same runner; COMPILE: compile that bucket (warm-up); LORA: receive the
                         adapter, fill the same slot; UPDATE: receive the path, read the weights (every
                         process its shards, in step with the others), step on them; PING: nothing;
                         STOP: return

Both broadcasts are `multihost_utils.broadcast_one_to_all` (a psum in which only the leader
contributes). Warm-up sends COMPILE for every bucket with a zero input, so the broadcast of every
size is compiled too and nothing compiles after it. While the leader is idle it sends PING every
second: a follower never waits long in a collective, and a dead process is found within a second
(the collective fails: the leader's engine thread dies and the server exits non-zero; a follower
whose leader is gone exits non-zero). SIGTERM on the leader drains the server, then sends STOP.
Adapters are registered on the leader alone (`--lora`, the load endpoints): a follower needs none of
their files.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from jaxcb.device import cpu_dots
from jaxcb.host.batch import StepShape, pack, pack_sampling
from jaxcb.host.errors import InvalidConfig, InvalidRequest
from jaxcb.host.runner_protocol import Runner

log = logging.getLogger("jaxcb.device.multihost")

OP_RUN, OP_COMPILE, OP_PING, OP_STOP, OP_LORA, OP_WARMED, OP_UPDATE = 1, 2, 3, 4, 5, 6, 7
MAX_PATH_BYTES = 4096  # an update's checkpoint path, sent as one buffer of this size (compiled at warm-up)
HEADER_WORDS = 4  # op, bucket index (LORA: the slot), step number, runner (0 the model, 1 the draft)
TARGET, DRAFT = 0, 1  # the runners a step may run on
PING_EVERY_S = 1.0


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Join the cluster: explicit coordinator/count/id, or (all None) JAX's own cluster detection
    (TPU pods, SLURM, Open MPI, ...). Must run before anything touches a device."""
    if jax.config.jax_platforms in (None, "", "cpu") or jax.config.jax_platforms.startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id, heartbeat_timeout_seconds=10)
    log.info("process %d of %d; %d local devices of %d", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())


def is_leader() -> bool:
    return jax.process_index() == 0


def _allgather(x: np.ndarray) -> np.ndarray:
    """[processes, ...]: every process's `x` (the same shape and dtype everywhere)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x))


def agreed(ok: bool) -> bool:
    """Whether every process says ok (a one-word all-gather: compiled at warm-up, Channel.warm_path)."""
    return bool(_allgather(np.array([int(ok)], np.int32)).min())


def reload_in_step(path: str, read, prepare):
    """New weights on every process at the same point of the steps: `read(path)` its shards (no collective), agree
    that every process did, then `prepare` them (in step). Where any failed, none takes them: its own error, or
    InvalidRequest on the others (every process keeps the weights it has; the cluster never runs two models)."""
    try:
        params, error = read(path), None
    except Exception as e:  # noqa: BLE001 - told to every process first
        params, error = None, e
    if not agreed(error is None):
        if error is not None:
            raise error
        raise InvalidRequest(f"model_path: another process of the cluster could not read {path}; the weights stay")
    return prepare(params)


def agree_plan(plan):
    """The memory plan every process uses: each plans from its own free memory, and the cluster takes
    the smallest page counts, so page ids mean the same pages everywhere (build_engines' agree_plan)."""

    counts = _allgather(np.array([plan.num_pages, plan.num_window_pages], np.int64))
    agreed = dataclasses.replace(plan, num_pages=int(counts[:, 0].min()), num_window_pages=int(counts[:, 1].min()))
    if agreed != plan:
        log.info("process %d: pages %d/%d as the cluster agreed (planned %d/%d)", jax.process_index(),
                 agreed.num_pages, agreed.num_window_pages, plan.num_pages, plan.num_window_pages)
    return agreed


def fingerprint(runner, config) -> dict[str, str]:
    """What must be the same in every process for them to run one engine: the model, its weights
    (each array's path, global shape and dtype, so the weights mode and group), the compute and KV
    dtypes, the window layout, the buckets, the pages, the attention and, on the CPU, the dot library."""
    import hashlib

    import jax.numpy as jnp

    c = runner.step_config
    leaves = jax.tree_util.tree_leaves_with_path(runner.params)
    weights = hashlib.sha256(repr([(jax.tree_util.keystr(k), tuple(a.shape), str(a.dtype))
                                   for k, a in leaves]).encode()).hexdigest()[:16]
    return {
        "model": f"{c.name} ({c.family}, {c.num_layers} layers, vocab {c.vocab_size}, {c.num_params} parameters)",
        "weights": f"{', '.join(sorted({str(a.dtype) for _, a in leaves}))} arrays {weights}",
        "compute dtype": jnp.dtype(runner.dtype).name,
        "activations": config.activations,
        "logprobs mode": config.logprobs_mode,
        "kv dtype": jnp.dtype(runner.kv_dtype).name,
        "window layout": f"window {c.sliding_window if c.windowed else 0}, {c.num_sliding_layers} sliding layers, "
                         f"{runner.num_window_pages} window pages",
        "buckets": repr(config.buckets),
        "pages": f"{config.num_pages} of {config.page_size} tokens",
        "tensor parallel": str(config.tensor_parallel),
        "lora": (f"{config.lora.max_loras} slots of rank {config.lora.max_rank} on {', '.join(config.lora.targets)}"
                 if config.lora.enabled else "none"),
        "attention": str(runner.attention.kernel),
        "speculative": repr(config.scheduler.speculative),
        # XLA:CPU's dot library changes float rounding (jaxcb.device.cpu_dots); a measured choice may differ by host
        "cpu dots": cpu_dots.current().library if runner.describe()["platform"] == "cpu" else "-",
    }


def check_same_engine(runner, config, size: int = 8192) -> None:
    """Every process reports its fingerprint; any difference from the leader's refuses the start (on
    every process: the same collective), naming what differs."""
    import json

    mine = json.dumps(fingerprint(runner, config), sort_keys=True).encode()
    if len(mine) > size:
        raise InvalidConfig(f"multi-host: the engine fingerprint is over {size} bytes")
    buf = np.zeros(size, np.uint8)
    buf[:len(mine)] = np.frombuffer(mine, np.uint8)
    everyone = [json.loads(bytes(row).rstrip(b"\0")) for row in _allgather(buf)]
    leader = everyone[0]
    diffs = [f"process {i} {key}: {theirs.get(key)!r}, leader: {leader.get(key)!r}"
             for i, theirs in enumerate(everyone[1:], 1) for key in sorted(set(leader) | set(theirs))
             if theirs.get(key) != leader.get(key)]
    if diffs:
        raise InvalidConfig("multi-host: the processes would not run one engine; start every process with the "
                         "same model, config and flags: " + "; ".join(diffs))


@dataclasses.dataclass
class Message:
    """One broadcast as a follower receives it: the op and what comes with it."""

    op: int
    shape: StepShape | None = None  # RUN, COMPILE: the bucket
    batch: object = None  # RUN, COMPILE: the step's packed input (jaxcb.host.batch.StepInput)
    sampling: object = None  # ... and its sampling rows
    slot: int = -1  # LORA: the device slot
    path: str = ""  # UPDATE: the checkpoint every process reads
    lora: tuple[dict, dict] | None = None  # LORA: the adapter's padded (A, B) per target
    runner: int = TARGET  # RUN, COMPILE, WARMED: TARGET or DRAFT


def _concat(leaves) -> np.ndarray:
    return np.concatenate([np.ascontiguousarray(x).view(np.uint8).ravel() for x in leaves])


def _split(buf: np.ndarray, leaves) -> list[np.ndarray]:
    """`buf` cut into arrays of the shapes and dtypes of `leaves` (the inverse of _concat)."""
    out, at = [], 0
    for x in leaves:
        out.append(buf[at:at + x.nbytes].view(x.dtype).reshape(x.shape))
        at += x.nbytes
    return out


class Channel:
    """The per-step broadcast from the leader; one instance per process, the same bucket list (the
    model's step shapes and its draft model's). `lora`: the padded (A, B) of an empty slot
    (jaxcb.device.lora.LoraSlots.padded(None)), whose shapes an adapter's broadcast takes; None where
    the engine has no LoRA slots."""

    def __init__(self, shapes: list[StepShape], page_size: int, vocab_size: int, window: int = 0, lora=None):
        import jaxcb.device.runner  # noqa: F401 - registers the step input types as pytrees

        self.shapes = list(shapes)
        self.page_size = page_size
        self._index = {s: i for i, s in enumerate(self.shapes)}
        # The step inputs as the engine packs them (a model with sliding layers adds its window pages).
        self._templates = [jax.tree.flatten((pack([], s, page_size, window), pack_sampling([], s, vocab_size)))
                           for s in self.shapes]
        self._lora = None if lora is None else jax.tree.flatten(lora)
        self.steps = 0
        self.bytes_sent = 0
        self.last_send = time.monotonic()

    def payload_bytes(self, shape: StepShape) -> int:
        return sum(x.nbytes for x in self._templates[self._index[shape]][0])

    @staticmethod
    def _broadcast(x: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(x))

    # ---- leader ----
    def _send(self, header: list[int], leaves=None) -> None:
        """The header, then (if any) the arrays as one byte buffer."""
        for x in (np.array(header, np.int32), None if leaves is None else _concat(leaves)):
            if x is not None:
                self._broadcast(x)
                self.bytes_sent += x.nbytes
        self.last_send = time.monotonic()

    def send(self, op: int, shape: StepShape | None = None, batch=None, sampling=None, runner: int = TARGET) -> None:
        index = -1 if shape is None else self._index[shape]
        leaves = None
        if op in (OP_RUN, OP_COMPILE):
            leaves = jax.tree.leaves((batch, sampling)) if batch is not None else self._templates[index][0]
        self._send([op, index, self.steps, runner], leaves)
        self.steps += op == OP_RUN

    def send_path(self, path: str) -> None:
        """New weights: the checkpoint every process reads (UPDATE)."""
        data = path.encode()
        if len(data) > MAX_PATH_BYTES:
            raise InvalidConfig(f"model_path: {len(data)} bytes; a multi-host cluster takes at most {MAX_PATH_BYTES}")
        buf = np.zeros(MAX_PATH_BYTES, np.uint8)
        buf[:len(data)] = np.frombuffer(data, np.uint8)
        self._send([OP_UPDATE, len(data), self.steps, TARGET], [buf])

    def warm_path(self) -> None:
        """The path's broadcast and the agreement after reading (agreed) compiled at warm-up (after WARMED), so an
        update compiles nothing."""
        self._broadcast(np.zeros(MAX_PATH_BYTES, np.uint8))
        agreed(True)

    def send_lora(self, slot: int, a: dict, b: dict) -> None:
        """An adapter's padded arrays for `slot` (every process then fills that slot with them)."""
        self._send([OP_LORA, slot, self.steps, TARGET], jax.tree.leaves((a, b)))

    # ---- follower ----
    def receive(self) -> Message:
        """The leader's next send."""
        header = self._broadcast(np.zeros(HEADER_WORDS, np.int32))
        op, index, runner = int(header[0]), int(header[1]), int(header[3])
        if op == OP_UPDATE:
            buf = self._broadcast(np.zeros(MAX_PATH_BYTES, np.uint8))
            return Message(op, path=bytes(buf[:index]).decode())  # (the header's index: the path's length)
        if op == OP_LORA:
            if self._lora is None:
                raise RuntimeError("multi-host: the leader filled a LoRA slot and this process has none")
            return Message(op, slot=index, lora=self._receive(*self._lora))
        if op not in (OP_RUN, OP_COMPILE):
            return Message(op, runner=runner)
        batch, sampling = self._receive(*self._templates[index])
        return Message(op, self.shapes[index], batch, sampling, runner=runner)

    def _receive(self, leaves, treedef):
        """The arrays the leader sent as one buffer, in the structure of `leaves` / `treedef`."""
        buf = self._broadcast(np.zeros(sum(x.nbytes for x in leaves), np.uint8))
        return jax.tree.unflatten(treedef, _split(buf, leaves))


class LeaderRunner(Runner):
    """The leader's ModelRunner (`which`: TARGET, or DRAFT for speculative decoding's draft model): every
    compile and step is first sent to the followers. What it does not send on is the wrapped runner's."""

    def __init__(self, runner, channel: Channel, which: int = TARGET):
        self.runner = runner
        self.channel = channel
        self.which = which
        self.model_config = runner.model_config
        self.step_config = runner.step_config
        self.num_pages, self.page_size = runner.num_pages, runner.page_size
        self.num_window_pages = runner.num_window_pages
        self.device_ids = runner.device_ids

    def fetch(self, outputs):
        return self.runner.fetch(outputs)

    def fetch_pooled(self, outputs):
        return self.runner.fetch_pooled(outputs)

    def describe(self) -> dict[str, str]:
        return self.runner.describe()

    def compilations(self) -> int:
        return self.runner.compilations()

    def warmed_up(self) -> None:
        self.channel.send(OP_WARMED, runner=self.which)  # the followers' pools into huge pages too
        if self.which == TARGET:
            self.channel.warm_path()
        self.runner.warmed_up()

    # ---- new weights (jaxcb.weight_update): a checkpoint every process reads ----
    def reload(self, path: str, read, prepare) -> object:
        """Send the followers `path`, then read it here as every process does (reload_in_step)."""
        try:
            self.channel.send_path(path)
        except InvalidConfig as e:  # (a path too long: refused before anything is sent)
            raise InvalidRequest(str(e)) from None
        return reload_in_step(path, read, prepare)

    def use_params(self, params) -> None:
        self.runner.use_params(params)

    def compile(self, shape: StepShape) -> None:
        self.channel.send(OP_COMPILE, shape, runner=self.which)
        self.runner.compile(shape)

    def run(self, batch, sampling, shape: StepShape):
        self.channel.send(OP_RUN, shape, batch, sampling, runner=self.which)
        return self.runner.run(batch, sampling, shape)

    def fill_lora_slot(self, slot: int, adapter) -> None:
        """The adapter padded here, sent, and put into the same slot on every process."""
        a, b = self.runner.lora.padded(adapter)
        self.channel.send_lora(slot, a, b)
        self.runner.lora.fill_padded(slot, a, b)

    def warmup_lora(self) -> None:
        """The slot filler compiled on every process (and the broadcast of its size): slot 0 filled with
        zeros, as the slots start."""
        if self.runner.lora is not None:
            self.fill_lora_slot(0, None)
            jax.block_until_ready(self.runner.lora.arrays)

    def reset_kv_if_lost(self) -> bool:
        """After a failed step: fresh pages would be allocated by this process alone, which the
        followers cannot mirror; a lost cache (consumed, or holding an error as the single-process
        runner checks) ends the cluster (the engine thread dies, exit 1)."""
        lost = any(a.is_deleted() for a in self.runner.kv_arrays)
        if not lost:
            try:
                for a in (*self.runner.kv_arrays, self.runner.last_tokens):
                    a.block_until_ready()
            except Exception:  # noqa: BLE001 - an error-carrying buffer: its contents are unknown
                lost = True
        if lost:
            raise RuntimeError("multi-host: a failed step lost the KV pages; restart the cluster")
        return False

    def idle(self) -> None:
        if time.monotonic() - self.channel.last_send >= PING_EVERY_S:
            self.channel.send(OP_PING)

    def stop_followers(self) -> None:
        self.channel.send(OP_STOP)


def follow(runner, channel: Channel, draft=None, reload=None) -> int:
    """A follower's whole life after loading: mirror the leader until STOP (returns the steps run), on
    `runner` and on `draft`, the draft model's runner where the engine speculates with one. `reload(path)`: new
    weights as the leader reads them, (the model's, the draft's or None) (reload_in_step)."""
    runs = 0
    while True:
        m = channel.receive()
        if m.op == OP_STOP:
            log.info("follower %d: STOP after %d steps", jax.process_index(), runs)
            return runs
        on = runner
        if m.runner == DRAFT:
            if draft is None:
                raise RuntimeError("multi-host: the leader ran a draft model's step and this process has none")
            on = draft
        if m.op == OP_COMPILE:
            on.compile(m.shape)
        elif m.op == OP_RUN:
            on.run(m.batch, m.sampling, m.shape)
            runs += 1
        elif m.op == OP_WARMED:
            on.warmed_up()
            if on is runner:
                channel.warm_path()
        elif m.op == OP_UPDATE:
            try:
                params, draft_params = reload(m.path)
            except Exception as e:  # noqa: BLE001 - every process agreed not to take them (reload_in_step)
                log.warning("follower %d: the update from %s failed (%r); the weights stay", jax.process_index(),
                            m.path, e)
                continue
            runner.use_params(params)
            if draft_params is not None:
                draft.use_params(draft_params)
        elif m.op == OP_LORA:
            runner.lora.fill_padded(m.slot, *m.lora)
