"""Peer rows for ``benchmarks/cluster/run.py``: the same GPT trained by what a user would pick
instead of zeropp_jax, plus an instrumented zeropp_jax step for profiling.

One process per node (``ip netns exec``), speaking the stdin/stdout protocol of the node
worker of the zeropp_jax rows, ``benchmarks/cluster/node.py``: after the compiling step it
prints ``ZPP-READY {json}``, then every stdin line ``{"steps": k, "warmup": w, "label":
...}`` runs ``w`` untimed and ``k`` timed steps and prints one ``ZPP-PHASE {json}`` line (``times``, ``tx_bytes``/``rx_bytes`` on
``--net-iface`` between the phase's start and end barriers, ``losses``); ``quit`` stops.

``--impl``:

* ``jax_fsdp``: JAX-native FSDP, the MaxText/GSPMD way: every parameter (and its AdamW
  moments) sharded with ``NamedSharding`` over all devices along its largest divisible
  dimension, a plain ``jax.jit`` step (``in_shardings``/``out_shardings``, state donated);
  XLA's SPMD partitioner inserts the all-gathers and reduce-scatters.
* ``jax_dp``: plain data parallelism: parameters and optimizer state replicated, batch
  sharded, ``jax.jit`` (XLA inserts the gradient all-reduce).
* ``torch_fsdp2``: PyTorch FSDP2 (``fully_shard`` on every block and on the root,
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``, ``torch.optim.AdamW``,
  gloo), the same GPT re-created in torch, ``--local-devices`` ranks per node, one process
  per rank (this node process spawns them and relays the protocol); ``torch.set_num_threads``
  per rank = ``--torch-threads`` (default 1, what ``torchrun`` sets with several ranks per
  node).
* ``probe_psum``: no model: a ``shard_map`` step of ``--probe-k`` chained ``psum``s of
  ``f32[--probe-elems]`` over all devices (each depends on the previous one), so the step
  time / k is the latency of one cross-process collective on this cluster (gloo, 2
  processes sharing the cores), the fixed cost every collective of a train step pays.
* ``zpp``: zeropp_jax exactly as ``node.py`` builds it (``--mode``,
  ``--reduce-scatter``, ``--all-gather``), with the profiling hooks below.

Model, data and optimizer (AdamW, weight decay 0.01, ``lr_schedule``) are
``node.py``'s, so every JAX row starts from the same parameters and batches.

Profiling hooks (JAX impls): ``--sync float`` (default: ``float(loss)`` after every step, as
``node.py``), ``block`` (``jax.block_until_ready`` on the loss), ``none`` (no
per-step sync: the phase's wall time / steps, steps dispatched back to back);
every phase also reports per step the host time to build the batch, the time until the step
call returned (dispatch) and the time until its result was ready. ``--trace-dir DIR``: the
first phase whose label is ``--trace-label`` runs under ``jax.profiler.trace(DIR/node<i>)``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from typing import Any, Callable

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.cluster import node  # noqa: E402
from benchmarks.cluster.node import commands, net_counters  # noqa: E402

IMPLS = ["jax_fsdp", "jax_dp", "torch_fsdp2", "zpp", "probe_psum"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--impl", required=True, choices=IMPLS)
    node.add_cluster_arguments(p)
    p.add_argument("--mode", default="zero3", help="zeropp_jax mode (--impl zpp)")
    p.add_argument("--reduce-scatter", default=None, choices=["flat", "hierarchical"])
    p.add_argument("--all-gather", default=None, choices=["flat", "hierarchical"],
                   help="zpp: ZeroPPConfig.all_gather (as node.py --all-gather)")
    node.add_model_arguments(p)
    p.add_argument("--net-iface", default=None)
    p.add_argument("--comm-report", action="store_true",
                   help="node 0 reports the compiled program's cross-node bytes (JAX impls) or "
                        "the analytic lower bound (torch)")
    p.add_argument("--sync", default="float", choices=["float", "block", "none"])
    p.add_argument("--trace-dir", type=pathlib.Path, default=None)
    p.add_argument("--trace-label", default=None,
                   help="trace the first phase with this label (default: the first phase; "
                        "'*each*': the first phase of every label, to DIR/LABEL/node<i>)")
    p.add_argument("--standalone", action="store_true",
                   help="no jax.distributed and no network: one process with "
                        "--local-devices devices training one node's share of the batch "
                        "(--batch / --num-processes), collectives in-process (torch_fsdp2: "
                        "each rank alone in a process group of one); the step's compute "
                        "floor for one node (run --num-processes of them at once to share "
                        "the cores as the cluster's node processes do)")
    p.add_argument("--probe-k", type=int, default=32, help="probe_psum: chained psums per step")
    p.add_argument("--probe-elems", type=int, default=256, help="probe_psum: f32 elements each")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--torch-barrier", action="store_true",
                   help="torch: dist.barrier() after every step (default: loss.item() only)")
    return p.parse_args(argv)


def safe_label(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in label)


def build_args(args: argparse.Namespace) -> argparse.Namespace:
    """``node.py``'s own arguments for these settings (its parser, so options it
    gains later get their defaults)."""
    argv = ["--coordinator", args.coordinator, "--num-processes", str(args.num_processes),
            "--process-id", str(args.process_id), "--local-devices", str(args.local_devices),
            "--init-timeout", str(args.init_timeout),
            "--mode", args.mode if args.impl == "zpp" else "zero3",
            "--steps", str(args.steps), "--batch", str(args.batch),
            "--seq-len", str(args.seq_len), "--layers", str(args.layers),
            "--d-model", str(args.d_model), "--heads", str(args.heads), "--lr", str(args.lr),
            "--compute-dtype", args.compute_dtype, "--seed", str(args.seed)]
    if args.reduce_scatter is not None:
        argv += ["--reduce-scatter", args.reduce_scatter]
    if args.all_gather is not None:
        argv += ["--all-gather", args.all_gather]
    return node.parse_args(argv)


def flax_param_count(args: argparse.Namespace) -> int:
    """Parameters of zeropp_jax's GPT for these settings (shapes only, nothing computed)."""
    import jax
    import numpy as np

    from zeropp_demo.data import VOCAB_SIZE
    from zeropp_demo.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=VOCAB_SIZE, seq_len=args.seq_len, layers=args.layers,
                          d_model=args.d_model, heads=args.heads, dtype=args.compute_dtype))
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0),
                            jax.ShapeDtypeStruct((1, args.seq_len), np.int32))
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))


# -- JAX rows ----------------------------------------------------------------------------------


def largest_divisible_dim(shape: tuple[int, ...], n: int) -> int | None:
    """The largest dimension of ``shape`` divisible by ``n`` (first one on ties), or None."""
    best = None
    for d, size in enumerate(shape):
        if size % n == 0 and (best is None or size > shape[best]):
            best = d
    return best


def jax_peer(args: argparse.Namespace) -> tuple[Callable, dict, Any]:
    """A ``jax.jit`` step on a 1-D mesh over all devices (process-major, so device
    ``node * local + i``). Returns ``(step(batch_np) -> loss array, info, training data)``."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from zeropp_demo.gpt import loss_fn

    parts = node.build(build_args(args))
    model, tx = parts["model"], parts["tx"]
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    n = len(devices)
    mesh = Mesh(np.array(devices), ("fsdp",))
    replicated = NamedSharding(mesh, P())

    def param_sharding(x: Any) -> NamedSharding:
        if args.impl == "jax_dp":
            return replicated
        d = largest_divisible_dim(x.shape, n)
        if d is None:
            return replicated
        spec = [None] * len(x.shape)
        spec[d] = "fsdp"
        return NamedSharding(mesh, P(*spec))

    host = jax.tree_util.tree_map(np.asarray, jax.device_get(parts["params"]))
    p_shard = jax.tree_util.tree_map(param_sharding, host)
    params = jax.tree_util.tree_map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]), host, p_shard)
    # Moments sharded like their parameters (the MaxText way: out_shardings from the
    # parameters' shardings); the step count replicated.
    o_shapes = jax.eval_shape(tx.init, params)
    leaf_sharding = {}
    for path, s in jax.tree_util.tree_flatten_with_path(p_shard)[0]:
        leaf_sharding[jax.tree_util.keystr(path)] = s

    def opt_sharding(path: Any, x: Any) -> NamedSharding:
        key = jax.tree_util.keystr(path)
        hits = [pk for pk, s in leaf_sharding.items()
                if key.endswith(pk) and len(x.shape) == len(s.spec)]
        return leaf_sharding[max(hits, key=len)] if hits else replicated

    o_shard = jax.tree_util.tree_map_with_path(opt_sharding, o_shapes)
    opt_state = jax.jit(tx.init, out_shardings=o_shard)(params)
    b_shard = NamedSharding(mesh, P("fsdp", None))

    def train_step(params: Any, opt_state: Any, batch: jax.Array) -> Any:
        def loss_of(p: Any) -> jax.Array:
            return loss_fn(model.apply({"params": p}, batch[:, :-1]), batch[:, 1:])

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(train_step, in_shardings=(p_shard, o_shard, b_shard),
                     out_shardings=(p_shard, o_shard, replicated), donate_argnums=(0, 1))
    state = {"params": params, "opt": opt_state}

    def place(batch_np: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(batch_np.shape, b_shard, lambda idx: batch_np[idx])

    predicted = None
    if args.comm_report:
        t0 = time.perf_counter()
        predicted = node.comm_prediction(
            jitted.lower(params, opt_state, place(parts["first"])),
            (args.num_processes, args.local_devices), t0, from_lowered=False)

    def step(batch_np: np.ndarray) -> Any:
        state["params"], state["opt"], loss = jitted(state["params"], state["opt"], place(batch_np))
        return loss

    sharded = sum(1 for s in jax.tree_util.tree_leaves(p_shard) if s.spec != P())
    info = {"params": parts["n_params"], "predicted": predicted, "reduce_scatter": None,
            "sharded_param_leaves": sharded,
            "param_leaves": len(jax.tree_util.tree_leaves(p_shard))}
    return step, info, parts["data"]


def probe_step(args: argparse.Namespace) -> tuple[Callable, dict, Any]:
    """``--probe-k`` chained psums over all devices per step (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices), ("all",))
    sharding = NamedSharding(mesh, P("all"))
    k, n = args.probe_k, args.probe_elems

    def body(x: jax.Array) -> jax.Array:
        for _ in range(k):
            x = jax.lax.psum(x, "all") * (1.0 / len(devices))
        return x

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("all"), out_specs=P("all")))
    host = np.ones((len(devices) * n,), np.float32)
    x = jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    def step(_batch: Any) -> Any:
        return jnp.sum(fn(x)[:1])

    info = {"params": 0, "predicted": None, "reduce_scatter": None, "probe_k": k,
            "probe_elems": n}
    return step, info, np.zeros((10_000,), np.uint8)


def zpp_step(args: argparse.Namespace) -> tuple[Callable, dict, Any]:
    """zeropp_jax's step exactly as ``node.py`` runs it."""
    import zeropp_jax as zpp
    from zeropp_demo.gpt import lm_train_step

    parts = node.build(build_args(args))
    mesh = zpp.make_mesh()
    state = node.train_state(parts, mesh)
    train_step = lm_train_step()
    box = {"state": state}
    predicted = None
    if args.comm_report:
        t0 = time.perf_counter()
        predicted = node.comm_prediction(train_step.lower(state, parts["first"]), mesh,
                                                 t0)

    def step(batch_np: Any) -> Any:
        box["state"], metrics = train_step(box["state"], batch_np)
        return metrics["loss"]

    info = {"params": parts["n_params"], "predicted": predicted,
            "reduce_scatter": parts["config"].reduce_scatter}
    return step, info, parts["data"]


def jax_main(args: argparse.Namespace) -> None:
    if args.standalone:
        import zeropp_jax as zpp

        zpp.simulate_cpu_devices(args.local_devices)
        args.batch //= args.num_processes
        args.num_processes, args.process_id, args.comm_report = 1, 0, False
    else:
        node.init_distributed(args)
    import jax
    from jax.experimental import multihost_utils

    from zeropp_demo.data import sample_batch

    step, info, data = {"zpp": zpp_step, "probe_psum": probe_step}.get(args.impl, jax_peer)(args)
    counter = {"step": 0}
    losses: list[float] = []
    traced: set[str] = set()

    def batch_now() -> Any:
        return sample_batch(data, args.batch, args.seq_len, seed=args.seed, step=counter["step"])

    def one_step(sync: str) -> tuple[float, float, float, Any]:
        t0 = time.perf_counter()
        batch = batch_now()
        t1 = time.perf_counter()
        loss = step(batch)
        t2 = time.perf_counter()
        if sync == "float":
            losses.append(float(loss))
        elif sync == "block":
            jax.block_until_ready(loss)
        t3 = time.perf_counter()
        counter["step"] += 1
        return t1 - t0, t2 - t1, t3 - t0, loss

    _, _, compile_s, loss = one_step("float")
    info.update({"impl": args.impl, "mode": args.mode, "compile_and_first_step_s": compile_s,
                 "process": jax.process_index(), "sync": args.sync,
                 "xla_flags": os.environ.get("XLA_FLAGS", ""),
                 "affinity": sorted(os.sched_getaffinity(0))})
    print("ZPP-READY " + json.dumps(info), flush=True)

    def phase(steps: int, warmup: int, label: str | None) -> dict:
        for _ in range(warmup):
            one_step("float")
        multihost_utils.sync_global_devices(f"peer-phase-start-{counter['step']}")
        key = str(label)
        each = args.trace_label == "*each*"
        tracing = (args.trace_dir is not None and (not traced if not each else key not in traced)
                   and (args.trace_label in (None, "*each*") or label == args.trace_label))
        if tracing:
            sub = args.trace_dir / safe_label(key) if each else args.trace_dir
            jax.profiler.start_trace(str(sub / f"node{jax.process_index()}"),
                                     create_perfetto_trace=True)
        c0 = net_counters(args.net_iface)
        host, dispatch, total, pending = [], [], [], []
        w0 = time.perf_counter()
        for _ in range(steps):
            h, d, t, loss = one_step(args.sync)
            host.append(h)
            dispatch.append(d)
            total.append(t)
            pending.append(loss)
        if args.sync != "float":
            jax.block_until_ready(pending[-1])
            if args.sync == "none":
                losses.extend(float(x) for x in pending)
        wall = time.perf_counter() - w0
        c1 = net_counters(args.net_iface)
        if tracing:
            jax.profiler.stop_trace()
            traced.add(key)
        multihost_utils.sync_global_devices(f"peer-phase-end-{counter['step']}")
        times = [wall / steps] * steps if args.sync == "none" else total
        out = {"process": jax.process_index(), "steps": steps, "times": times,
               "host_batch_s": host, "dispatch_s": dispatch, "step_total_s": total,
               "phase_wall_s": wall, "losses": losses[-steps:], "traced": tracing}
        if c0 is not None:
            out["tx_bytes"], out["rx_bytes"] = c1[0] - c0[0], c1[1] - c0[1]
        return out

    for cmd in commands():
        res = phase(int(cmd["steps"]), int(cmd.get("warmup", 0)), cmd.get("label"))
        res["label"] = cmd.get("label")
        print("ZPP-PHASE " + json.dumps(res), flush=True)
    if not args.standalone:
        jax.distributed.shutdown()


# -- PyTorch FSDP2 -----------------------------------------------------------------------------


def torch_gpt(vocab: int, seq_len: int, layers: int, d_model: int, heads: int,
              mlp_ratio: int = 4) -> Any:
    """zeropp_demo.gpt.GPT in torch: same modules, shapes, biases (LayerNorm eps 1e-6,
    tanh GELU, untied head), so the same parameter count."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d_model, eps=1e-6)
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)
            self.ln2 = nn.LayerNorm(d_model, eps=1e-6)
            self.fc = nn.Linear(d_model, mlp_ratio * d_model)
            self.out = nn.Linear(mlp_ratio * d_model, d_model)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(vocab, d_model)
            self.wpe = nn.Embedding(seq_len, d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d_model, eps=1e-6)
            self.head = nn.Linear(d_model, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            t = tokens.shape[1]
            x = self.wte(tokens) + self.wpe(torch.arange(t))[None]
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln_f(x)).float()

    return GPT()


def fsdp2_predicted_bytes(model: Any, nodes: int, bytes_per_elem: int = 2) -> float:
    """Lower bound of cross-node bytes one node sends per FSDP2 step: each node sends its
    1/nodes of every all-gather and reduce-scatter payload once to each other node. Blocks
    are gathered twice (forward, and again in backward: reshard_after_forward), the root's
    own parameters once (FSDP2 keeps the root unsharded after forward)."""
    blocks = sum(p.numel() for b in model.blocks for p in b.parameters())
    total = sum(p.numel() for p in model.parameters())
    elems = 3 * blocks + 2 * (total - blocks)  # (AG fwd + AG bwd + RS) and (AG + RS)
    return elems * bytes_per_elem * (nodes - 1) / nodes


def cpu_has_bf16() -> bool:
    """True if this CPU has bf16 instructions (``avx512_bf16`` or ``amx_bf16``). Without
    them PyTorch's CPU bf16 matmuls are emulated, about 7.5x slower than fp32 (measured on
    an AMD EPYC: FSDP2 7.3 s vs 0.98 s per step of the 3.32M GPT)."""
    try:
        flags = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


def torch_dtype(args: argparse.Namespace) -> str:
    """FSDP2's compute dtype: the run's, except bf16 on a CPU without bf16 instructions,
    which runs in fp32 (its all-gathers and reduce-scatters then move twice the bytes)."""
    if args.compute_dtype == "bfloat16" and not cpu_has_bf16():
        return "float32"
    return args.compute_dtype


def torch_rank(args: argparse.Namespace, local_rank: int, conn: Any) -> None:
    """One FSDP2 rank: builds, answers the parent's phase commands over ``conn``."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from zeropp_demo.data import VOCAB_SIZE, sample_batch, stdlib_corpus, train_val_split

    torch.set_num_threads(args.torch_threads)
    nodes, local = args.num_processes, args.local_devices
    world, rank = nodes * local, args.process_id * local + local_rank
    per = args.batch // world
    if args.standalone:
        # The compute floor: this rank alone (a process group of one, no network), the
        # same model, optimizer and rows of the batch as in the cluster.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://{args.coordinator}", rank=rank,
                                world_size=world,
                                timeout=__import__("datetime").timedelta(seconds=600))
    torch.manual_seed(args.seed)
    model = torch_gpt(VOCAB_SIZE, args.seq_len, args.layers, args.d_model, args.heads)
    n_params = sum(p.numel() for p in model.parameters())
    predicted = fsdp2_predicted_bytes(model, nodes, 2 if torch_dtype(args) == "bfloat16" else 4)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    bf16 = torch.bfloat16 if torch_dtype(args) == "bfloat16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    data, _ = train_val_split(stdlib_corpus())
    counter = {"step": 0}

    def one_step() -> tuple[float, float]:
        t0 = time.perf_counter()
        batch = sample_batch(data, args.batch, args.seq_len, seed=args.seed,
                             step=counter["step"])[rank * per:(rank + 1) * per]
        x = torch.from_numpy(np.ascontiguousarray(batch[:, :-1])).long()
        y = torch.from_numpy(np.ascontiguousarray(batch[:, 1:])).long()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        if args.torch_barrier:
            dist.barrier()
        counter["step"] += 1
        return value, time.perf_counter() - t0

    _, first = one_step()
    conn.send({"params": n_params, "compile_and_first_step_s": first,
               "predicted_bytes": predicted, "threads": torch.get_num_threads(),
               "rank": rank})
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        for _ in range(int(cmd.get("warmup", 0))):
            one_step()
        dist.barrier()
        c0 = net_counters(args.net_iface) if local_rank == 0 else None
        times, losses = [], []
        for _ in range(int(cmd["steps"])):
            loss, dt = one_step()
            times.append(dt)
            losses.append(loss)
        c1 = net_counters(args.net_iface) if local_rank == 0 else None
        dist.barrier()
        out = {"rank": rank, "times": times, "losses": losses}
        if c0 is not None:
            out["tx_bytes"], out["rx_bytes"] = c1[0] - c0[0], c1[1] - c0[1]
        conn.send(out)
    dist.destroy_process_group()


def torch_main(args: argparse.Namespace) -> None:
    import multiprocessing as mp

    try:
        import torch
    except ImportError:
        print("ZPP-READY " + json.dumps({"error": "torch is not installed"}), flush=True)
        return
    if args.net_iface:  # gloo: the shaped link for cross-node traffic
        os.environ.setdefault("GLOO_SOCKET_IFNAME", args.net_iface)
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for lr in range(args.local_devices):
        parent, child = ctx.Pipe()
        pr = ctx.Process(target=torch_rank, args=(args, lr, child), daemon=True)
        pr.start()
        conns.append(parent)
        procs.append(pr)
    readies = [c.recv() for c in conns]
    jax_count = flax_param_count(args)
    info = {"impl": args.impl, "params": readies[0]["params"], "params_flax_gpt": jax_count,
            "compile_and_first_step_s": readies[0]["compile_and_first_step_s"],
            "reduce_scatter": None, "torch_version": torch.__version__,
            "torch_threads_per_rank": readies[0]["threads"], "ranks_per_node": args.local_devices,
            "process": args.process_id, "torch_dtype": torch_dtype(args),
            "torch_dtype_note": (None if torch_dtype(args) == args.compute_dtype else
                                 "this CPU has no bf16 instructions: FSDP2 ran in fp32 "
                                 "(its collectives move twice the bytes of bf16)"),
            "affinity": sorted(os.sched_getaffinity(0)),
            "predicted": ({"compiled_cross_node_bytes_per_node": readies[0]["predicted_bytes"],
                           "note": "analytic lower bound (AG fwd+bwd per block, root AG "
                                   "once, RS; in FSDP2's dtype)"} if args.comm_report else None)}
    print(f"torch GPT params {info['params']:,} vs zeropp_jax GPT params {jax_count:,}",
          file=sys.stderr, flush=True)
    print("ZPP-READY " + json.dumps(info), flush=True)
    for cmd in commands():
        for c in conns:
            c.send(cmd)
        res = [c.recv() for c in conns]
        out = {"process": args.process_id, "steps": int(cmd["steps"]), "times": res[0]["times"],
               "times_by_rank": [r["times"] for r in res], "losses": res[0]["losses"],
               "label": cmd.get("label")}
        if "tx_bytes" in res[0]:
            out["tx_bytes"], out["rx_bytes"] = res[0]["tx_bytes"], res[0]["rx_bytes"]
        print("ZPP-PHASE " + json.dumps(out), flush=True)
    for c in conns:
        c.send(None)
    for pr in procs:
        pr.join(timeout=30)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.impl == "torch_fsdp2":
        torch_main(args)
    else:
        jax_main(args)


if __name__ == "__main__":
    main()
