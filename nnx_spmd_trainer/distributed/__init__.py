"""Several processes on JAX's own runtime: joining it, and a local launcher for development.

A process joins ``jax.distributed`` only when it is one of several: named
explicitly (arguments, or the ``NNX_SPMD_*`` variables the launcher sets) or
found by JAX's cluster detection (SLURM, Open MPI, Kubernetes, Cloud TPU).
A single process never initialises it: once initialised, every CPU
collective goes through gloo, even with one process (PITFALLS.md).

A process that dies is noticed by the others within ``peer_timeout_s()``
seconds (default 10, ``NNX_SPMD_PEER_TIMEOUT_S``), on any coordinator: each
process beats through the coordination service (``PeerWatch``), and one whose
beats stop makes the others exit with status 1 and one line naming it. JAX's
own heartbeat (3 x that timeout) is the backstop; it aborts the process.

One module per job, every public name re-exported here: ``runtime`` (joining the
runtime, its timeouts, the ``NNX_SPMD_*`` variable names), ``agree`` (the one place
processes agree on a host value: ``agree.all_values``, ``agree.broadcast_from_first``),
``peers`` (the dead-peer watch), ``gloo_notes`` (Gloo's "connected to N peer ranks"
notes, dropped) and ``launch`` (the local launcher).
"""

from nnx_spmd_trainer.distributed import agree, peers, runtime
from nnx_spmd_trainer.distributed.agree import Agreement, KeyValueStore, PeerMissing
from nnx_spmd_trainer.distributed.gloo_notes import (
    GLOO_PIECES,
    QUIET_STDOUT,
    GlooNotes,
    QuietStdout,
)
from nnx_spmd_trainer.distributed.launch import HOST_DEVICES, Launch, free_port, split_host_devices
from nnx_spmd_trainer.distributed.peers import PeerWatch, lost_peers_named
from nnx_spmd_trainer.distributed.runtime import (
    COORDINATOR,
    NUM_PROCESSES,
    PEER_TIMEOUT,
    PROCESS_ID,
    expected_processes,
    initialize,
    jax_timeouts,
    peer_timeout_s,
)

# The submodules' values, bound here again because Sphinx reads a constant's "#:" comment
# only from the module it documents the constant in (this one: the names users import).
#: Seconds of silence after which a process of the job is taken for dead.
DEFAULT_PEER_TIMEOUT_S = runtime.DEFAULT_PEER_TIMEOUT_S
#: Seconds a finished process waits at exit for the others to finish (JAX's shutdown barrier).
SHUTDOWN_TIMEOUT_S = runtime.SHUTDOWN_TIMEOUT_S
#: Exit status of a process that stops because another one of its job died.
LOST_PEER_STATUS = peers.LOST_PEER_STATUS

# In the reference's order (the order the names had in the single module they came from).
__all__ = [
    "COORDINATOR",
    "NUM_PROCESSES",
    "PROCESS_ID",
    "PEER_TIMEOUT",
    "HOST_DEVICES",
    "DEFAULT_PEER_TIMEOUT_S",
    "SHUTDOWN_TIMEOUT_S",
    "LOST_PEER_STATUS",
    "peer_timeout_s",
    "jax_timeouts",
    "expected_processes",
    "initialize",
    "PeerWatch",
    "lost_peers_named",
    "GLOO_PIECES",
    "GlooNotes",
    "QuietStdout",
    "QUIET_STDOUT",
    "free_port",
    "split_host_devices",
    "Launch",
    "agree",
    "Agreement",
    "PeerMissing",
    "KeyValueStore",
]
