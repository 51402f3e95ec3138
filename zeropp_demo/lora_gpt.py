"""The GPT of ``models/gpt.py`` with LoRA adapters on every Dense of its blocks.

``LoRADense`` keeps a Dense's ``kernel`` and ``bias`` under their usual names and adds
``lora_a [in, rank]`` (small random) and ``lora_b [rank, out]`` (zeros), computing
``x @ kernel + bias + (alpha / rank) * (x @ lora_a) @ lora_b``. At initialization the adapters
add nothing, so ``LoRAGPT`` with a GPT's weights computes that GPT exactly; ``with_base``
builds its params from a GPT's. Freeze everything but the adapters with
``is_frozen = lambda path: not is_adapter(path)``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from zeropp_demo.gpt import GPTConfig, cached_attention, cached_positions, causal_attention


def is_adapter(path: tuple[str, ...]) -> bool:
    """True for LoRA adapter parameters (the trainable ones in LoRA fine-tuning)."""
    return path[-1].startswith("lora_")


class LoRADense(nn.Module):
    features: int
    rank: int = 4
    alpha: float = 8.0
    dtype: Any = "float32"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (d, self.features))
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        a = self.param("lora_a", nn.initializers.normal(1.0 / d**0.5), (d, self.rank))
        b = self.param("lora_b", nn.initializers.zeros, (self.rank, self.features))
        x = x.astype(self.dtype)
        y = x @ kernel.astype(self.dtype) + bias.astype(self.dtype)
        return y + (self.alpha / self.rank) * ((x @ a.astype(self.dtype)) @ b.astype(self.dtype))


class LoRABlock(nn.Module):
    config: GPTConfig
    rank: int = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, r = self.config, self.rank
        b, t, d = x.shape
        hd = d // cfg.heads
        h = nn.LayerNorm(dtype=cfg.dtype, name="ln1")(x)
        qkv = LoRADense(3 * d, r, dtype=cfg.dtype, name="qkv")(h)
        q, k, v = jnp.split(qkv.reshape(b, t, 3, cfg.heads, hd), 3, axis=2)
        attend = (lambda *a: cached_attention(self, *a)) if cfg.decode else causal_attention
        att = attend(q[:, :, 0], k[:, :, 0], v[:, :, 0]).reshape(b, t, d)
        x = x + LoRADense(d, r, dtype=cfg.dtype, name="proj")(att)
        h = nn.LayerNorm(dtype=cfg.dtype, name="ln2")(x)
        h = LoRADense(cfg.mlp_ratio * d, r, dtype=cfg.dtype, name="fc")(h)
        return x + LoRADense(d, r, dtype=cfg.dtype, name="out")(jax.nn.gelu(h))


class LoRAGPT(nn.Module):
    """Tokens ``[batch, seq]`` int32 -> logits ``[batch, seq, vocab]`` float32.

    Block parameters are named ``block_i/{ln1, qkv, proj, ln2, fc, out}``: ``qkv`` and
    ``proj`` sit directly in the block (GPT has them under ``attn``); ``with_base`` maps.
    With ``GPTConfig(decode=True)`` it decodes incrementally as ``GPT`` does (a "cache"
    collection, Flax's decode convention).
    """

    config: GPTConfig
    rank: int = 4

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        x = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name="wte")(tokens)
        t = tokens.shape[1]
        positions = cached_positions(self, t) if cfg.decode else jnp.arange(t)
        pos = nn.Embed(cfg.seq_len, cfg.d_model, dtype=cfg.dtype, name="wpe")(positions)
        x = x + pos[None]
        for i in range(cfg.layers):
            x = LoRABlock(cfg, self.rank, name=f"block_{i}")(x)
        x = nn.LayerNorm(dtype=cfg.dtype, name="ln_f")(x)
        return nn.Dense(cfg.vocab_size, dtype=cfg.dtype, name="head")(x).astype(jnp.float32)


def with_base(lora_params: dict, gpt_params: dict) -> dict:
    """LoRAGPT params whose base weights are a GPT's (adapters kept from ``lora_params``)."""
    out = jax.tree_util.tree_map(lambda x: x, lora_params)
    for name, sub in gpt_params.items():
        if not name.startswith("block_"):
            out[name] = sub
            continue
        for mod, leaves in sub.items():
            if mod == "attn":
                for inner, w in leaves.items():
                    out[name][inner] = {**out[name][inner], **w}
            else:
                out[name][mod] = {**out[name][mod], **leaves}
    return out
