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
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import IO, Any

import jax

COORDINATOR = "NNX_SPMD_COORDINATOR"
NUM_PROCESSES = "NNX_SPMD_NUM_PROCESSES"
PROCESS_ID = "NNX_SPMD_PROCESS_ID"
PEER_TIMEOUT = "NNX_SPMD_PEER_TIMEOUT_S"
HOST_DEVICES = re.compile(r"--xla_force_host_platform_device_count=(\d+)")
#: Seconds of silence after which a process of the job is taken for dead.
DEFAULT_PEER_TIMEOUT_S = 10
#: Seconds a finished process waits at exit for the others to finish (JAX's shutdown barrier).
SHUTDOWN_TIMEOUT_S = 120
#: Exit status of a process that stops because another one of its job died.
LOST_PEER_STATUS = 1


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
    """How many processes JAX's cluster detection finds (1 when it finds no cluster)."""
    try:
        from jax._src import clusters  # the detection jax.distributed.initialize() runs
    except ImportError:  # pragma: no cover - moved in a future JAX
        return 1
    for cluster in clusters.ClusterEnv._cluster_types:
        with contextlib.suppress(Exception):
            if cluster.is_env_present():
                return int(cluster.get_process_count())
    return 1


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


# -- a dead process, noticed fast -------------------------------------------------------
def _first_line(error: BaseException) -> str:
    return next((line for line in str(error).splitlines() if line.strip()), repr(error))


class PeerWatch:
    """Ends this process, with one line naming the culprit, when another process of the
    job dies or hangs.

    A daemon thread writes a beat (a rising count) under ``nnx_spmd/alive/<process>``
    in the coordination service every ``interval_s`` and reads everyone's; a process
    whose count has not moved for ``timeout_s``, or a coordinator that cannot be reached,
    ends this one: the line on stderr, standard output flushed, ``os._exit`` with
    ``LOST_PEER_STATUS``. Exiting is the point: otherwise the survivor waits in a
    collective or in ``jax.distributed``'s exit-time shutdown until JAX's heartbeat
    aborts it (a minute or more, with a ``Fatal Python error`` dump). Once this process
    is exiting normally, a coordinator that stops answering is the end of the job, not
    a failure. A killed coordinator is noticed by JAX itself at once (it aborts).
    """

    KEY = "nnx_spmd/alive/"
    _current: PeerWatch | None = None

    def __init__(
        self, client: Any, process_id: int, num_processes: int, timeout_s: float,
        interval_s: float = 1.0,
    ) -> None:  # fmt: skip
        self.client = client
        self.process_id = process_id
        self.num_processes = num_processes
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.exiting = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nnx-spmd-peer-watch", daemon=True)

    @classmethod
    def start_for_this_job(cls, timeout_s: float) -> PeerWatch | None:
        from jax._src import distributed as jax_distributed  # the client, not in the public API

        client = jax_distributed.global_state.client
        if client is None or jax.process_count() == 1:
            return None
        watch = cls(client, jax.process_index(), jax.process_count(), timeout_s)
        watch._thread.start()
        atexit.register(watch.exiting.set)  # runs before JAX's shutdown (registered earlier)
        cls._current = watch
        return watch

    def _run(self) -> None:
        beat, start = 0, time.monotonic()
        last: dict[str, tuple[str, float]] = {}  # key -> (value, when it last changed)
        while True:
            beat += 1
            try:
                self.client.key_value_set(f"{self.KEY}{self.process_id}", str(beat), True)
                values = dict(self.client.key_value_dir_get(self.KEY))
            except Exception as error:  # the coordinator is gone (or this process is leaving)
                if not self.exiting.is_set():
                    self._lost(0, f"the coordinator cannot be reached: {_first_line(error)}")
                return
            now = time.monotonic()
            for peer in range(self.num_processes):
                key = f"{self.KEY}{peer}"
                value = values.get(key, "")
                if peer == self.process_id:
                    continue
                if key not in last or last[key][0] != value:
                    last[key] = (value, now if value else start)
                if now - last[key][1] > self.timeout_s:
                    self._lost(peer, f"no sign of life for {self.timeout_s:g} s: it died or hangs")
            time.sleep(self.interval_s)

    def _lost(self, peer: int, why: str) -> None:
        line = (
            f"nnx_spmd_trainer: process {peer} of {self.num_processes} stopped responding "
            f"({why}); process {self.process_id} stops too (exit status {LOST_PEER_STATUS}). "
            "Checkpoints committed so far are kept: run the job again to resume."
        )
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        QUIET_STDOUT.stop()
        os.write(2, (line + "\n").encode())
        os._exit(LOST_PEER_STATUS)  # no exit-time shutdown: it would wait for the dead peer

    def wait(self, seconds: float) -> None:
        """Gives the watch ``seconds`` to find a dead process (it then ends this one)."""
        self._thread.join(timeout=seconds)


def _from_the_runtime(error: BaseException) -> bool:
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, jax.errors.JaxRuntimeError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@contextlib.contextmanager
def lost_peers_named() -> Iterator[None]:
    """A runtime error inside (Gloo's "connection closed by peer", a failed barrier) is
    most often another process's death: the watch is given the time to name it (and end
    this process) before the error propagates as it is."""
    try:
        yield
    except Exception as error:
        watch = PeerWatch._current
        if watch is not None and _from_the_runtime(error):
            watch.wait(watch.timeout_s + 3 * watch.interval_s)
        raise


# -- Gloo's notes, dropped --------------------------------------------------------------
GLOO_PIECES = (
    "[Gloo] Rank ",
    " is connected to ",
    " peer ranks. ",
    "Expected number of connected peer ranks is : ",
)


class GlooNotes:
    """Drops Gloo's "[Gloo] Rank r is connected to n peer ranks. ..." notes from output lines.

    Gloo writes each note in eight pieces (text, numbers, the newline), each a write of its
    own, from the thread forming a group; groups formed at once interleave their pieces.
    So one line can hold pieces of several notes, and a later line only a note's tail (its
    last number, or nothing): each note ends in exactly one newline, so a line that starts
    k notes leaves k - 1 tails to come, dropped while they are bare numbers.
    """

    def __init__(self) -> None:
        self._tails = 0

    def keep(self, line: str) -> str | None:
        """``line`` without Gloo's pieces (``None``: nothing else was in it)."""
        body = line.rstrip("\n")
        if "[Gloo] Rank " in body or "peer ranks" in body:
            self._tails = max(0, self._tails + body.count("[Gloo] Rank ") - 1)
            for piece in GLOO_PIECES:
                body = body.replace(piece, "")
            if not body.replace(" ", "").isdigit() and body.strip():
                return body + "\n"  # someone else's text, written into Gloo's line
            return None
        if self._tails and (body.strip().isdigit() or not body.strip()):
            self._tails -= 1
            return None
        return line


class QuietStdout:
    """Standard output (file descriptor 1) through a pipe and a thread that drops Gloo's
    notes: Gloo writes them from C++ straight to the descriptor, past ``sys.stdout``.

    ``stop`` (at exit, and before ``PeerWatch`` ends the process) puts the descriptor back
    and waits for the thread to pass on everything still in the pipe. A partial line is
    passed on after 50 ms without more output, so a prompt is not held back.
    """

    IDLE_S = 0.05

    def __init__(self) -> None:
        self._saved: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._saved is not None:
            return
        sys.stdout.flush()
        read, write = os.pipe()
        self._saved = os.dup(1)
        os.dup2(write, 1)
        os.close(write)
        self._thread = threading.Thread(
            target=self._pump, args=(read, self._saved), name="nnx-spmd-quiet-stdout", daemon=True
        )
        self._thread.start()
        atexit.register(self.stop)  # before JAX's own exit handler, registered earlier

    def stop(self) -> None:
        if self._saved is None or self._thread is None:
            return
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os.dup2(self._saved, 1)  # the pipe's last writer closes: the thread reads to its end
        self._thread.join(timeout=2)  # longer only if a child process holds the pipe
        self._saved = None

    @staticmethod
    def _pump(read: int, out: int) -> None:
        notes, partial = GlooNotes(), b""

        def emit(data: bytes) -> None:
            while data:
                data = data[os.write(out, data) :]

        with contextlib.suppress(OSError):
            while True:
                if not select.select([read], [], [], QuietStdout.IDLE_S)[0]:
                    if partial and b"Gloo" not in partial and not partial.strip().isdigit():
                        emit(partial)  # a line in the making, not Gloo's: do not hold it
                        partial = b""
                    continue
                chunk = os.read(read, 1 << 16)
                if not chunk:
                    break
                *lines, partial = (partial + chunk).split(b"\n")
                for line in lines:
                    kept = notes.keep(line.decode(errors="replace") + "\n")
                    if kept is not None:
                        emit(kept.encode())
            kept = notes.keep(partial.decode(errors="replace")) if partial else None
            if kept:
                emit(kept.encode())
        os.close(read)


QUIET_STDOUT = QuietStdout()


# -- the local launcher ------------------------------------------------------------------
def free_port() -> int:
    """A port nothing listens on now, on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def split_host_devices(flags: str, num_processes: int) -> str:
    """``XLA_FLAGS`` with a simulated device count split between ``num_processes``."""
    found = HOST_DEVICES.search(flags)
    if found is None:
        return flags
    total = int(found.group(1))
    if total % num_processes:
        raise ValueError(
            f"{total} simulated devices (XLA_FLAGS) do not split between {num_processes} "
            "processes; use a count they divide."
        )
    return HOST_DEVICES.sub(
        f"--xla_force_host_platform_device_count={total // num_processes}", flags
    )


def _load_prctl() -> Any:
    try:
        return ctypes.CDLL("libc.so.6").prctl  # loaded here: a forked child must not dlopen
    except (OSError, AttributeError):  # not Linux: children outlive a killed launcher
        return None


_PRCTL = _load_prctl()


def _die_with_parent() -> None:
    """In a child, between fork and exec: SIGKILL when the launcher dies, even by SIGKILL."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _relay(index: int, stream: IO[bytes], out: IO[str]) -> None:
    notes = GlooNotes()  # the children drop them too; a program of the user's may not
    for raw in iter(stream.readline, b""):
        line = notes.keep(raw.decode(errors="replace"))
        if line is None:
            continue
        out.write(f"[{index}] {line}")
        out.flush()


class Launch:
    """Runs ``command`` as ``num_processes`` processes of one JAX job on this machine.

    Each child gets the coordinator (127.0.0.1 and a free port), the process
    count and its index in ``NNX_SPMD_*`` variables, and its share of the
    simulated devices. Output lines are prefixed with the process index.
    SIGTERM and SIGINT are forwarded. If a process fails, the others are
    stopped (SIGTERM, then SIGKILL after ``grace_s``) and the launch fails
    naming it; if the launcher dies, its children die with it.
    """

    def __init__(
        self,
        command: Sequence[str],
        num_processes: int,
        *,
        grace_s: float = 20.0,
        out: IO[str] | None = None,
    ) -> None:
        if num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {num_processes}.")
        self.command = list(command)
        self.num_processes = num_processes
        split_host_devices(os.environ.get("XLA_FLAGS", ""), num_processes)  # fails early
        self.grace_s = grace_s
        self.out = out or sys.stdout
        self.children: list[subprocess.Popen[bytes]] = []

    def child_env(self, index: int, port: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                COORDINATOR: f"127.0.0.1:{port}",
                NUM_PROCESSES: str(self.num_processes),
                PROCESS_ID: str(index),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if "XLA_FLAGS" in env:
            env["XLA_FLAGS"] = split_host_devices(env["XLA_FLAGS"], self.num_processes)
        return env

    def run(self) -> int:
        """Starts the processes and waits for them; the exit status of the job."""
        port = free_port()
        relays = []
        for index in range(self.num_processes):
            with warnings.catch_warnings():
                # JAX warns that fork and threads deadlock; the child only calls prctl and execs.
                warnings.simplefilter("ignore", RuntimeWarning)
                child = subprocess.Popen(
                    self.command,
                    env=self.child_env(index, port),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent,  # noqa: PLW1509 - only prctl, then exec
                )
            self.children.append(child)
            assert child.stdout is not None
            relay = threading.Thread(target=_relay, args=(index, child.stdout, self.out))
            relay.start()
            relays.append(relay)
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            status = self._wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for relay in relays:
                relay.join(timeout=5)
        return status

    def _forward(self, signum: int, frame: Any) -> None:
        del frame
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signum)

    def _wait(self) -> int:
        while True:
            codes = [child.poll() for child in self.children]
            failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                index, code = failed[0]
                how = (
                    f"was killed by {signal.Signals(-code).name}"
                    if code < 0
                    else (f"exited with status {code}")
                )
                self.out.write(
                    f"launcher: process {index} of {self.num_processes} {how}; "
                    "stopping the others.\n"
                )
                self._stop_all()
                return code if code and code > 0 else 1
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.1)

    def _stop_all(self) -> None:
        running = [child for child in self.children if child.poll() is None]
        for child in running:
            child.terminate()
        deadline = time.monotonic() + self.grace_s
        for child in running:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
