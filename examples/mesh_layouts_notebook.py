"""The mesh-layouts notebook as a script: the one source of ``examples/mesh_layouts.ipynb``.

Cells are in the "percent" format: ``# %%`` starts a code cell, ``# %% [markdown]`` a
markdown cell whose lines are ``# ``-prefixed comments. Run it as plain Python:

    .venv/bin/python examples/mesh_layouts_notebook.py

After editing it, regenerate the notebook (tests/integration/test_notebook.py checks that the
two agree):

    .venv/bin/python examples/make_notebook.py

This docstring, above the first cell, is not part of the notebook.
"""

# %% [markdown]
# # Mesh layouts for ZeRO++
#
# Eight simulated CPU devices arranged as 1x8, 2x4, 4x2 and 8x1 `("node", "local")` meshes.
# For each layout: who holds which primary and secondary slice, which links the collectives
# use, qgZ's slice reorder, and the cross-node bytes of one train step per ZeRO++ mode, counted
# from the lowered program by `zeropp_jax.measure.analysis.comm_report`. The model is tiny on purpose
# (the notebook runs in about a minute); the byte counts scale with the parameter count.

# %%
import zeropp_jax as zpp

zpp.simulate_cpu_devices(8)  # first, before any other JAX use

# %%
import jax
import matplotlib.pyplot as plt
import numpy as np
import optax

from zeropp_jax.measure import viz
from zeropp_jax.measure.analysis import comm_report
from zeropp_jax.inference.generate import gather_secondary, lower_decode_step
from zeropp_demo.gpt import GPT, GPTConfig, loss_fn

LAYOUTS = [(1, 8), (2, 4), (4, 2), (8, 1)]
MODES = ["zero3", "qwz", "hpz", "qgz", "qwz_hpz", "zeropp"]
cfg = GPTConfig(vocab_size=64, seq_len=16, layers=2, d_model=32, heads=4)
model = GPT(cfg)
batch = np.random.default_rng(0).integers(0, cfg.vocab_size, (16, cfg.seq_len + 1)).astype(np.int32)
params = model.init(jax.random.PRNGKey(0), batch[:, :-1])["params"]
n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
print(f"{len(jax.devices())} devices; GPT with {n_params:,} parameters")


@zpp.train_step
def step(state, batch):
    def loss_of(p):
        return loss_fn(state.apply_fn({"params": p}, batch[:, :-1]), batch[:, 1:])

    loss, grads = jax.value_and_grad(loss_of)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

# %% [markdown]
# ## Who holds what, and which links each collective uses
#
# Top left: a unit's flat buffer; device `d = node * L + local` owns primary slice `d`; with
# hpZ every node keeps the whole buffer spread over its `L` devices (secondary slices, listed
# with the devices holding each). Top right: qgZ's reorder. Bottom: the forward all-gather
# over both axes (red links cross nodes) and hpZ's backward gather over `"local"`.

# %%
for shape in LAYOUTS:
    fig = viz.plot_overview(shape, zpp.ZeroPPConfig(hpz=True))
    fig.suptitle(f"{shape[0]} node(s) x {shape[1]} device(s)", y=1.02)
    plt.show()

# %% [markdown]
# ## Cross-node bytes per train step, per mode and layout
#
# Bytes crossing node boundaries in one step, per node (all-gathers and reduce-scatters at
# the `(n-1)/n` lower bound, all-to-alls exactly), from the lowered step. bf16 compute, INT8
# weights, INT4 gradients, blocks of 64 elements.

# %%
table = {}
for shape in LAYOUTS:
    mesh = zpp.make_mesh(*shape)
    for mode in MODES:
        config = zpp.ZeroPPConfig.from_mode(mode, block_size=64)
        state = zpp.TrainState.create(model=model, params=params, tx=optax.adam(1e-3),
                                      mesh=mesh, config=config)
        report = comm_report(step.lower(state, batch), mesh)
        table[shape, mode] = report.cross_node_bytes_per_node

header = "| layout | " + " | ".join(MODES) + " |"
print(header)
print("|" + " --- |" * (len(MODES) + 1))
for shape in LAYOUTS:
    cells = " | ".join(f"{table[shape, m]:,.0f}" for m in MODES)
    print(f"| {shape[0]}x{shape[1]} | {cells} |")

# %%
fig, ax = plt.subplots(figsize=(9, 3.5))
width = 0.8 / len(MODES)
for i, mode in enumerate(MODES):
    ax.bar(np.arange(len(LAYOUTS)) + i * width, [table[s, mode] / 1e3 for s in LAYOUTS],
           width, label=mode)
ax.set_xticks(np.arange(len(LAYOUTS)) + 0.4 - width / 2, [f"{n}x{l}" for n, l in LAYOUTS])
ax.set_ylabel("cross-node kB / step / node")
ax.legend(ncol=3, fontsize=8)
plt.show()

# %% [markdown]
# Reading it: a 1x8 mesh has one node, so nothing crosses nodes. ZeRO-3 costs `(n-1)/n`
# of three bf16 model-size transfers per node; qwZ halves the forward gather, hpZ removes the
# backward gather from the inter-node links (the more devices per node, the smaller the
# secondary), qgZ replaces the bf16 reduce-scatter with INT4 all-to-alls. On 8x1 every node
# is a single device, so hpZ's secondary is the full model and qgZ's inner hop is empty.

# %% [markdown]
# ## Three axes: tensor parallelism beside ZeRO
#
# `make_mesh(nodes, local, model=T)` adds a `"model"` axis, innermost: a tensor-parallel
# group is `T` consecutive devices of one node. The same GPT, its weights annotated with
# logical names (`GPTConfig(logical_axes=True)`), is split by Megatron's rules: each device
# stores its share of one tensor-parallel slice, ZeRO gathers and reduce-scatters each slice
# over the devices that hold it (the data axes), and XLA adds tensor parallelism's own
# collectives over `"model"`. Per layout, from the compiled ZeRO++ step: the groups, and the
# collectives by the axes they span.

# %%
import dataclasses

from zeropp_demo.gpt import MEGATRON_RULES

tp_model = GPT(dataclasses.replace(cfg, logical_axes=True))
tp_variables = tp_model.init(jax.random.PRNGKey(0), batch[:, :-1])
for shape in [(2, 4, 1), (2, 2, 2), (1, 2, 4)]:
    mesh = zpp.make_mesh(*shape[:2], model=shape[2])
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(-1, shape[2])
    state = zpp.TrainState.create(model=tp_model, params=tp_variables, tx=optax.adam(1e-3),
                                  mesh=mesh, config=zpp.ZeroPPConfig.zeropp(block_size=64),
                                  logical_axis_rules=MEGATRON_RULES)
    report = comm_report(step.lower(state, batch).compile(), mesh)
    print(f"{shape[0]} node(s) x {shape[1]} x {shape[2]} (model): tensor-parallel groups "
          f"{ids.tolist()}, data groups {ids.T.tolist()}")
    for axis, d in sorted(report.by_axis().items()):
        print(f"   over {axis:5} axes: {d['count']:3.0f} collectives, cross-node "
              f"{d['cross_node_bytes']:>9,.0f} B, inside nodes {d['intra_node_bytes']:>11,.0f} B")

# %% [markdown]
# Reading it: ZeRO's collectives (data) are the only ones crossing nodes, and with `T`
# slices each moves a `1/T` slice over `nodes * local` devices; tensor parallelism's
# (model) never leave the node. On one node (1x2x4) nothing crosses nodes at all.

# %% [markdown]
# ## Generation: one cross-node gather, then decode steps inside the node

# %%
prompts = batch[:8, :4]
for shape in LAYOUTS:
    mesh = zpp.make_mesh(*shape)
    state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.0), mesh=mesh)
    once = comm_report(gather_secondary.lower(state), mesh).cross_node_bytes_per_node
    secondary = gather_secondary(state)
    per_step = comm_report(lower_decode_step(state, secondary, np.zeros((8, cfg.seq_len), np.int32), 4),
                           mesh).cross_node_bytes_per_node
    print(f"{shape[0]}x{shape[1]}: secondary gather {once:>9,.0f} B/node once, "
          f"decode step {per_step:,.0f} B/node")
