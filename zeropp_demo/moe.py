"""A small mixture-of-experts language model in plain Flax linen, GShard style (nothing
ZeRO-specific in it).

Each MoE layer routes every token to its top-2 experts (softmax router, gates renormalised
over the two). Each sequence is its own routing group: expert ``e`` takes at most
``capacity`` tokens of a sequence (first come, first served; a token past an expert's
capacity skips that expert), so routing never looks across sequences and a batch split
over devices routes each sequence exactly as one device would. Dispatch and combine are
einsums with one-hot ``[batch, seq, experts, capacity]`` masks.

Sharding is named with Flax logical axes (``nn.with_logical_partitioning`` on the
parameters, ``nn.with_logical_constraint`` on activations): the experts' leading
dimension is ``"exp"``, the batch ``"batch"``. With ``MOE_RULES`` on an expert mesh
(``zeropp_jax.make_mesh(..., expert=E)``) the experts are split over ``"expert"``, and the
constraint on the dispatched tokens (``[experts, batch, capacity, d]``, split by experts)
against the batch-split activations is what makes XLA move the tokens to their experts
and back by all-to-all. Without rules (one device) the constraints do nothing.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    vocab_size: int = 64
    seq_len: int = 12
    d_model: int = 16
    hidden: int = 32  # each expert's (and the dense MLP's) hidden width
    experts: int = 4
    capacity: int = 8  # tokens of one sequence an expert takes at most
    layers: int = 2  # MoE layers, each after a dense MLP layer
    dtype: str = "float32"
    # The blocks as one ``nn.scan`` (MaxText's layout: every parameter with a leading
    # ``"layers"`` axis, one compiled block body), instead of ``layers`` modules.
    scan: bool = False


# The experts' dimension over the mesh's "expert" axis, the batch over every axis that
# splits it (the data axes are ZeRO's own: the step maps "batch" to "expert" alone).
MOE_RULES = (("exp", "expert"), ("batch", ("node", "local", "expert")), ("embed", None),
             ("mlp", None), ("vocab", None), ("length", None), ("layers", None))


def _init(scale: float):
    return nn.initializers.normal(stddev=scale)


def top2_masks(probs: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Router probabilities ``[b, s, E]`` -> (dispatch ``[b, s, E, C]`` 0/1, combine
    ``[b, s, E, C]`` gate weights): each token's two most likely experts, at the next free
    slot of each within its sequence (first choices before second choices), dropped where
    the expert's ``C`` slots are full."""
    num = probs.shape[-1]
    gates, index = jax.lax.top_k(probs, 2)  # [b, s, 2]
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    first = jax.nn.one_hot(index[..., 0], num, dtype=jnp.int32)  # [b, s, E]
    second = jax.nn.one_hot(index[..., 1], num, dtype=jnp.int32)
    pos1 = jnp.cumsum(first, axis=1) - 1
    pos2 = jnp.cumsum(second, axis=1) - 1 + jnp.sum(first, axis=1, keepdims=True)
    dispatch = jnp.zeros(probs.shape + (capacity,), probs.dtype)
    combine = jnp.zeros_like(dispatch)
    for mask, pos, gate in ((first, pos1, gates[..., 0]), (second, pos2, gates[..., 1])):
        slot = jax.nn.one_hot(jnp.where(mask > 0, pos, -1), capacity, dtype=probs.dtype)
        dispatch = dispatch + slot  # a position >= capacity one-hots to zeros: dropped
        combine = combine + slot * gate[..., None, None]
    return dispatch, combine


class MoELayer(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        d, e, h = cfg.d_model, cfg.experts, cfg.hidden
        router = self.param("router", nn.with_logical_partitioning(
            _init(d ** -0.5), ("embed", None)), (d, e))
        wi = self.param("wi", nn.with_logical_partitioning(
            _init(d ** -0.5), ("exp", "embed", "mlp")), (e, d, h))
        wo = self.param("wo", nn.with_logical_partitioning(
            _init(h ** -0.5), ("exp", "mlp", "embed")), (e, h, d))
        probs = jax.nn.softmax(jnp.einsum("bsd,de->bse", x, router.astype(dt)), axis=-1)
        dispatch, combine = top2_masks(probs, cfg.capacity)
        # Routing stays with the tokens (split by batch); the dispatched tokens are split by
        # expert: between the two, XLA moves the tokens by all-to-all.
        masks = ("batch", "length", None, None)
        dispatch = nn.with_logical_constraint(dispatch, masks)
        combine = nn.with_logical_constraint(combine, masks)
        tokens = jnp.einsum("bsec,bsd->ebcd", dispatch, x)
        tokens = nn.with_logical_constraint(tokens, ("exp", None, None, "embed"))
        hidden = nn.gelu(jnp.einsum("ebcd,edh->ebch", tokens, wi.astype(dt)))
        out = jnp.einsum("ebch,ehd->ebcd", hidden, wo.astype(dt))
        out = nn.with_logical_constraint(out, ("exp", None, None, "embed"))
        y = jnp.einsum("bsec,ebcd->bsd", combine, out)
        return nn.with_logical_constraint(y, ("batch", "length", "embed"))


class DenseMLP(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        up = nn.Dense(cfg.hidden, dtype=dt, kernel_init=nn.with_logical_partitioning(
            _init(cfg.d_model ** -0.5), ("embed", "mlp")), name="up")
        down = nn.Dense(cfg.d_model, dtype=dt, kernel_init=nn.with_logical_partitioning(
            _init(cfg.hidden ** -0.5), ("mlp", "embed")), name="down")
        return down(nn.gelu(up(x)))


class Block(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        names = ("batch", "length", "embed")
        x = nn.with_logical_constraint(x, names)
        x = x + DenseMLP(self.cfg, name="mlp")(nn.LayerNorm(dtype=self.cfg.dtype)(x))
        x = nn.with_logical_constraint(x, names)
        x = x + MoELayer(self.cfg, name="moe")(nn.LayerNorm(dtype=self.cfg.dtype)(x))
        return nn.with_logical_constraint(x, names)


class ScanBlock(nn.Module):
    """``Block`` in ``nn.scan``'s carry form."""

    cfg: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        return Block(self.cfg, name="block")(x), None


class MoELM(nn.Module):
    """Tokens ``int32 [b, s]`` -> logits ``[b, s, vocab]``: an embedding, ``layers`` blocks
    (a dense MLP, then a top-2 MoE layer, each pre-norm and residual), a norm and an
    untied head."""

    cfg: MoEConfig

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        cfg = self.cfg
        emb = self.param("embed", nn.with_logical_partitioning(
            _init(1.0), ("vocab", "embed")), (cfg.vocab_size, cfg.d_model))
        pos = self.param("pos", nn.with_logical_partitioning(
            _init(0.02), ("length", "embed")), (cfg.seq_len, cfg.d_model))
        x = (emb[ids] + pos[None, : ids.shape[1]]).astype(cfg.dtype)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        if cfg.scan:
            stack = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=cfg.layers, metadata_params={nn.PARTITION_NAME: "layers"})
            x, _ = stack(cfg, name="layers")(x, None)
        else:
            for i in range(cfg.layers):
                x = Block(cfg, name=f"block_{i}")(x)
        x = nn.LayerNorm(dtype=cfg.dtype, name="norm")(x)
        return nn.Dense(cfg.vocab_size, dtype=cfg.dtype, name="head", kernel_init=(
            nn.with_logical_partitioning(_init(cfg.d_model ** -0.5), ("embed", "vocab"))))(x)
