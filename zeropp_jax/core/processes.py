"""Calls that every process makes together: a rendezvous with a timeout, small exchanges.

With several processes (``jax.distributed``), a call that runs collectives across them —
``state.consolidate()``, ``checkpoint.save`` / ``restore``, every train step — waits for
every process to join. Made by some processes only (``consolidate()`` under
``if jax.process_index() == 0:``), the devices' collectives would wait forever. So these
calls first meet at the coordination service (a barrier, or an exchange through its
key-value store), which has a timeout: a missing process becomes a ``ProcessesDisagree``
error that names the call, not a hang.

Every process numbers its calls of each kind (``consolidate`` #0, #1, ...), so the barrier
of one process's third ``consolidate`` only meets the others' third. The wait is
``ZEROPP_COLLECTIVE_TIMEOUT_S`` seconds (default 600; a save of a large model on a slow
filesystem may need more). The error says which of three things happened: the wait ran
out (a peer is elsewhere, stuck, or slower than the timeout); a peer exited (each process
leaves a note in the key-value store as it exits, with its uncaught error if any); or the
coordination service failed the call at once (it lost a peer: crashed, killed, preempted).
One process, or processes started without ``jax.distributed``'s coordination service,
have nothing to wait for: every function here returns at once.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

import jax

from zeropp_jax.core import compat

TIMEOUT_ENV = "ZEROPP_COLLECTIVE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
# An exchange made every step (the batch check) would leave one key per process per step
# in the coordination service, which keeps them for the life of the job; the keys of each
# kind go in blocks of this many calls, and a block is deleted once every process is past
# it (see ``allgather``).
_BLOCK = 64
# A wait that ended this much before the timeout did not run out: the service failed it.
_FAST_FRACTION = 0.9

# Calls made so far per kind, in this process (the same sequence on every process): they
# name the keys of jax.distributed's key-value store, which lives as long as the process,
# so this count does too. It is the one process-wide table in the library, by necessity:
# every process must derive the same key for its n-th call without talking first.
_calls: dict[str, int] = {}
_exit_note_registered = False


class ProcessesDisagree(RuntimeError):
    """Not every process made the same collective call within the timeout, or a process
    left (exited, crashed) while the others waited for it."""


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


def _exit_key(process: int) -> str:
    return f"zeropp_jax/exit/{process}"


def _note_exit() -> None:
    """At interpreter exit: tells the other processes that this one is gone, and why (its
    uncaught error, if any), so that a peer waiting for it says so instead of guessing.
    Runs before jax's own exit hook (registered earlier, so run later), which shuts the
    client down."""
    client = compat.distributed_client()
    if client is None:
        return
    err = getattr(sys, "last_value", None)  # set by the interpreter for an uncaught error
    if err is not None:
        first = (str(err).strip().splitlines() or [""])[0][:300]
        note = f"exited on an uncaught {type(err).__name__}: {first}"
    else:
        note = "exited"
    try:
        client.key_value_set(_exit_key(jax.process_index()), note)
    except Exception:  # noqa: BLE001 — best effort: the service may be gone already
        pass


def _client() -> object | None:
    global _exit_note_registered
    if jax.process_count() <= 1:
        return None
    client = compat.distributed_client()
    if client is not None and not _exit_note_registered:
        atexit.register(_note_exit)
        _exit_note_registered = True
    return client


def _next(name: str) -> int:
    n = _calls.get(name, 0)
    _calls[name] = n + 1
    return n


def _next_key(name: str) -> str:
    return f"zeropp_jax/{name}/{_next(name)}"


def _peer_notes(client: object, peers: list[int]) -> dict[int, str]:
    """Exit notes left by ``peers`` (only those that left one)."""
    notes = {}
    for p in peers:
        try:
            notes[p] = client.key_value_try_get(_exit_key(p))  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 — NOT_FOUND: no note, the process has not exited
            pass
    return notes


def _gone(text: str) -> bool:
    """Whether the coordination service's error says it lost a process."""
    low = text.lower()
    return any(s in low for s in ("heartbeat", "unavailable", "disconnected", "preempt",
                                  "shut down", "shutdown", "set to error", "has failed",
                                  "crashed", "connection"))


def _disagree(name: str, error: Exception, elapsed: float, client: object,
              missing: list[int] | None = None) -> ProcessesDisagree:
    """The error for a collective call that did not complete, saying which of three things
    happened: the wait ran out (``elapsed`` about the timeout), a peer exited (its note),
    or the coordination service failed the call well before the timeout (it lost a
    peer, or refused the call)."""
    me, count = jax.process_index(), jax.process_count()
    text = str(error).strip()
    first = text.splitlines()[0][:200] if text else ""
    cause = f"({type(error).__name__}: {first})"
    peers = [p for p in range(count) if p != me] if not missing else missing
    notes = _peer_notes(client, peers)
    crashed = {p: n for p, n in notes.items() if n != "exited"}
    where = f"{name}: process {me} of {count}"
    misuse = (" Every process must make the same collective calls in the same order (train "
              "steps, state.consolidate(), checkpoint.save/restore), e.g. not under "
              "`if jax.process_index() == 0:`")
    if crashed:
        gone = "; ".join(f"process {p} {n}" for p, n in sorted(crashed.items()))
        return ProcessesDisagree(
            f"{where} stopped waiting after {elapsed:.1f} s: {gone}, so it will never make "
            f"this call {cause}. That process's error is the cause (its log has the "
            "details); fix it: this error only follows from it"
        )
    if elapsed >= _FAST_FRACTION * timeout_s():
        head = f"{where} waited {elapsed:.0f} s here ({TIMEOUT_ENV}={timeout_s():g})"
        if notes:
            return ProcessesDisagree(
                f"{head}, but process {', '.join(map(str, sorted(notes)))} exited without "
                f"making this call {cause}.{misuse}"
            )
        who = (f"process{'es' if len(peers) > 1 else ''} {', '.join(map(str, peers))} did "
               "not make this call" if missing else "not every process made this call")
        return ProcessesDisagree(
            f"{head}, but {who} {cause}.{misuse}. A process that is still "
            "running may be stuck elsewhere, or slow: to wait longer for slow processes, "
            f"set {TIMEOUT_ENV}"
        )
    if notes:
        what = f"process {', '.join(map(str, sorted(notes)))} exited without making this call"
    elif _gone(text):
        what = ("the coordination service lost a peer process (crashed, killed or "
                "preempted)")
    else:
        what = "the coordination service refused the call"
    return ProcessesDisagree(
        f"{where} failed after {elapsed:.1f} s, without waiting for the {timeout_s():g} s "
        f"timeout ({TIMEOUT_ENV}): {what} {cause}. Look at the other processes' logs (and "
        "the scheduler's) for the first error"
    )


def rendezvous(name: str) -> None:
    """Returns once every process has called ``rendezvous(name)`` as often as this one;
    raises ``ProcessesDisagree`` after ``timeout_s()`` otherwise (or sooner, if a process
    is gone)."""
    client = _client()
    if client is None:
        return
    key = _next_key(name)
    start = time.monotonic()
    try:
        client.wait_at_barrier(key, int(timeout_s() * 1000))
    except Exception as e:  # noqa: BLE001 — the runtime's DEADLINE_EXCEEDED and kin
        raise _disagree(name, e, time.monotonic() - start, client) from None


def allgather(name: str, value: str) -> list[str]:
    """Every process's ``value`` (a short string), in process order, through the
    coordination service's key-value store (no device collective, so no compile and a
    timeout instead of a hang). One write and one read per other process: on loopback
    about 1 ms for 2 processes."""
    client = _client()
    if client is None:
        return [value]
    n = _next(name)
    key = f"zeropp_jax/{name}/{n // _BLOCK}/{n % _BLOCK}"
    me = jax.process_index()
    start = time.monotonic()
    out, p = [], 0
    try:
        client.key_value_set(f"{key}/{me}", value)
        for p in range(jax.process_count()):
            out.append(value if p == me else client.blocking_key_value_get(
                f"{key}/{p}", max(1, int((timeout_s() - (time.monotonic() - start)) * 1000))))
    except Exception as e:  # noqa: BLE001
        raise _disagree(name, e, time.monotonic() - start, client,
                        missing=[q for q in range(p, jax.process_count()) if q != me]) from None
    if me == 0 and n % _BLOCK == 0 and n:
        # Every process has written call n, so each has read all of the previous block:
        # its keys can go.
        try:
            client.key_value_delete(f"zeropp_jax/{name}/{n // _BLOCK - 1}")
        except Exception:  # noqa: BLE001 — only memory of the service is at stake
            pass
    return out


def broadcast(name: str, value: str | None) -> str:
    """Process 0's ``value`` on every process (others pass anything, e.g. None)."""
    client = _client()
    if client is None:
        return value  # type: ignore[return-value]
    key = _next_key(name)
    start = time.monotonic()
    try:
        if jax.process_index() == 0:
            client.key_value_set(key, value)
        return client.blocking_key_value_get(key, int(timeout_s() * 1000))
    except Exception as e:  # noqa: BLE001
        raise _disagree(name, e, time.monotonic() - start, client, missing=[0]) from None


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
