"""The README's "Use it" snippet as a complete program: ZeRO-3 on 2 nodes x 4 simulated CPU devices.

    .venv/bin/python examples/quickstart.py        # about 15 s on 2 CPU cores

A small Flax linen language model (embedding, two residual MLP blocks, head) learns to
predict the next token of counting sequences (t, t+1, t+2, ... mod 64). Its parameters,
gradients and AdamW state are partitioned over all 8 devices; each step prints the loss of
the global batch. At the end ``state.consolidate()`` gives plain Flax params back.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import zeropp_jax as zpp

zpp.simulate_cpu_devices(8)                  # CPU only; first thing, before other JAX calls

VOCAB, SEQ, BATCH, STEPS = 64, 32, 16, 12


class Block(nn.Module):  # one unit: its weights are gathered just before each call
    d: int

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(self.d)(nn.gelu(nn.Dense(4 * self.d)(nn.LayerNorm()(x))))


class TinyLM(nn.Module):  # a plain Flax model: nothing ZeRO-specific in it
    d: int = 64

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, self.d)(tokens)
        x = Block(self.d)(x)
        x = Block(self.d)(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets).mean()


def counting_batch(i):  # [BATCH, SEQ + 1] int32: each row counts up from a random start
    start = np.random.default_rng(i).integers(0, VOCAB, (BATCH, 1))
    return ((start + np.arange(SEQ + 1)) % VOCAB).astype(np.int32)


model, rng, tokens = TinyLM(), jax.random.PRNGKey(0), counting_batch(0)[:, :-1]

mesh = zpp.make_mesh(nodes=2, local=4)       # multi-host: make_mesh() infers both
params = model.init(rng, tokens)["params"]   # any Flax linen model, unmodified
state = zpp.TrainState.create(model=model, params=params, tx=optax.adamw(3e-3),
                              mesh=mesh, config=zpp.ZeroPPConfig.zero3())


@zpp.train_step
def step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch[:, :-1])
        return cross_entropy(logits, batch[:, 1:])
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


losses = []
for i in range(1, STEPS + 1):
    batch = counting_batch(i)
    state, metrics = step(state, batch)          # batch: global, split over all 8 devices
    losses.append(float(metrics["loss"]))
    print(f"step {i:3d}  loss {losses[-1]:.4f}", flush=True)

tree = jax.tree_util.tree_structure(params)
params = state.consolidate()                 # plain Flax params again (DeepSpeed's zero_to_fp32)
assert jax.tree_util.tree_structure(params) == tree
n = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {STEPS} steps on a 2x4 mesh; "
      f"consolidate(): {n:,} parameters, the tree model.init returned")
