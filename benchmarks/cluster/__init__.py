"""The emulated multi-node cluster: node processes in network namespaces on one machine,
joined by ``tc``-shaped links, and the tools that measure, calibrate and extrapolate on it.

Each entry point is a script, run from the repository root (the ones that build namespaces
need root)::

    sudo .venv/bin/python benchmarks/cluster/run.py --quick
    .venv/bin/python benchmarks/cluster/calibrate.py RUN.json

``python -m benchmarks.cluster.run ...`` runs the same. Results go to ``benchmarks/out/``
(``--out benchmarks/results`` replaces the tracked ones the docs render).

Measuring on the cluster (need root):

* ``run``: the cluster itself (namespaces, bridge, shaped links, teardown) and its main
  sweep: ZeRO-3 vs ZeRO++ step time per link speed against PyTorch FSDP2, JAX FSDP and data
  parallelism; ``--predict`` also calibrates the cost model on the run (``calibrate``).
  ``checkpoint`` and ``generate`` reuse its ``Cluster``.
* ``node``: the node worker of the zeropp_jax rows, one process per node namespace,
  driven over stdin/stdout (phases, link byte counters, predicted bytes). ``run`` and
  ``checkpoint`` start it; ``examples/multihost.py`` hands its benchmark flags to it.
* ``peers``: the peer and instrumented rows (JAX FSDP, JAX DP, PyTorch FSDP2, the
  per-collective probe, zeropp_jax with timings or traces), speaking ``node``'s protocol and
  built from its model, data and arguments.
* ``checkpoint``: multi-process checkpoints saved on the cluster, resumed on it and off it.
* ``generate``: generation and the RLHF loop per link speed; one ``generate_node`` process
  per node (and ``examples/rlhf.py``).

Without root (no namespaces, or no cluster at all):

* ``floor``: each node's share of the step with no communication (``peers --standalone``),
  the compute floor that ``run --predict`` measures before its sweep.
* ``traces``: summarises the profiler traces of ``run``'s ``MODE@trace`` rows.
* ``calibrate``: fits the cost model's constants to a ``run --predict`` run's probes and
  predicts every cell; ``calibrate.py RUN.json`` redoes it from a saved run.
* ``weak_scaling``: puts saved ``run --predict`` runs at 2, 3 and 4 nodes side by side.
* ``predict``: the cost model with ``zeropp_jax.plan.presets``' constants on clusters the
  emulation does not stand for (the ZeRO++ paper's V100 cluster, H100 nodes); measures
  nothing.

The modules import each other as ``benchmarks.cluster.X`` and start node processes by their
path here, so every one of them runs from any working directory.
"""
