"""Model configuration: plain, hashable values (a static argument of every jitted step)."""

from __future__ import annotations

import dataclasses

from jaxcb.host.errors import InvalidConfig


ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
# The dense MLP's matrices in the layers of a mixture of experts that have one (ModelConfig.moe_layers), and the
# parts of the layers with experts; in such a model each is stacked over its own layers (ModelConfig.stacked_over).
DENSE_MLP = ("dense_gate", "dense_up", "dense_down")
EXPERT_PARTS = ("router", "router_bias", "router_choice_bias", "experts_gate", "experts_up", "experts_down",
                "experts_gate_bias", "experts_up_bias", "experts_down_bias", "w_gate", "w_up", "w_down", "shared_gate")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder of the Llama family or one of its named variations (Qwen3, Gemma 2, Gemma 3: see the
    fields after `attention_bias`). Frozen, so it can be a static argument of jax.jit."""

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
    # A base model's checkpoint without a language-model head (MistralModel, ...: how embedding models are released):
    # served for embeddings only; its steps take their logits from the tied embedding, which mean nothing.
    headless: bool = False
    attention_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    out_bias: bool = False  # a bias on the attention's output projection too (Llama's attention_bias, gpt-oss)
    # ---- variations of other families (defaults: Llama) ----
    family: str = "llama"  # "llama" (Llama, Mistral, Mixtral, Qwen2 and its MoE, SmolLM3, Granite and its MoE,
    #                        Phi-3), "qwen3" (and its MoE), "gemma2", "gemma3", "olmo2", "olmoe", "gpt-oss", "llama4"
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    qk_norm_whole: bool = False  # ... over the whole q and k projections instead, all heads at once (OLMo 2)
    pre_norms: bool = True  # a norm before attention and before the MLP (False: OLMo 2's, with post_norms only)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w) (Gemma)
    post_norms: bool = False  # a norm after attention and after the MLP too: four per layer (Gemma 2/3)
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU), "gelu_tanh" (GeGLU, Gemma) or "swiglu_oai"
    #                           (gpt-oss: gate clamped above at swiglu_limit, up to +-swiglu_limit,
    #                           gate * sigmoid(swiglu_alpha * gate) * (up + 1))
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    embed_scale: bool = False  # embeddings times sqrt(hidden), in the model dtype (Gemma)
    query_scale: float = 0.0  # attention scores' scale; 0: 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar^-0.5)
    sliding_window: int = 0  # keys a sliding layer's query sees, itself included (0: no sliding layers)
    # The sliding layers attend within chunks of sliding_window positions instead (Llama 4's chunked attention:
    # a query at t sees the keys from t - t % sliding_window on); their pages are kept as a window's.
    attention_chunked: bool = False
    sliding_layers: tuple[bool, ...] = ()  # per layer: True = sliding window, False = full attention
    local_rope_theta: float = 0.0  # sliding layers' RoPE base (Gemma 3: 10,000); 0: rope_theta
    attn_sinks: bool = False  # a learned logit per query head in each softmax's denominator (gpt-oss's sinks)
    # RoPE scaling of the full-attention layers (a sliding layer's RoPE is plain unless `rope_scaled_sliding`,
    # gpt-oss's YaRN on every layer): each frequency divided by
    # its factor (Llama 3.1+'s "llama3" scaling; GGUF's rope_freqs tensor), () for none; and every
    # position divided by `rope_linear_factor` (linear scaling: Gemma 3 4B+'s global layers), 1 for none.
    rope_freq_factors: tuple[float, ...] = ()
    rope_linear_factor: float = 1.0
    rope_scaled_sliding: bool = False
    rope_attention_factor: float = 1.0  # cos and sin scaled by it (LongRoPE's attention factor, Phi-3.5/4); 1: none
    # LongRoPE's long factors (Phi-3.5, Phi-4-mini) and the original context past which they apply; rope_freq_factors
    # holds its short ones. One set serves every position, chosen by the context served (at_context); () / 0: none.
    rope_long_factors: tuple[float, ...] = ()
    rope_original_context: int = 0
    rotary_dim: int = 0  # each head's first dimensions RoPE rotates (Phi-4-mini: 3/4 of them); 0: all
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) (Gemma 2); 0: off
    final_softcap: float = 0.0  # the same on the logits (Gemma 2); 0: off
    nope_layers: tuple[bool, ...] = ()  # per layer: True = no RoPE (SmolLM3's every fourth layer); () for none
    # Llama 4: the RoPE layers' q and k RMS-normed per head without a weight (after RoPE: a rotation keeps
    # their norms, so the order is the reference's either way); the NoPE layers' queries scaled by their
    # position, log(1 + floor((p + 1) / nope_temperature)) * nope_temperature_scale + 1 (0: off)
    qk_rms_rope: bool = False
    nope_temperature: int = 0
    nope_temperature_scale: float = 0.1
    # Granite's scalars: the embeddings times `embed_multiplier`, each attention and MLP output times
    # `residual_multiplier` before it joins the residual, the logits divided by `logit_scale` (1: none).
    embed_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logit_scale: float = 1.0
    # A mixture of experts in place of the MLP (Mixtral, Qwen3-MoE, Granite MoE): a router picks each token's
    # `experts_per_token` of `num_experts` gated MLPs (each `intermediate_size` wide) and weighs their outputs
    # by its softmax probabilities, renormalized over the chosen ones when `norm_topk`; 0 experts: a dense MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    norm_topk: bool = True
    moe_input_scale: bool = False  # Llama 4: each chosen expert's sigmoid score scales its input, not its output
    expert_bias: bool = False  # a bias on the router's logits and on each expert's gate, up and down (gpt-oss)
    # Beside the experts, a shared expert every token runs (Qwen2-MoE): a gated MLP this wide (the dense MLP's
    # matrices w_gate, w_up, w_down), its output times sigmoid(x @ shared_gate); 0: none.
    shared_expert_size: int = 0
    shared_expert_gated: bool = True  # the shared expert weighed by its sigmoid gate (Qwen2-MoE); False: whole (Llama 4)
    # Dense MLPs among the experts' layers (Llama 4 Maverick's every other layer, GLM-4.5's first ones, Qwen-MoE's
    # mlp_only_layers / decoder_sparse_step): per layer True = a mixture of experts, False = a dense gated MLP
    # `dense_size` wide (dense_gate, dense_up, dense_down); each part stacked over its own layers only
    # (stacked_over); () = every layer a mixture of experts.
    moe_layers: tuple[bool, ...] = ()
    dense_size: int = 0
    # DeepSeek-V3's router (GLM-4.5's): each expert's score is the sigmoid of its logit; the experts are chosen
    # by score plus a per-expert correction bias (router_choice_bias) among the `expert_groups_used` best of
    # `expert_groups` equal groups (a group's worth: the sum of its two best), and weighed by their scores,
    # renormalized when norm_topk; every router's weights then times routed_scale. With a softmax router,
    # groups are DeepSeek-V2's group_limited_greedy (a group's worth: its best probability).
    router_sigmoid: bool = False
    router_choice_bias: bool = False
    expert_groups: int = 1
    expert_groups_used: int = 1
    routed_scale: float = 1.0
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values come from one latent a token,
    # kv_lora_rank wide (RMS-normed), beside a rotary_dim-wide key part RoPE rotates, both shared by every head;
    # queries through a q_lora_rank-wide pair of matrices with a norm between (0: one matrix), each head's
    # qk_nope_dim + rotary_dim wide. Served absorbed: each head's unrotated query is carried into the latent by
    # its key up-projection (w_uk), so the pages hold [rotated part | latent] once a token as the keys and the
    # values alike (num_kv_heads 1, head_dim rotary_dim + kv_lora_rank), and each head's output leaves the latent
    # through its value up-projection (w_uv, to v_head_dim) before wo. 0: ordinary attention. (for_kernels may pad
    # head_dim past rotary_dim + kv_lora_rank with zeros.)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        assert not self.sliding_layers or len(self.sliding_layers) == self.num_layers, "one flag per layer"
        assert not self.nope_layers or len(self.nope_layers) == self.num_layers, "one flag per layer"
        assert not self.rope_freq_factors or len(self.rope_freq_factors) == self.rope_dim // 2, "one factor per frequency"
        assert not self.rope_long_factors or len(self.rope_long_factors) == self.rope_dim // 2, "one factor per frequency"
        assert self.rope_dim % 2 == 0 and self.rope_dim <= self.head_dim, "an even rotary part of the head"
        assert not self.num_experts or 0 < self.experts_per_token <= self.num_experts, "1 to num_experts a token"
        assert self.activation in ACTIVATIONS, f"activation {self.activation!r}: one of {ACTIVATIONS}"
        assert not self.expert_bias or self.num_experts, "expert biases without experts"
        assert not self.moe_layers or (len(self.moe_layers) == self.num_layers and self.num_experts), "one flag per layer"
        assert not self.mixed_mlp or self.dense_size > 0, "the dense layers' width"
        assert self.expert_groups >= 1 and not self.num_experts % self.expert_groups, "equal groups of experts"
        assert 1 <= self.expert_groups_used <= self.expert_groups, "1 to expert_groups groups a token"
        assert not self.mla or (self.rotary_dim and self.head_dim >= self.rotary_dim + self.kv_lora_rank
                                and self.qk_nope_dim and self.v_head_dim), "latent attention's dimensions"

    def at_context(self, context: int) -> "ModelConfig":
        """This config as it serves contexts of up to `context` tokens: with LongRoPE's long factors in place of
        its short ones where `context` is past its original context, for every position (llama.cpp's rule: one
        set, chosen by the context served; transformers picks per forward pass by the longest sequence, vLLM per
        batch, so a sequence's early keys and later ones can differ there). Itself otherwise."""
        if not self.rope_long_factors or context <= self.rope_original_context:
            return self
        return dataclasses.replace(self, rope_freq_factors=self.rope_long_factors)

    def for_kernels(self) -> "ModelConfig":
        """This config as the Pallas kernels run it (their head dims are powers of two): latent attention's cached
        width padded up to one (1,024 for DeepSeek-V3's 576) with zeros, which add nothing to a score and whose
        values' outputs are dropped. Itself otherwise."""
        d = self.head_dim
        if not self.mla or (d >= 16 and not d & (d - 1)):
            return self
        return dataclasses.replace(self, head_dim=max(16, 1 << (d - 1).bit_length()))

    def rope_divisors(self):
        """numpy float32 [rope_dim/2]: what each RoPE frequency of a full-attention layer is divided by (Llama 3's
        per-frequency factors times the linear factor), or None for plain RoPE. A constant of the program:
        the step computes the frequencies themselves from each layer's base, as transformers does."""
        import numpy as np

        if not self.rope_freq_factors and self.rope_linear_factor == 1.0:
            return None
        factors = np.asarray(self.rope_freq_factors or (1.0,) * (self.rope_dim // 2), np.float32)
        return factors * np.float32(self.rope_linear_factor)

    @property
    def rope_dim(self) -> int:
        """The dimensions of each head RoPE rotates (the first ones)."""
        return self.rotary_dim or self.head_dim

    @property
    def attention_window(self) -> int:
        """The sliding layers' `window` as the attention kernels take it: > 0 a sliding window, < 0 chunks."""
        return -self.sliding_window if self.attention_chunked else self.sliding_window

    @property
    def windowed(self) -> bool:
        """Some layers see only the last `sliding_window` tokens: their KV pages are a group of their own."""
        return self.sliding_window > 0 and any(self.sliding_layers)

    @property
    def num_sliding_layers(self) -> int:
        return sum(self.sliding_layers) if self.windowed else 0

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (kv_lora_rank)."""
        return self.kv_lora_rank > 0

    @property
    def mixed_mlp(self) -> bool:
        """Some layers of a mixture of experts have a dense MLP instead (moe_layers)."""
        return bool(self.num_experts and self.moe_layers and not all(self.moe_layers))

    @property
    def num_expert_layers(self) -> int:
        return (sum(self.moe_layers) if self.mixed_mlp else self.num_layers) if self.num_experts else 0

    def stacked_over(self, name: str) -> list[int]:
        """The layers whose weight `name` a stack holds, in order (its leading axis): in a model with dense
        layers among the experts' (mixed_mlp) the dense MLP's matrices over the dense layers, the experts' parts
        (EXPERT_PARTS: the router, the experts, a shared expert) over the others; the rest over every layer."""
        if not self.mixed_mlp or name not in DENSE_MLP + EXPERT_PARTS:
            return list(range(self.num_layers))
        return [i for i, moe in enumerate(self.moe_layers) if moe == (name in EXPERT_PARTS)]

    @property
    def attention_scale(self) -> float:
        return self.query_scale or 1.0 / self.head_dim**0.5

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight array of the model by the name the loaders give it, and its shape: matrices
        [in, out] and per-layer vectors stacked over layers on a leading L axis. The one statement of the
        model's tensors (loaders check against it, checkpoints store it, random and abstract weights are made
        from it, num_params sums it)."""
        e, f, l = self.hidden_size, self.intermediate_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        x, m = self.num_experts, self.num_expert_layers or l  # (m: the layers with experts)
        s = self.shared_expert_size or f  # (the dense MLP's width, or the shared expert's)
        dense = {"w_gate": (m, e, s), "w_up": (m, e, s), "w_down": (m, s, e)}
        mlp = ({"router": (m, e, x), "experts_gate": (m, x, e, f), "experts_up": (m, x, e, f),
                "experts_down": (m, x, f, e)} if x else dense)
        if x and self.shared_expert_size:
            mlp.update(dense, **({"shared_gate": (m, e, 1)} if self.shared_expert_gated else {}))
        if x and self.expert_bias:
            mlp.update(router_bias=(m, x), experts_gate_bias=(m, x, f), experts_up_bias=(m, x, f),
                       experts_down_bias=(m, x, e))
        if x and self.router_choice_bias:
            mlp.update(router_choice_bias=(m, x))
        if self.mixed_mlp:  # the other layers' dense MLP
            d = self.dense_size
            mlp.update(dense_gate=(l - m, e, d), dense_up=(l - m, e, d), dense_down=(l - m, d, e))
        attn = {"wq": (l, e, q), "wk": (l, e, kv), "wv": (l, e, kv), "wo": (l, q, e)}
        if self.mla:  # (latent attention's matrices: see kv_lora_rank)
            h, lat, qk = self.num_heads, self.kv_lora_rank, self.qk_nope_dim + self.rotary_dim
            attn = ({"wq_a": (l, e, self.q_lora_rank), "q_a_norm": (l, self.q_lora_rank),
                     "wq_b": (l, self.q_lora_rank, h * qk)} if self.q_lora_rank else {"wq": (l, e, h * qk)})
            attn.update(wkv_a=(l, e, lat + self.rotary_dim), kv_a_norm=(l, lat), w_uk=(l, h, self.qk_nope_dim, lat),
                        w_uv=(l, h, lat, self.v_head_dim), wo=(l, h * self.v_head_dim, e))
        shapes = {  # in this order: jaxcb.model.llama.random_weights draws them so
            "embed": (self.vocab_size, e), **attn, **mlp, "attn_norm": (l, e), "mlp_norm": (l, e), "final_norm": (e,),
        }
        if not self.pre_norms:
            del shapes["attn_norm"], shapes["mlp_norm"]
        if self.attention_bias:
            shapes.update(bq=(l, q), bk=(l, kv), bv=(l, kv))
        if self.out_bias:
            shapes.update(bo=(l, e))
        if self.attn_sinks:
            shapes.update(sinks=(l, self.num_heads))
        if self.qk_norm and self.qk_norm_whole:
            shapes.update(q_norm=(l, q), k_norm=(l, kv))
        elif self.qk_norm:
            shapes.update(q_norm=(l, self.head_dim), k_norm=(l, self.head_dim))
        if self.post_norms:
            shapes.update(post_attn_norm=(l, e), post_mlp_norm=(l, e))
        if not self.tie_embeddings:
            shapes["lm_head"] = (e, self.vocab_size)
        return shapes

    def adapter_shapes(self) -> dict[str, tuple[int, ...]]:
        """weight_shapes of the matrices LoRA slots (a slot a layer) may target: every layer's; where dense layers
        sit among the experts' (mixed_mlp), not a shared expert's, stacked over the experts' layers only."""
        shapes = self.weight_shapes()
        return {k: v for k, v in shapes.items() if k not in EXPERT_PARTS} if self.mixed_mlp else shapes

    def check_weight_shapes(self, weights: dict, source: str) -> None:
        """Every weight a loader found has the shape this config gives it (names it does not know are
        left to the loader): a clear error naming the tensor and `source` (the file or config.json)."""
        for key, shape in self.weight_shapes().items():
            if key in weights and tuple(weights[key].shape) != shape:
                raise InvalidConfig(f"{source}: tensor {key} has shape {tuple(weights[key].shape)}, expected {shape}")

    @property
    def num_params(self) -> int:
        total = 0
        for shape in self.weight_shapes().values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def flops_per_token(self, context: int = 0) -> int:
        """Forward FLOPs for one token: 2 per weight of every matmul it runs (embedding lookup excluded,
        the output head included; of a mixture of experts, the router and the token's own experts) plus
        attention over `context` earlier tokens."""
        e, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        mlp = 3 * e * f * self.experts_per_token + e * self.num_experts if self.num_experts else 3 * e * f
        mlp += (3 * e * self.shared_expert_size + e) if self.num_experts and self.shared_expert_size else 0
        m = self.num_expert_layers or self.num_layers  # (layers with that MLP; the others' a dense one)
        dense = (self.num_layers - m) * 3 * e * self.dense_size
        attn = e * q + 2 * e * kv + q * e
        if self.mla:  # the queries' (one matrix or two), the latent's, the absorbed up-projections, the output's
            h, lat, qk = self.num_heads, self.kv_lora_rank, self.qk_nope_dim + self.rotary_dim
            attn = ((e * self.q_lora_rank + self.q_lora_rank * h * qk) if self.q_lora_rank else e * h * qk)
            attn += e * (lat + self.rotary_dim) + h * self.qk_nope_dim * lat + h * lat * self.v_head_dim
            attn += h * self.v_head_dim * e
        matmul = self.num_layers * attn + m * mlp + dense + e * v
        seen = self.num_full_layers * context + self.num_sliding_layers * min(context, self.sliding_window)
        attention = seen * 2 * 2 * self.num_heads * self.head_dim
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


# Tensors a checkpoint may hold that the decoder computes itself.
_DERIVED = ("rotary_emb.inv_freq", "attn_rot_embd")


def check_all_used(unused: set[str], where: str) -> None:
    """A tensor the loader did not take is a part of the model jaxcb would not run (an o_proj or MLP bias,
    experts, a vision tower): refuse the model by its name rather than serve it without."""
    unused = sorted(n for n in unused if not any(d in n for d in _DERIVED))
    if unused:
        raise InvalidConfig(f"model: {where} holds tensors jaxcb's decoder does not use ({len(unused)}: "
                            f"{', '.join(unused[:4])}{', ...' if len(unused) > 4 else ''}): its architecture has parts "
                            "jaxcb does not run")
