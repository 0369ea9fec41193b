"""The names the model's step and the device mesh share: the mesh axis the model is split over, and how
the KV pages are split on it. Here rather than in jaxcb.device.parallel so that the model (below) and the
parallel layer (above it, which lays out the model's parameters) both import it, neither the other."""

from jax.sharding import PartitionSpec as P

AXIS = "model"  # the mesh axis of tensor parallelism
KV_SPEC = P(None, None, AXIS, None, None, None)  # KV pages [L, 2, K, P, S, D] split on the KV heads
