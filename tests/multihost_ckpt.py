"""A model with every kind of checkpointed state, for multi-process checkpoint tests.

Trainable units under AdamW, frozen weights stored block-quantized (INT8), and BatchNorm
statistics (a mutable collection, synchronised over the mesh). ``test_multihost.py`` uses
``build``/``step``/``batch``/``state_arrays`` in its own process and runs this file as the
worker of each process (``python tests/multihost_ckpt.py --process-id K ...``).
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

import flax.linen as nn
import jax
import numpy as np
import optax

import zeropp_jax as zpp

CONFIG = dict(compute_dtype="float32", quantize_frozen=True, block_size=32)
ROWS = 16  # the global batch: 2, 4 and 8 rows per device on 8, 4 and 2 devices


class Block(nn.Module):
    # ``reference``: the one-device twin ``first_step_bound`` bounds (BatchNorm over the
    # whole batch, no mesh axis).
    reference: bool = False

    @nn.compact
    def __call__(self, x, train):
        # No bias before BatchNorm: its gradient is zero up to rounding, which Adam would
        # blow up into +-lr steps that differ between meshes. tanh, not relu: a step with
        # no comparison in it lies within its first-order rounding bound
        # (``first_step_bound``) whatever its inputs, while relu's x > 0 goes the other way
        # where x lies within its rounding bound of 0 (tests/running_error.py counts those
        # and the bound does not hold there): one of a step's 1536 relu inputs did, on 2
        # of 60 fresh seeds.
        y = nn.Dense(32, use_bias=False, name="dense")(x)
        return nn.tanh(nn.BatchNorm(use_running_average=not train,
                                    axis_name=None if self.reference else ("node", "local"),
                                    name="bn")(y))


class Net(nn.Module):
    reference: bool = False

    @nn.compact
    def __call__(self, x, train):
        for i in range(3):
            x = Block(reference=self.reference, name=f"block_{i}")(x, train)
        return nn.Dense(4, name="head")(x)


def frozen(path: tuple[str, ...]) -> bool:
    """block_0's kernel (a frozen base weight beside its trainable BatchNorm)."""
    return path[0] == "block_0" and path[-1] == "kernel"


def batch(i: int, seed: int) -> dict:
    """Step ``i``'s global batch of the run drawn from ``seed``."""
    rng = np.random.default_rng([seed, i])
    return {"x": rng.standard_normal((ROWS, 12)).astype(np.float32),
            "y": rng.integers(0, 4, (ROWS,)).astype(np.int32)}


def build(mesh, seed: int) -> zpp.TrainState:
    """A fresh state on ``mesh``, its weights drawn from ``seed``. Templates for
    ``checkpoint.restore`` take another seed, so that every restored value (the
    never-updated frozen weights too) must come from the checkpoint for the test to pass."""
    variables = Net().init(jax.random.PRNGKey(seed), batch(0, seed)["x"], train=False)
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


def _replicated(x) -> np.ndarray:
    """A replicated array's value, from this process's first shard (no collective)."""
    return np.asarray(x.addressable_shards[0].data)


def state_arrays(state: zpp.TrainState) -> dict[str, np.ndarray]:
    """Everything the checkpoint carries, by path, on the host: the parameters (the frozen
    ones dequantized from their INT8 values and scales), AdamW's moments (``mu``, ``nu``,
    by parameter path: the flat units unflattened by this mesh's layouts, padding dropped)
    and step count, the BatchNorm statistics, the step. Collective: every process calls
    it."""
    adam = state.opt_state[0]
    assert isinstance(adam, optax.ScaleByAdamState), type(adam)
    trees = {"params": state.consolidate(),
             "mu": state.engine.consolidate(SimpleNamespace(units=adam.mu)),
             "nu": state.engine.consolidate(SimpleNamespace(units=adam.nu)),
             "batch_stats": jax.tree_util.tree_map(_replicated, state.batch_stats)}
    out = {"step": _replicated(state.step), "count": _replicated(adam.count)}
    for prefix, tree in trees.items():
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            out[prefix + jax.tree_util.keystr(path)] = np.asarray(x)
    return out


def tree_of(arrays: dict[str, np.ndarray], prefix: str, like) -> dict:
    """The tree shaped like ``like`` whose leaves are ``arrays[prefix + path]``."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: arrays[prefix + jax.tree_util.keystr(path)], like)


def _reference_step(params, stats, x, y):
    """One step's loss and new BatchNorm statistics on one device (``Net(reference=True)``)."""
    out, upd = Net(reference=True).apply({"params": params, "batch_stats": stats}, x,
                                         train=True, mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(out, y).mean(), upd["batch_stats"]


def first_step_bound(arrays: dict[str, np.ndarray], b: dict, like: dict):
    """The loss and the new BatchNorm statistics of a step from the state in ``arrays``
    (``state_arrays``) on batch ``b``, exact, and a bound on how far any fp32 step on any
    mesh of 2^k devices lies from them: ``(exact_loss, exact_stats, loss_bound,
    stats_bound(n_devices), flips)``. ``like``: ``{"params": ..., "batch_stats": ...}``
    trees for the structure.

    tests/running_error.py derives the bound from the operations of the one-device step
    (``_reference_step``): a step on a mesh does those operations with its sums split over
    devices (BatchNorm's statistics: per-device means, then ``lax.pmean``; the loss: the
    mean over devices of each device's mean) and exact scalings by powers of 2, so it lies
    within the bound. The statistics then go through one more operation the reference does
    not have: the step keeps the mean over its ``n`` devices of what each computed
    (``Engine`` averages mutable collections), ``n`` copies of one value summed in some
    order and divided by ``n`` (exact): at most ``gamma_{n-1} |s|`` more (Higham ch. 4).
    The frozen weights enter as the exact dequantized values (each an INT8 value times its
    block's scale, one correctly rounded product, the same bits in every program)."""
    from running_error import U32, running_error_bound

    params = tree_of(arrays, "params", like["params"])
    stats = tree_of(arrays, "batch_stats", like["batch_stats"])
    (loss, new_stats), (loss_bound, stats_bound), flips = running_error_bound(
        _reference_step, params, stats, b["x"], b["y"])

    def stats_bound_on(n: int):
        gamma = (n - 1) * U32 / (1 - (n - 1) * U32)
        return jax.tree_util.tree_map(lambda e, bd: bd + gamma * (np.abs(e) + bd),
                                      new_stats, stats_bound)

    return float(loss), new_stats, float(loss_bound), stats_bound_on, flips


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--seed", type=int, required=True, help="the run's weights and batches")
    p.add_argument("--restore", required=True, help="checkpoint written at step 1")
    p.add_argument("--save", required=True, help="where to save after step 2 (at step 3)")
    p.add_argument("--out", required=True, help="process 0 writes losses + states here")
    args = p.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=2,
                               process_id=args.process_id, initialization_timeout=60)
    state = zpp.checkpoint.restore(args.restore, build(zpp.make_mesh(2, 2), seed=args.seed + 1))
    # What the restore gave, what the first step after it computed, what the save after
    # step 2 wrote (read back after saving: the save leaves the state as it was), and
    # what the step after the save computed.
    out = {f"restored:{k}": v for k, v in state_arrays(state).items()}
    losses = {}
    for i in range(1, 4):
        state, value = step(state, batch(i, args.seed))
        losses[i] = float(_replicated(value))
        if i in (1, 3):
            out.update({f"after_{i}:batch_stats{jax.tree_util.keystr(path)}": _replicated(x)
                        for path, x in jax.tree_util.tree_flatten_with_path(
                            state.batch_stats)[0]})
        if i == 2:
            zpp.checkpoint.save(args.save, state)
            out.update({f"saved:{k}": v for k, v in state_arrays(state).items()})
    if jax.process_index() == 0:
        np.savez(args.out, **out)
        with open(args.out + ".json", "w") as f:
            json.dump({"losses": losses, "step": int(_replicated(state.step))}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
