"""The two train steps the GPU benchmarks compile: a plain ``jax.jit`` step (the peer's,
and the one-GPU baseline) and zeropp_jax's step, both on the Llama's next-token loss."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import zeropp_jax as zpp
from benchmarks.gpu_cluster.llama import loss


def plain_step(model: Any, tx: optax.GradientTransformation) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``: fp32 ``params``
    cast to bf16 before the forward (so a sharded step gathers 16-bit weights), the
    update under ``named_scope("optimizer")`` (its kernels' class in ``compute_by_class``).
    ``batch``: ``int32 [batch, seq + 1]`` tokens. Not jitted."""

    def step(params, opt_state, batch):
        def loss_of(p):
            p16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), p)
            return loss(model.apply({"params": p16}, batch[:, :-1]), batch[:, 1:])

        value, grads = jax.value_and_grad(loss_of)(params)
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state, value

    return step


def zero_step() -> Callable:
    """zeropp_jax's donated step: ``step(state, batch) -> (state, {"loss": loss})``."""

    @zpp.train_step(donate_state=True)
    def step(state, batch):
        def loss_of(p):
            return loss(state.apply_fn({"params": p}, batch[:, :-1]), batch[:, 1:])

        value, grads = jax.value_and_grad(loss_of)(state.params)
        return state.apply_gradients(grads=grads), {"loss": value}

    return step
