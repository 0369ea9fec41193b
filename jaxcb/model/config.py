"""Model configuration: plain, hashable values (a static argument of every jitted step)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-architecture decoder. Frozen, so it can be a static argument of jax.jit."""

    vocab_size: int
    hidden_size: int  # E
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # H
    num_kv_heads: int  # K
    head_dim: int  # D
    max_context: int  # the model's trained context length
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    name: str = "llama"
    attention_bias: bool = False  # biases on the q, k, v projections (Qwen2)

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"

    @property
    def num_params(self) -> int:
        e, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = e * q + 2 * e * kv + q * e + 3 * e * f + 2 * e + (q + 2 * kv if self.attention_bias else 0)
        head = 0 if self.tie_embeddings else e * v
        return v * e + self.num_layers * per_layer + e + head

    def flops_per_token(self, context: int = 0) -> int:
        """Forward FLOPs for one token: 2 per weight of every matmul (embedding lookup excluded,
        the output head included) plus attention over `context` earlier tokens."""
        e, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        matmul = self.num_layers * (e * q + 2 * e * kv + q * e + 3 * e * f) + e * v
        attention = self.num_layers * 2 * 2 * self.num_heads * self.head_dim * context
        return 2 * matmul + attention


def tiny_config(**overrides) -> ModelConfig:
    """A small random-weight model for tests: every code path of the real one, at toy sizes."""
    values = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_context=512, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_embeddings=False, name="tiny-random",
    )
    values.update(overrides)
    return ModelConfig(**values)
