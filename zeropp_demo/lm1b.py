"""Flax's lm1b example language model, re-created with its decode mode (nothing ZeRO-specific).

The same module structure, parameter names and decode convention as ``flax/examples/lm1b``'s
``TransformerLM``: with ``TransformerConfig(decode=True)``, ``init`` on a
``[batch, max_len]`` input makes the "cache" collection (Flax's own
``nn.MultiHeadDotProductAttention(decode=True)`` keys and values, and the position
embedding's ``cache_index``), and each ``apply(..., mutable=["cache"])`` takes one token
``[batch, 1]``. In training mode the decoder shifts its input right (position ``i`` sees
tokens ``< i``); in decode mode it does not, so a sequence starts with a 0 (BOS) token and
the logits of the token fed at position ``i`` predict position ``i + 1``.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 64
    emb_dim: int = 32
    num_heads: int = 4
    num_layers: int = 2
    qkv_dim: int = 32
    mlp_dim: int = 64
    max_len: int = 32
    decode: bool = False
    dtype: str = "float32"


def shift_right(x: jax.Array) -> jax.Array:
    """``[b, t]`` -> ``[b, t]``: a 0 in front, the last token dropped."""
    return jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]


class AddPositionEmbs(nn.Module):
    """A learned ``pos_embedding [1, max_len, d]``; in decode mode one position per call,
    read at the cached ``cache_index``."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        pe = self.param("pos_embedding", nn.initializers.normal(0.02),
                        (1, cfg.max_len, x.shape[-1]))
        if cfg.decode:
            initialized = self.has_variable("cache", "cache_index")
            index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.uint32))
            if initialized:
                i = index.value
                index.value = i + 1
                return x + jax.lax.dynamic_slice(pe, (0, i.astype(jnp.int32), 0),
                                                 (1, 1, x.shape[-1]))
        return x + pe[:, : x.shape[1]]


class MlpBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        y = nn.Dense(cfg.mlp_dim, dtype=cfg.dtype)(x)
        return nn.Dense(x.shape[-1], dtype=cfg.dtype)(nn.relu(y))


class EncoderDecoder1DBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None) -> jax.Array:
        cfg = self.config
        y = nn.LayerNorm(dtype=cfg.dtype)(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=cfg.num_heads, qkv_features=cfg.qkv_dim, dtype=cfg.dtype,
            decode=cfg.decode, deterministic=True)(y, mask=mask)
        x = x + y
        return x + MlpBlock(cfg)(nn.LayerNorm(dtype=cfg.dtype)(x))


class Decoder(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        cfg = self.config
        y = inputs if cfg.decode else shift_right(inputs)
        y = nn.Embed(cfg.vocab_size, cfg.emb_dim, name="embed")(y.astype(jnp.int32))
        y = AddPositionEmbs(cfg, name="posembed_output")(y)
        # Decode mode: one token per call, attending to the cache (the cache's own mask).
        mask = None if cfg.decode else nn.make_causal_mask(inputs, dtype=cfg.dtype)
        for i in range(cfg.num_layers):
            y = EncoderDecoder1DBlock(cfg, name=f"encoderdecoderblock_{i}")(y, mask)
        y = nn.LayerNorm(dtype=cfg.dtype, name="encoderdecoder_norm")(y)
        return nn.Dense(cfg.vocab_size, dtype=cfg.dtype, name="logitdense")(y)


class TransformerLM(nn.Module):
    """Tokens ``int32 [batch, t]`` -> logits ``[batch, t, vocab]`` (float32)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        return Decoder(self.config, name="decoder")(inputs).astype(jnp.float32)
