"""A model with every kind of checkpointed state, for multi-process checkpoint tests.

Trainable units under AdamW, frozen weights stored block-quantized (INT8), and BatchNorm
statistics (a mutable collection, synchronised over the mesh). ``test_multihost.py`` uses
``build``/``step``/``batch`` in its own process and runs this file as the worker of each
process (``python tests/multihost_ckpt.py --process-id K ...``).
"""

from __future__ import annotations

import argparse
import json
import sys

import flax.linen as nn
import jax
import numpy as np
import optax

import zeropp_jax as zpp

CONFIG = dict(compute_dtype="float32", quantize_frozen=True, block_size=32)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        # No bias before BatchNorm: its gradient is zero up to rounding, which Adam would
        # blow up into +-lr steps that differ between meshes.
        y = nn.Dense(32, use_bias=False, name="dense")(x)
        return nn.relu(nn.BatchNorm(use_running_average=not train,
                                    axis_name=("node", "local"), name="bn")(y))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        for i in range(3):
            x = Block(name=f"block_{i}")(x, train)
        return nn.Dense(4, name="head")(x)


def frozen(path: tuple[str, ...]) -> bool:
    """block_0's kernel (a frozen base weight beside its trainable BatchNorm)."""
    return path[0] == "block_0" and path[-1] == "kernel"


def batch(i: int) -> dict:
    rng = np.random.default_rng(1000 + i)
    return {"x": rng.standard_normal((16, 12)).astype(np.float32),
            "y": rng.integers(0, 4, (16,)).astype(np.int32)}


def build(mesh, seed: int = 0) -> zpp.TrainState:
    """A fresh state on ``mesh``. Templates for ``checkpoint.restore`` take another seed,
    so that every restored value (the never-updated frozen weights too) must come from the
    checkpoint for the test to pass."""
    variables = Net().init(jax.random.PRNGKey(seed), batch(0)["x"], train=False)
    return zpp.TrainState.create(model=Net(), params=variables, tx=optax.adamw(1e-2),
                                 mesh=mesh, config=zpp.ZeroPPConfig(**CONFIG), frozen=frozen)


@zpp.train_step
def step(state, b):
    def loss(p):
        out, upd = state.apply_fn({"params": p, "batch_stats": state.batch_stats}, b["x"],
                                  train=True, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(out, b["y"]).mean(), upd

    (value, upd), g = jax.value_and_grad(loss, has_aux=True)(state.params)
    return state.apply_gradients(grads=g, batch_stats=upd["batch_stats"]), value


def flat_state(state: zpp.TrainState) -> dict[str, np.ndarray]:
    """Parameters (frozen ones dequantized) and batch statistics by path, on the host.
    Collective: every process calls it."""
    out = {}
    for prefix, tree in (("params", state.consolidate()),
                         ("batch_stats", jax.tree_util.tree_map(
                             lambda x: np.asarray(x.addressable_shards[0].data),
                             state.batch_stats))):
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            out[prefix + jax.tree_util.keystr(path)] = np.asarray(x)
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--restore", required=True, help="checkpoint written at step 1")
    p.add_argument("--save", required=True, help="where to save after step 3")
    p.add_argument("--out", required=True, help="process 0 writes losses + state here")
    args = p.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=2,
                               process_id=args.process_id, initialization_timeout=60)
    state = zpp.checkpoint.restore(args.restore, build(zpp.make_mesh(2, 2), seed=7))
    losses = []
    for i in range(1, 5):
        state, value = step(state, batch(i))
        losses.append(float(np.asarray(value.addressable_shards[0].data)))
        if i == 2:
            zpp.checkpoint.save(args.save, state)
    final = flat_state(state)
    if jax.process_index() == 0:
        np.savez(args.out, **final)
        with open(args.out + ".json", "w") as f:
            json.dump({"losses": losses, "step": int(np.asarray(
                state.step.addressable_shards[0].data))}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
