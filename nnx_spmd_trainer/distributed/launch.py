"""The local launcher: one JAX job as several processes on this machine, for development."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from typing import IO, Any

from nnx_spmd_trainer.distributed.gloo_notes import GlooNotes
from nnx_spmd_trainer.distributed.runtime import COORDINATOR, NUM_PROCESSES, PROCESS_ID

HOST_DEVICES = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


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
