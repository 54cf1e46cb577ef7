"""Processes agreeing on a value: the one place the job's processes exchange host values.

Every process calls ``all_values(topic, value)`` at the same point of its program and gets
every process's value, in process order; ``broadcast_from_first(topic, value)`` gives
every process process 0's value. Values are anything ``json.dumps`` takes. With one
process both return at once, without JAX's distributed runtime.

The exchange goes through JAX's coordination service (the key-value store that
``jax.distributed.initialize`` starts), not the devices: it may run in any thread
(the prefetch thread places batches while steps run), it needs no device program in
a common order, and a process that never arrives is named (``PeerMissing``) after
``timeout_s`` instead of hanging a collective. Use a device collective
(``jax.experimental.multihost_utils``) for arrays; this is for small host values
(a choice, a fingerprint, a verdict).

Rounds: each ``topic`` counts its own calls (the n-th call of a topic on one process
meets the n-th call on the others), so a topic may be agreed on again and again, and
two topics never wait for each other. The count belongs to the joined runtime's
``Agreement`` (``Agreement.current()``), not to whoever calls: two objects of one
process (two trainers, ``auto``'s candidates) that agree on one topic take
successive rounds instead of meeting an earlier round's values.
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any, Protocol

import jax

from nnx_spmd_trainer.adapters import jax_private

#: Seconds a process waits for the others at one round, by default.
ROUND_TIMEOUT_S = 300


class KeyValueStore(Protocol):
    """What an ``Agreement`` exchanges values through: the calls it makes of JAX's
    coordination-service client (``adapters.jax_private.coordination_client``)."""

    def key_value_set(self, key: str, value: str, /) -> None:
        """Publishes ``value`` under ``key`` (once: a key is never set twice)."""

    def blocking_key_value_get(self, key: str, timeout_in_ms: int, /) -> str:
        """``key``'s value, waiting up to ``timeout_in_ms`` for it to be set (then raises)."""


class PeerMissing(RuntimeError):
    """A process did not publish its value for a round within the timeout.

    Attributes:
      process: the process that did not arrive.
      topic: what was being agreed on.
    """

    def __init__(self, process: int, topic: str, timeout_s: float) -> None:
        super().__init__(
            f"nnx_spmd_trainer: process {process} did not arrive to agree on {topic[:200]!r} "
            f"within {timeout_s:g} s"
        )
        self.process, self.topic = process, topic


class Agreement:
    """The rounds of agreement of one joined runtime: a key-value store, this process's
    index and the process count, and how many rounds each topic has had here.

    Args:
      store: JAX's coordination-service client (or a stand-in with ``key_value_set`` and
        ``blocking_key_value_get``).
      process, processes: this process's index and the job's process count.
    """

    PREFIX = "nnx_spmd_trainer/agree/"
    _current: Agreement | None = None
    _current_lock = threading.Lock()

    def __init__(self, store: KeyValueStore, process: int, processes: int) -> None:
        self.store, self.process, self.processes = store, process, processes
        self._lock = threading.Lock()
        self._rounds: dict[str, int] = {}  # topic -> rounds taken by this process

    @classmethod
    def current(cls) -> Agreement | None:
        """The joined runtime's ``Agreement`` (one per coordination client), or None: one
        process, or JAX's client not found."""
        if jax.process_count() == 1:
            return None
        client = jax_private.coordination_client()
        if client is None:
            return None
        with cls._current_lock:
            if cls._current is None or cls._current.store is not client:
                cls._current = cls(client, jax.process_index(), jax.process_count())
            return cls._current

    def rounds(self, topic: str) -> int:
        """How many rounds of ``topic`` this process has started."""
        with self._lock:
            return self._rounds.get(topic, 0)

    def key(self, topic: str, round_: int, process: int) -> str:
        """Where ``process`` publishes its value for round ``round_`` of ``topic``."""
        digest = hashlib.sha1(topic.encode()).hexdigest()[:16]
        return f"{self.PREFIX}{digest}/{round_}/{process}"

    def _next_round(self, topic: str) -> int:
        with self._lock:
            round_ = self._rounds.get(topic, 0)
            self._rounds[topic] = round_ + 1
            return round_

    def _read(self, topic: str, round_: int, process: int, timeout_s: float) -> Any:
        try:
            text = self.store.blocking_key_value_get(
                self.key(topic, round_, process), int(timeout_s * 1000)
            )
        except Exception as error:  # DEADLINE_EXCEEDED (a JaxRuntimeError)
            raise PeerMissing(process, topic, timeout_s) from error
        return json.loads(text)

    def all_values(
        self, topic: str, value: Any, *, timeout_s: float = ROUND_TIMEOUT_S
    ) -> list[Any]:
        """Every process's ``value`` for this round of ``topic``, in process order."""
        round_ = self._next_round(topic)
        self.store.key_value_set(self.key(topic, round_, self.process), json.dumps(value))
        return [
            value if p == self.process else self._read(topic, round_, p, timeout_s)
            for p in range(self.processes)
        ]

    def broadcast_from_first(
        self, topic: str, value: Any, *, timeout_s: float = ROUND_TIMEOUT_S
    ) -> Any:
        """Process 0's ``value`` for this round of ``topic`` (the others' are not sent)."""
        round_ = self._next_round(topic)
        if self.process == 0:
            self.store.key_value_set(self.key(topic, round_, 0), json.dumps(value))
            return value
        return self._read(topic, round_, 0, timeout_s)


def _joined(topic: str) -> Agreement:
    agreement = Agreement.current()
    if agreement is None:
        raise RuntimeError(
            f"nnx_spmd_trainer: the processes cannot agree on {topic[:200]!r}: JAX's "
            "coordination-service client was not found (was jax.distributed initialised "
            "through nnx_spmd_trainer.distributed.initialize?)."
        )
    return agreement


def all_values(topic: str, value: Any, *, timeout_s: float = ROUND_TIMEOUT_S) -> list[Any]:
    """Every process's ``value`` (JSON) for this round of ``topic``, in process order.

    Call it at the same point on every process (the n-th call of a topic meets the
    n-th call elsewhere); one process gets ``[value]``. Raises ``PeerMissing`` naming
    a process that did not arrive within ``timeout_s``.

    >>> all_values("example", {"loss": 1.5})  # one process
    [{'loss': 1.5}]
    """
    if jax.process_count() == 1:
        return [value]
    return _joined(topic).all_values(topic, value, timeout_s=timeout_s)


def broadcast_from_first(topic: str, value: Any, *, timeout_s: float = ROUND_TIMEOUT_S) -> Any:
    """Process 0's ``value`` (JSON), on every process: a choice one process makes and all
    follow. Same rounds and errors as ``all_values``; one process gets ``value``.

    >>> broadcast_from_first("example", "fsdp")
    'fsdp'
    """
    if jax.process_count() == 1:
        return value
    return _joined(topic).broadcast_from_first(topic, value, timeout_s=timeout_s)
