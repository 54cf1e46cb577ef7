"""Joining JAX's distributed runtime: when a process is one of several, and with which timeouts."""

from __future__ import annotations

import os
from typing import Any

import jax

from nnx_spmd_trainer.adapters import jax_private
from nnx_spmd_trainer.distributed.gloo_notes import QUIET_STDOUT
from nnx_spmd_trainer.distributed.peers import PeerWatch

COORDINATOR = "NNX_SPMD_COORDINATOR"
NUM_PROCESSES = "NNX_SPMD_NUM_PROCESSES"
PROCESS_ID = "NNX_SPMD_PROCESS_ID"
PEER_TIMEOUT = "NNX_SPMD_PEER_TIMEOUT_S"
#: Seconds of silence after which a process of the job is taken for dead.
DEFAULT_PEER_TIMEOUT_S = 10
#: Seconds a finished process waits at exit for the others to finish (JAX's shutdown barrier).
SHUTDOWN_TIMEOUT_S = 120


def peer_timeout_s() -> int:
    """Seconds of silence after which a process is taken for dead: ``NNX_SPMD_PEER_TIMEOUT_S``,
    default 10 (a training job's processes are never silent that long: the beats come from
    a thread of their own, and XLA compiles and runs without holding Python's lock)."""
    value = os.environ.get(PEER_TIMEOUT, str(DEFAULT_PEER_TIMEOUT_S))
    try:
        seconds = int(value)
    except ValueError:
        seconds = 0
    if seconds < 2:
        raise ValueError(f"{PEER_TIMEOUT}={value!r}: give a whole number of seconds >= 2.")
    return seconds


def jax_timeouts(coordinator_address: str | None) -> dict[str, int]:
    """``jax.distributed.initialize``'s timeouts: its heartbeat 3 x ``peer_timeout_s()``,
    so that ``PeerWatch`` (which exits with one line) notices a dead process before JAX
    does (JAX aborts, half to all of its heartbeat after the last beat); the shutdown
    barrier ``SHUTDOWN_TIMEOUT_S``; a minute to gather on loopback, JAX's 5 on a cluster
    (where tasks may start minutes apart)."""
    local = bool(coordinator_address and coordinator_address.startswith("127.0.0.1:"))
    return {
        "initialization_timeout": 60 if local else 300,
        "heartbeat_timeout_seconds": 3 * peer_timeout_s(),
        "shutdown_timeout_seconds": SHUTDOWN_TIMEOUT_S,
    }


def _cluster_processes() -> int:
    """How many processes JAX's cluster detection finds (1 when it finds no cluster), as
    ``jax.distributed.initialize`` finds them: opt-in-only environments (mpi4py's) skipped."""
    return jax_private.cluster_process_count()


def expected_processes(num_processes: int | None = None) -> int:
    """How many processes the job will have, known before JAX starts: ``num_processes``,
    else ``NNX_SPMD_NUM_PROCESSES``, else JAX's cluster detection (1 without a cluster)."""
    if num_processes is not None:
        return num_processes
    if NUM_PROCESSES in os.environ:
        return int(os.environ[NUM_PROCESSES])
    return _cluster_processes()


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    quiet_gloo: bool = True,
) -> bool:
    """Joins JAX's distributed runtime if this is one of several processes; returns whether.

    Arguments win over the ``NNX_SPMD_*`` variables; without either, JAX's
    own cluster detection decides (and fills in all three). Call it before
    anything uses a JAX device. Once joined, a ``PeerWatch`` ends this process
    with one line when another one dies, and (``quiet_gloo``) Gloo's "connected
    to N peer ranks" notes are dropped from this process's standard output.
    A coordinator on 127.0.0.1 listens on loopback only; any other listens where
    JAX's default (or ``JAX_COORDINATOR_BIND_ADDRESS``) says.
    """
    coordinator_address = coordinator_address or os.environ.get(COORDINATOR)
    if num_processes is None and NUM_PROCESSES in os.environ:
        num_processes = int(os.environ[NUM_PROCESSES])
    if process_id is None and PROCESS_ID in os.environ:
        process_id = int(os.environ[PROCESS_ID])
    explicit = coordinator_address is not None or num_processes is not None
    if not explicit and _cluster_processes() == 1:
        return False
    if explicit and num_processes == 1:
        return False
    if explicit and (coordinator_address is None or num_processes is None or process_id is None):
        raise ValueError(
            "Several processes need all of coordinator_address, num_processes and process_id "
            f"(got {coordinator_address!r}, {num_processes!r}, {process_id!r})."
        )
    options: dict[str, Any] = jax_timeouts(coordinator_address)
    if coordinator_address and coordinator_address.startswith("127.0.0.1:"):
        options["coordinator_bind_address"] = coordinator_address  # loopback only
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if quiet_gloo:
        QUIET_STDOUT.start()
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **options)
    PeerWatch.start_for_this_job(peer_timeout_s())
    return True
