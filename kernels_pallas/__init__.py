"""Pallas paged-attention kernels for GPU (Triton) and TPU (Mosaic), runnable on the CPU in interpret mode.

The plain-JAX `jaxcb.model.paged_attention.paged_attention_reference` is their oracle in the tests.
"""

from kernels_pallas.attention import (PAGE_SIZES, default_backend, engine_attention, engine_ragged_attention,
                                      paged_attention, ragged_paged_attention)

__all__ = ["PAGE_SIZES", "default_backend", "engine_attention", "engine_ragged_attention", "paged_attention", "ragged_paged_attention"]
