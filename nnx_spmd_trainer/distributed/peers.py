"""The dead-peer watch: a process of the job that dies or hangs ends the others with one line."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax

from nnx_spmd_trainer.adapters import jax_private
from nnx_spmd_trainer.distributed.gloo_notes import QUIET_STDOUT

#: Exit status of a process that stops because another one of its job died.
LOST_PEER_STATUS = 1


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
        client = jax_private.coordination_client()
        if client is None or jax.process_count() == 1:
            return None
        watch = cls(client, jax.process_index(), jax.process_count(), timeout_s)
        watch._thread.start()
        atexit.register(watch.stop)  # runs before JAX's shutdown (registered earlier)
        cls._current = watch
        return watch

    def stop(self) -> None:
        """Ends the watch before JAX's exit-time shutdown: a call of the client's still in
        flight while the client shuts down can abort the process from C++."""
        self.exiting.set()
        self._thread.join(timeout=10 * self.interval_s)

    def _run(self) -> None:
        beat, start = 0, time.monotonic()
        last: dict[str, tuple[str, float]] = {}  # key -> (value, when it last changed)
        while not self.exiting.is_set():
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
            self.exiting.wait(self.interval_s)

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
