"""Pictures of a mesh and a config (matplotlib): who holds what, which links a collective uses.

* ``plot_partition``: a unit's flat buffer, which device holds each primary slice and, with
  hpZ, each secondary slice (every node keeps a full copy spread over its devices).
* ``plot_links``: the devices as dots inside node boxes, and the links one collective uses
  (intra-node links in one colour, cross-node in another), e.g. the forward all-gather over
  ``("node", "local")`` versus hpZ's backward gather over ``"local"``.
* ``plot_qgz_reorder``: qgZ's slice reorder before the intra-node all-to-all: slice
  ``p = i * L + j`` (node ``i``, local ``j``) moves to slot ``j * nodes + i``.

The layouts are computed by plain functions (``primary_owner``, ``secondary_owners``,
``collective_groups``, ``qgz_slot``) that the pictures draw and the tests check against the
code paths that move the data. Each ``plot_*`` returns a ``matplotlib.figure.Figure``.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

COLLECTIVES = ("all_gather", "hpz_gather", "qgz_intra", "qgz_inter")


def _shape(mesh: Any) -> tuple[int, int]:
    if isinstance(mesh, tuple):
        return int(mesh[0]), int(mesh[1])
    from zeropp_jax.core.mesh import mesh_shape

    return mesh_shape(mesh)


def primary_owner(nodes: int, local: int) -> list[int]:
    """Device owning flat slice ``s`` of ``P = nodes * local`` equal slices: ``s`` itself
    (device ``d = node * L + local``)."""
    return list(range(nodes * local))


def secondary_owners(nodes: int, local: int, group_nodes: int = 1) -> list[list[int]]:
    """hpZ: for each of the ``G = group_nodes * L`` secondary slices, the devices holding it
    (one per group: the device at position ``(node % k) * L + local == slice``)."""
    k, g = group_nodes, group_nodes * local
    return [[n * local + l for n in range(nodes) for l in range(local)
             if (n % k) * local + l == s] for s in range(g)]


def collective_groups(nodes: int, local: int, collective: str) -> list[list[int]]:
    """Device groups (ids ``node * L + local``) a collective communicates within.

    ``all_gather``: ZeRO-3 / qwZ forward gather over both axes (one group of all devices);
    ``hpz_gather``: hpZ's backward gather over ``"local"`` (one group per node);
    ``qgz_intra`` / ``qgz_inter``: qgZ's first all-to-all (inside each node) and second
    (across nodes, between devices with the same local index).
    """
    if collective == "all_gather":
        return [list(range(nodes * local))]
    if collective in ("hpz_gather", "qgz_intra"):
        return [[n * local + l for l in range(local)] for n in range(nodes)]
    if collective == "qgz_inter":
        return [[n * local + l for n in range(nodes)] for l in range(local)]
    raise ValueError(f"collective={collective!r} is invalid; valid values are {COLLECTIVES}")


def qgz_slot(nodes: int, local: int) -> list[int]:
    """qgZ's reorder: slot of slice ``p = i * L + j`` is ``j * nodes + i``."""
    return [(p % local) * nodes + p // local for p in range(nodes * local)]


def _device_xy(nodes: int, local: int) -> dict[int, tuple[float, float]]:
    return {n * local + l: (l * 1.0, -n * 1.3) for n in range(nodes) for l in range(local)}


def plot_links(mesh: Any, collective: str = "all_gather", *, ax: Any = None) -> Any:
    """Devices in node boxes and the links ``collective`` uses (``collective_groups``).

    Cross-node links are drawn red, intra-node links blue; the title counts both.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    nodes, local = _shape(mesh)
    fig, ax = (plt.subplots(figsize=(1.2 * local + 1.5, 1.0 * nodes + 1.0))
               if ax is None else (ax.figure, ax))
    xy = _device_xy(nodes, local)
    cross = intra = 0
    for group in collective_groups(nodes, local, collective):
        for a, b in itertools.combinations(group, 2):
            same = a // local == b // local
            cross, intra = cross + (not same), intra + same
            (x0, y0), (x1, y1) = xy[a], xy[b]
            rad = 0.25 if same and abs(x1 - x0) > 1 else 0.0
            ax.annotate("", (x1, y1), (x0, y0), arrowprops=dict(
                arrowstyle="-", color="tab:blue" if same else "tab:red", alpha=0.6,
                connectionstyle=f"arc3,rad={rad}"))
    for n in range(nodes):
        ax.add_patch(FancyBboxPatch((-0.4, -n * 1.3 - 0.35), local - 0.2, 0.7,
                                    boxstyle="round,pad=0.05", fc="0.93", ec="0.5", zorder=0))
        ax.text(-0.6, -n * 1.3, f"node {n}", ha="right", va="center", fontsize=8)
    for d, (x, y) in xy.items():
        ax.plot(x, y, "o", ms=14, color="white", mec="black", zorder=3)
        ax.text(x, y, str(d), ha="center", va="center", fontsize=7, zorder=4)
    ax.set_title(f"{collective} on {nodes}x{local}: {intra} intra-node, {cross} cross-node "
                 "links", fontsize=9)
    ax.set_xlim(-1.6, local)
    ax.set_ylim(-(nodes - 1) * 1.3 - 0.8, 0.8)
    ax.axis("off")
    return fig


def plot_partition(mesh: Any, config: Any = None, *, ax: Any = None) -> Any:
    """A unit's flat buffer: primary slice owners (top row, one per device) and, with hpZ,
    the secondary slices (bottom row, one per group position; the devices holding each are
    listed in it). Colours: node of the owner."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from zeropp_jax.comm.transports import plan_of
    from zeropp_jax.core.mesh import MeshInfo

    nodes, local = _shape(mesh)
    p = nodes * local
    group = plan_of(config).secondary_devices(MeshInfo(nodes, local)) if config is not None else 0
    hpz = group > 0
    k = group // local if hpz else 1
    fig, ax = plt.subplots(figsize=(max(6, p * 0.8), 2.2)) if ax is None else (ax.figure, ax)
    cmap = plt.get_cmap("tab10")
    for s, d in enumerate(primary_owner(nodes, local)):
        ax.add_patch(Rectangle((s / p, 1.0), 1 / p, 0.8, fc=cmap(d // local % 10), ec="white",
                               alpha=0.85))
        ax.text((s + 0.5) / p, 1.4, f"d{d}", ha="center", va="center", fontsize=7)
    ax.text(-0.01, 1.4, "primary", ha="right", va="center", fontsize=8)
    if hpz:
        owners = secondary_owners(nodes, local, k)
        g = len(owners)
        for s, devs in enumerate(owners):
            ax.add_patch(Rectangle((s / g, 0.0), 1 / g, 0.8, fc="0.85", ec="white"))
            ax.text((s + 0.5) / g, 0.4, ",".join(f"d{d}" for d in devs), ha="center",
                    va="center", fontsize=6)
        ax.text(-0.01, 0.4, "secondary", ha="right", va="center", fontsize=8)
    what = f"hpZ secondary over {k * local} devices" if hpz else "no hpZ"
    ax.set_title(f"flat unit buffer on {nodes}x{local}: primary 1/{p} per device; {what}",
                 fontsize=9)
    ax.set_xlim(-0.12, 1.0)
    ax.set_ylim(-0.1, 1.9)
    ax.axis("off")
    return fig


def plot_qgz_reorder(mesh: Any, *, ax: Any = None) -> Any:
    """qgZ's slice reorder: arrows from slice ``p`` (top) to its slot (bottom)."""
    import matplotlib.pyplot as plt

    nodes, local = _shape(mesh)
    p = nodes * local
    fig, ax = plt.subplots(figsize=(max(6, p * 0.7), 2.0)) if ax is None else (ax.figure, ax)
    cmap = plt.get_cmap("tab10")
    for src, dst in enumerate(qgz_slot(nodes, local)):
        color = cmap(src % local % 10)
        ax.annotate("", (dst, 0.15), (src, 0.85), arrowprops=dict(arrowstyle="->", color=color))
        ax.text(src, 1.0, f"{src}", ha="center", fontsize=7)
        ax.text(dst, -0.1, f"{src}", ha="center", va="top", fontsize=7, color=color)
    ax.set_title(f"qgZ reorder on {nodes}x{local}: slice i*L+j -> slot j*nodes+i "
                 "(colour: destination local index j)", fontsize=9)
    ax.set_xlim(-0.5, p - 0.5)
    ax.set_ylim(-0.4, 1.2)
    ax.axis("off")
    return fig


def plot_overview(mesh: Any, config: Any = None) -> Any:
    """Partition, forward gather, hpZ gather and qgZ reorder for one mesh, in one figure."""
    import matplotlib.pyplot as plt

    nodes, local = _shape(mesh)
    fig, axes = plt.subplots(2, 2, figsize=(12, 3 + nodes * 0.9))
    plot_partition((nodes, local), config, ax=axes[0, 0])
    plot_qgz_reorder((nodes, local), ax=axes[0, 1])
    plot_links((nodes, local), "all_gather", ax=axes[1, 0])
    plot_links((nodes, local), "hpz_gather", ax=axes[1, 1])
    fig.tight_layout()
    return fig


def link_counts(nodes: int, local: int, collective: str) -> tuple[int, int]:
    """(intra-node, cross-node) device pairs linked by ``collective`` (what the plot draws)."""
    intra = cross = 0
    for group in collective_groups(nodes, local, collective):
        for a, b in itertools.combinations(group, 2):
            if a // local == b // local:
                intra += 1
            else:
                cross += 1
    return intra, cross


__all__: Sequence[str] = (
    "COLLECTIVES", "collective_groups", "link_counts", "plot_links", "plot_overview",
    "plot_partition", "plot_qgz_reorder", "primary_owner", "qgz_slot", "secondary_owners",
)
