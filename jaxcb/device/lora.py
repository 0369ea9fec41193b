"""LoRA adapter slots on the device: fixed-shape stacks that the step reads, and the one program that fills a slot.

Per target matrix (jaxcb.model.lora.TARGETS, those configured) the slots are

    a[target]  [L, in, S * R]     every slot's A side by side (slot s: columns s*R .. s*R + R)
    b[target]  [L, S * R, out]    every slot's B, the adapter's scale folded in
    col_slot   [S * R]            which slot each column belongs to

with S = lora.max_loras slots and R = lora.max_rank; an adapter of a smaller rank, or without one of
the targets, is padded with zeros. The step (jaxcb.model.llama._layer) multiplies each token by every
slot's A (S * R columns: a few percent of a projection), zeroes the columns of other slots, and
multiplies by B: one shape for any mix of adapters in a batch, so filling a slot never compiles.

Filling a slot is one jitted program (compiled at warm-up) that writes the adapter's columns into
the donated stacks. Under tensor parallelism the stacks are split with their targets: B by output
columns for q/k/v/gate/up, A by input rows for o/down (XLA adds the sums). Across processes
(jaxcb.device.multihost) the leader pads an adapter once and broadcasts the padded arrays; every
process runs the same fill with them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.host.lora import check_targets
from jaxcb.model.config import ModelConfig


def zero_slots(config: ModelConfig, targets, slots: int, rank: int, dtype) -> dict:
    shapes = config.adapter_shapes()
    check_targets(targets, shapes)
    a = {t: jnp.zeros((config.num_layers, shapes[t][1], slots * rank), dtype) for t in targets}
    b = {t: jnp.zeros((config.num_layers, slots * rank, shapes[t][2]), dtype) for t in targets}
    return {"a": a, "b": b, "col_slot": jnp.asarray(np.repeat(np.arange(slots, dtype=np.int32), rank))}


def slot_shardings(lora: dict, mesh):
    """NamedShardings of the stacks: split as their targets are (jaxcb.device.parallel)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcb.device.parallel import AXIS

    rows = ("wo", "w_down")  # split by input rows; the others by output columns

    def spec(side, target):
        if side == "a":
            return P(None, AXIS, None) if target in rows else P()
        return P() if target in rows else P(None, None, AXIS)

    return {"a": {t: NamedSharding(mesh, spec("a", t)) for t in lora["a"]},
            "b": {t: NamedSharding(mesh, spec("b", t)) for t in lora["b"]},
            "col_slot": NamedSharding(mesh, P())}


@functools.partial(jax.jit, donate_argnums=(0,))
def _fill(lora: dict, slot, a: dict, b: dict) -> dict:
    """Write one adapter's A [L, in, R] and B [L, R, out] per target into slot `slot` of the stacks."""
    out = {"a": dict(lora["a"]), "b": dict(lora["b"]), "col_slot": lora["col_slot"]}
    for t in lora["a"]:
        rank = a[t].shape[-1]
        out["a"][t] = jax.lax.dynamic_update_slice(lora["a"][t], a[t], (0, 0, slot * rank))
        out["b"][t] = jax.lax.dynamic_update_slice(lora["b"][t], b[t], (0, slot * rank, 0))
    return out


def padded(adapter, config: ModelConfig, targets, rank: int, dtype) -> tuple[dict, dict]:
    """An adapter's (A, B) per configured target at the slots' rank (zeros where it has none); host arrays.
    `config` is the step's: where tensor parallelism replicates the KV heads, B of k and v repeats each
    head's columns as the weights do."""
    shapes = config.weight_shapes()
    a, b = {}, {}
    for t in targets:
        _, n_in, n_out = shapes[t]
        pa = np.zeros((config.num_layers, n_in, rank), np.float32)
        pb = np.zeros((config.num_layers, rank, n_out), np.float32)
        if adapter is not None and t in adapter.weights:
            wa, wb = adapter.weights[t]
            if wb.shape[-1] != n_out:  # k/v of KV heads replicated onto a mesh (parallel.replicate_kv_heads)
                heads = wb.shape[-1] // config.head_dim
                wb = np.repeat(wb.reshape(*wb.shape[:-1], heads, config.head_dim), n_out // wb.shape[-1], axis=-2)
                wb = wb.reshape(*wb.shape[:-2], n_out)
            pa[:, :, :wa.shape[-1]] = wa
            pb[:, :wb.shape[1], :] = wb
        a[t], b[t] = pa.astype(dtype), pb.astype(dtype)
    return a, b


class LoraSlots:
    """The device stacks of one runner and the slot filler."""

    def __init__(self, config: ModelConfig, targets, slots: int, rank: int, dtype, mesh=None):
        self.config, self.targets, self.slots, self.rank, self.dtype = config, tuple(targets), slots, rank, dtype
        self.mesh = mesh
        lora = zero_slots(config, self.targets, slots, rank, dtype)
        if mesh is not None:
            lora = jax.device_put(lora, slot_shardings(lora, mesh))
        self.arrays = lora

    def padded(self, adapter) -> tuple[dict, dict]:
        """`adapter`'s (A, B) host arrays as a slot holds them (None: zeros)."""
        return padded(adapter, self.config, self.targets, self.rank, self.dtype)

    def fill(self, slot: int, adapter) -> None:
        """Put `adapter` (jaxcb.model.lora.Adapter; None: zeros) into slot `slot`."""
        self.fill_padded(slot, *self.padded(adapter))

    def fill_padded(self, slot: int, a: dict, b: dict) -> None:
        """Put padded arrays (`padded`) into slot `slot`."""
        self.arrays = _fill(self.arrays, jnp.int32(slot), a, b)

    def warmup(self) -> None:
        """Compile the filler (slot 0 with zeros: the slots start empty)."""
        self.fill(0, None)
        jax.block_until_ready(self.arrays)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.arrays))
