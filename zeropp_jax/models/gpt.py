"""A small GPT-style decoder in plain Flax linen (nothing ZeRO-specific in it).

Each block, the token embedding, the position embedding and the LM head are direct children
of the root, so zeropp_jax makes each of them one unit by default.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    mlp_ratio: int = 4
    dtype: str = "float32"  # computation dtype of activations
    logit_scale: bool = False  # a learnable scalar on the root module (CLIP-style)


class CausalSelfAttention(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        b, t, d = x.shape
        if d % cfg.heads:
            raise ValueError(f"d_model={d} must be a multiple of heads={cfg.heads}")
        hd = d // cfg.heads
        qkv = nn.Dense(3 * d, dtype=cfg.dtype, name="qkv")(x)
        q, k, v = jnp.split(qkv.reshape(b, t, 3, cfg.heads, hd), 3, axis=2)
        q, k, v = (a[:, :, 0] for a in (q, k, v))  # [b, t, heads, hd]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(q.dtype)
        mask = jnp.tril(jnp.ones((t, t), bool))
        logits = jnp.where(mask[None, None], logits, jnp.finfo(logits.dtype).min)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
        return nn.Dense(d, dtype=cfg.dtype, name="proj")(out)


class Block(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        x = x + CausalSelfAttention(cfg, name="attn")(nn.LayerNorm(dtype=cfg.dtype, name="ln1")(x))
        h = nn.LayerNorm(dtype=cfg.dtype, name="ln2")(x)
        h = nn.Dense(cfg.mlp_ratio * cfg.d_model, dtype=cfg.dtype, name="fc")(h)
        h = nn.Dense(cfg.d_model, dtype=cfg.dtype, name="out")(jax.nn.gelu(h))
        return x + h


class GPT(nn.Module):
    """Tokens ``[batch, seq]`` int32 -> logits ``[batch, seq, vocab]`` float32."""

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        t = tokens.shape[1]
        x = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name="wte")(tokens)
        pos = nn.Embed(cfg.seq_len, cfg.d_model, dtype=cfg.dtype, name="wpe")(jnp.arange(t))
        x = x + pos[None]
        for i in range(cfg.layers):
            x = Block(cfg, name=f"block_{i}")(x)
        x = nn.LayerNorm(dtype=cfg.dtype, name="ln_f")(x)
        logits = nn.Dense(cfg.vocab_size, dtype=cfg.dtype, name="head")(x)
        if cfg.logit_scale:
            logits = logits * self.param("logit_scale", nn.initializers.ones, ())
        return logits.astype(jnp.float32)


def loss_fn(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross entropy (nats). ``logits [b, t, v]``, ``targets [b, t]``."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
