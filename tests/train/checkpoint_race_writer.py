"""One writer of test_checkpoint_writers' two-writer race: a one-device state of a tiny
model saving its steps into each round's directory at the round's start time plus its own
offset, each save's outcome recorded (saved, or refused with the error's text).

The test process is writer A; writer B runs this file as a script in a process of its own
(``python checkpoint_race_writer.py B WORK ROUNDS_JSON``): after a warm-up save (so that
the race times saves, not compiles) it says ``ready_B`` in WORK, waits for ``go`` (the
start time), runs the rounds, writes ``result_B.json``, and stays alive until A's
``done_A``, so that each writer meets the other alive.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
import warnings


def tiny_state():
    """A Dense(3) state on one device, SGD, ZeRO-3 fp32 (a save takes tens of ms)."""
    import flax.linen as nn
    import jax
    import numpy as np
    import optax

    import zeropp_jax as zpp

    model = nn.Dense(3)
    params = model.init(jax.random.PRNGKey(0), np.zeros((1, 2), np.float32))["params"]
    with warnings.catch_warnings():  # one unit holds everything: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        return zpp.TrainState.create(
            model=model, params=params, tx=optax.sgd(0.1),
            mesh=zpp.make_mesh(1, 1, devices=jax.devices()[:1]),
            config=zpp.ZeroPPConfig.zero3(compute_dtype="float32"))


def at(state, step: int):
    """``state`` with its step counter set to ``step``."""
    import jax
    import numpy as np

    return state.replace(step=jax.device_put(np.int32(step), state.step.sharding))


def run(role: str, work: pathlib.Path, rounds: list[dict], state) -> dict:
    """Waits for ``work/go``, then saves ``role``'s steps of each round into its directory
    (keep=3) at the round's start plus ``role``'s offset. Returns ``{"pid", "out"}``: one
    record per save, ``{"dir", "step", "saved": time}`` or ``{"dir", "step", "refused":
    error text}``."""
    from zeropp_jax.train import checkpoint as ckpt

    while not (work / "go").exists():
        time.sleep(0.01)
    t0 = float((work / "go").read_text())
    out = []
    for r in rounds:
        while time.time() < t0 + r["start"] + r["offset"][role]:
            time.sleep(0.002)
        for s in r["steps"][role]:
            try:
                ckpt.save(work / r["dir"], at(state, s), keep=3)
                out.append({"dir": r["dir"], "step": s, "saved": time.time()})
            except ckpt.CheckpointError as e:
                out.append({"dir": r["dir"], "step": s, "refused": str(e)})
    return {"pid": os.getpid(), "out": out}


def warm_up(role: str, work: pathlib.Path, state) -> None:
    """One save into a directory of ``role``'s own, then ``work/ready_<role>``."""
    from zeropp_jax.train import checkpoint as ckpt

    ckpt.save(work / f"warm_{role}", at(state, 0))
    (work / f"ready_{role}").touch()


def main(argv: list[str]) -> None:
    role, work, rounds = argv[0], pathlib.Path(argv[1]), json.loads(argv[2])
    state = tiny_state()
    warm_up(role, work, state)
    result = run(role, work, rounds, state)
    (work / f"result_{role}.json").write_text(json.dumps(result))
    other = "A" if role == "B" else "B"
    while not (work / f"done_{other}").exists():
        time.sleep(0.01)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main(sys.argv[1:])
