"""Calls that every process makes together: a rendezvous with a timeout, small exchanges.

With several processes (``jax.distributed``), a call that runs collectives across them —
``state.consolidate()``, ``checkpoint.save`` / ``restore``, the first step on a new batch
structure — waits for every process to join. Made by some processes only (``consolidate()``
under ``if jax.process_index() == 0:``), the devices' collectives would wait forever. So
these calls first meet at a barrier of the coordination service, which has a timeout: a
missing process becomes a ``ProcessesDisagree`` error that names the call, not a hang.

Every process numbers its calls of each kind (``consolidate`` #0, #1, ...), so the barrier
of one process's third ``consolidate`` only meets the others' third. The wait is
``ZEROPP_COLLECTIVE_TIMEOUT_S`` seconds (default 600; a save of a large model on a slow
filesystem may need more). One process, or processes started without
``jax.distributed``'s coordination service, have nothing to wait for: every function here
returns at once.
"""

from __future__ import annotations

import os

import jax

from zeropp_jax.core import compat

TIMEOUT_ENV = "ZEROPP_COLLECTIVE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0

# Calls made so far per kind, in this process (the same sequence on every process): they
# name the keys of jax.distributed's key-value store, which lives as long as the process,
# so this count does too. It is the one process-wide table in the library, by necessity:
# every process must derive the same key for its n-th call without talking first.
_calls: dict[str, int] = {}


class ProcessesDisagree(RuntimeError):
    """Not every process made the same collective call within the timeout."""


def timeout_s() -> float:
    """Seconds a process waits for the others at a collective call."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


def _client() -> object | None:
    return compat.distributed_client() if jax.process_count() > 1 else None


def _next_key(name: str) -> str:
    n = _calls.get(name, 0)
    _calls[name] = n + 1
    return f"zeropp_jax/{name}/{n}"


def _disagree(name: str, error: Exception) -> ProcessesDisagree:
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return ProcessesDisagree(
        f"{name}: process {jax.process_index()} of {jax.process_count()} waited "
        f"{timeout_s():.0f} s here, but not every process made this call "
        f"({type(error).__name__}: {first[:200]}). Every process must make the same "
        "collective calls in the same order (train steps, state.consolidate(), "
        "checkpoint.save/restore), e.g. not under `if jax.process_index() == 0:`; to wait "
        f"longer for slow processes, set {TIMEOUT_ENV}"
    )


def rendezvous(name: str) -> None:
    """Returns once every process has called ``rendezvous(name)`` as often as this one;
    raises ``ProcessesDisagree`` after ``timeout_s()`` otherwise."""
    client = _client()
    if client is None:
        return
    key = _next_key(name)
    try:
        client.wait_at_barrier(key, int(timeout_s() * 1000))
    except Exception as e:  # noqa: BLE001 — the runtime's DEADLINE_EXCEEDED and kin
        raise _disagree(name, e) from None


def allgather(name: str, value: str) -> list[str]:
    """Every process's ``value`` (a short string), in process order, through the
    coordination service's key-value store (no device collective, so no compile and a
    timeout instead of a hang)."""
    client = _client()
    if client is None:
        return [value]
    key = _next_key(name)
    client.key_value_set(f"{key}/{jax.process_index()}", value)
    out = []
    for p in range(jax.process_count()):
        try:
            out.append(client.blocking_key_value_get(f"{key}/{p}", int(timeout_s() * 1000)))
        except Exception as e:  # noqa: BLE001
            raise _disagree(name, e) from None
    return out


def broadcast(name: str, value: str | None) -> str:
    """Process 0's ``value`` on every process (others pass anything, e.g. None)."""
    client = _client()
    if client is None:
        return value  # type: ignore[return-value]
    key = _next_key(name)
    if jax.process_index() == 0:
        client.key_value_set(key, value)
    try:
        return client.blocking_key_value_get(key, int(timeout_s() * 1000))
    except Exception as e:  # noqa: BLE001
        raise _disagree(name, e) from None


def agree(name: str, error: BaseException | None,
          cls: type[Exception] = RuntimeError) -> None:
    """Raises on every process if ``error`` is set on any: a process re-raises its own
    error; the others raise ``cls`` quoting the first failing process's. Keeps a failure on
    one process (a damaged file only it read) from leaving the others waiting."""
    msgs = allgather(name, "" if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    for p, msg in enumerate(msgs):
        if msg:
            raise cls(f"{name} failed on process {p}: {msg}")
