"""A Llama-shaped decoder built from a config (no weights): RMSNorm, rotary positions,
grouped-query attention, a SwiGLU MLP, untied embeddings, the blocks an ``nn.scan`` stack (as
MaxText and most large-model JAX code run them: one compiled block). What a block keeps for
its backward is ``ZeroPPConfig.remat``'s choice (the unit's own checkpointing), so the
blocks carry no ``nn.remat`` of their own: an outer remat would recompute each block's
forward, gather included, and the unit's backward would gather the weights again.

Shapes: tokens ``int32 [batch, seq]`` -> logits ``[batch, seq, vocab]`` in ``dtype``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    name: str
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 32000

    @property
    def params(self) -> int:
        """Parameter count (embeddings and head untied, no biases)."""
        head = self.d_model // self.heads
        attn = self.d_model * head * (2 * self.heads + 2 * self.kv_heads)
        block = attn + 3 * self.d_model * self.ffn + 2 * self.d_model
        return self.layers * block + 2 * self.vocab * self.d_model + self.d_model

    def train_flops_per_token(self, seq: int) -> float:
        """Model FLOPs of one trained token (forward + backward, 6 per weight, plus the
        attention scores: 6 * layers * seq * d_model for causal attention)."""
        return 6.0 * self.params + 6.0 * self.layers * seq * self.d_model


# ~1.3B (24 layers, d_model 2048), then Llama 2's 7B, 13B and 70B, Code Llama's 34B and
# Llama 3.1's 405B (the last three with 8 key-value heads).
SHAPES = {
    "1.3B": LlamaShape("1.3B", layers=24, d_model=2048, heads=16, kv_heads=16, ffn=5504),
    "7B": LlamaShape("7B", layers=32, d_model=4096, heads=32, kv_heads=32, ffn=11008),
    "13B": LlamaShape("13B", layers=40, d_model=5120, heads=40, kv_heads=40, ffn=13824),
    "34B": LlamaShape("34B", layers=48, d_model=8192, heads=64, kv_heads=8, ffn=22016),
    "70B": LlamaShape("70B", layers=80, d_model=8192, heads=64, kv_heads=8, ffn=28672),
    "405B": LlamaShape("405B", layers=126, d_model=16384, heads=128, kv_heads=8, ffn=53248,
                       vocab=128256),
}


def rope(x: jax.Array) -> jax.Array:
    """Rotary positions on ``[batch, seq, heads, head_dim]`` (half-split convention)."""
    seq, dim = x.shape[1], x.shape[-1]
    freq = 1.0 / (10000.0 ** (jnp.arange(0, dim // 2, dtype=jnp.float32) / (dim // 2)))
    angle = jnp.arange(seq, dtype=jnp.float32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    a, b = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1).astype(x.dtype)


# The attention kernel: cuDNN's fused flash attention (``jax.nn.dot_product_attention``'s
# ``implementation="cudnn"``), which XLA's GPU compiler builds for an H100 without one
# attached; its scores stay on chip. ``None`` is XLA's own attention, which keeps the
# [heads, seq, seq] scores and probabilities in memory (fp32 in the backward).
ATTENTION = "cudnn"


def _same(x: jax.Array) -> jax.Array:
    return x


class Block(nn.Module):
    shape: LlamaShape
    dtype: jnp.dtype = jnp.bfloat16
    constrain: Callable[[jax.Array], jax.Array] = _same
    attention: str | None = ATTENTION

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        s, d = self.shape, self.shape.d_model
        x = self.constrain(x)
        head = d // s.heads
        dense = lambda f, name: nn.DenseGeneral(f, use_bias=False, dtype=self.dtype,  # noqa: E731
                                                name=name)
        h = nn.RMSNorm(dtype=self.dtype, name="attn_norm")(x)
        q = rope(dense((s.heads, head), "q")(h))
        k = rope(dense((s.kv_heads, head), "k")(h))
        v = dense((s.kv_heads, head), "v")(h)
        with jax.named_scope("attention"):  # its kernels' class (compute_by_class)
            a = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                             implementation=self.attention)
        x = x + nn.DenseGeneral(d, axis=(-2, -1), use_bias=False, dtype=self.dtype,
                                name="o")(a)
        h = nn.RMSNorm(dtype=self.dtype, name="mlp_norm")(x)
        g = nn.silu(dense(s.ffn, "gate")(h)) * dense(s.ffn, "up")(h)
        return x + dense(d, "down")(g), None


class Llama(nn.Module):
    """``scan=False``: the blocks unrolled (``layers_0``, ``layers_1``, ...), each its own
    unit, ordered by the engine's gather order instead of a loop. ``constrain``: applied to
    the residual stream after the embedding and at every block's input (a plain
    ``jax.jit`` step's activation sharding, as MaxText's logical constraints put it;
    the identity for our engine, whose step is per device)."""

    shape: LlamaShape
    dtype: jnp.dtype = jnp.bfloat16
    scan: bool = True
    constrain: Callable[[jax.Array], jax.Array] = _same
    attention: str | None = ATTENTION

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        s = self.shape
        x = self.constrain(nn.Embed(s.vocab, s.d_model, dtype=self.dtype, name="embed")(tokens))
        if self.scan:
            stack = nn.scan(Block, variable_axes={"params": 0},
                            split_rngs={"params": True}, length=s.layers)
            x, _ = stack(s, self.dtype, self.constrain, self.attention, name="layers")(x, None)
        else:
            for i in range(s.layers):
                x, _ = Block(s, self.dtype, self.constrain, self.attention,
                             name=f"layers_{i}")(x, None)
        x = self.constrain(nn.RMSNorm(dtype=self.dtype, name="norm")(x))
        return nn.Dense(s.vocab, use_bias=False, dtype=self.dtype, name="head")(x)


def loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross entropy in fp32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))
