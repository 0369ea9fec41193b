"""What the host side needs of the device side: the Runner protocol.

The engine (jaxcb.host.engine) and the draft proposer (jaxcb.host.draft) call a runner; the runners that
implement it subclass it: jaxcb.device.runner.ModelRunner (one process, one device or a mesh),
jaxcb.device.multihost.LeaderRunner (the same calls, each first sent to the followers) and
jaxcb.sim.simulate.SimRunner (a modelled step time, nothing computed). Plain Python, no JAX.
"""

from __future__ import annotations

from typing import Protocol


class Runner(Protocol):
    """What the engine (and the server) needs of the device side; each runner subclasses it."""

    model_config: object  # the model as loaded (jaxcb.model.config.ModelConfig)
    step_config: object  # the layout the step runs (KV heads replicated onto a mesh if needed)
    num_window_pages: int  # the sliding-window layers' pages (0: none)
    device_ids: list[int]

    def compile(self, shape) -> None: ...  # compile the step for a StepShape ahead of time
    def run(self, batch, sampling, shape): ...  # launch one step (asynchronously); its result handle
    def fetch(self, outputs): ...  # the host copy of a step's result (waits for it)
    def fetch_pooled(self, outputs): ...  # its pooled hidden states, (last rows [M, E], sums [M, E]): embeddings
    def idle(self) -> None: ...  # nothing to run this time round (the leader pings its followers)
    def reset_kv_if_lost(self) -> bool: ...  # after a failed step: fresh pages if the old were consumed
    def describe(self) -> dict[str, str]: ...  # how the step computes (banner, GetServerInfo)
    def compilations(self) -> int: ...  # XLA compilations in this process so far
    def fill_lora_slot(self, slot: int, adapter) -> None: ...  # a LoRA adapter into a device slot (None: zeros)
    def warmup_lora(self) -> None: ...  # compile the slot filler (nothing where the runner has no slots)
    def warmed_up(self) -> None: ...  # every shape compiled: background work may start (CPU: KV pages in huge pages)
