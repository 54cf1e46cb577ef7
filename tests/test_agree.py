"""distributed.agree: rounds per topic, every process's values, process 0's value, a
missing process named. Two threads stand in for two processes over one stand-in store
(tests/test_multiprocess.py runs real processes through JAX's coordination service)."""

from __future__ import annotations

import threading
import time

import pytest

from nnx_spmd_trainer.distributed import agree
from nnx_spmd_trainer.distributed.agree import Agreement, PeerMissing


class Store:
    """A stand-in for JAX's key-value store: a get waits for the key, as JAX's does."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.changed = threading.Condition()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self.changed:
            if key in self.values and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]


def _both(store: Store, call) -> list:
    """``call(agreement)`` as process 0 and process 1 at once; their results."""
    results: list = [None, None]
    errors: list[BaseException] = []

    def run(process: int) -> None:
        try:
            results[process] = call(Agreement(store, process, 2))
        except BaseException as error:  # noqa: BLE001 - handed to the test
            errors.append(error)

    threads = [threading.Thread(target=run, args=(p,)) for p in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    if errors:
        raise errors[0]
    return results


def test_every_process_gets_every_value_in_process_order_round_after_round():
    def three_rounds(agreement: Agreement) -> list:
        me = agreement.process
        return [agreement.all_values("t", {"p": me, "round": r}) for r in range(3)]

    for rounds in _both(Store(), three_rounds):
        assert rounds == [[{"p": 0, "round": r}, {"p": 1, "round": r}] for r in range(3)]


def test_broadcast_from_first_gives_process_0s_value_to_all():
    store = Store()
    got = _both(store, lambda a: a.broadcast_from_first("choice", f"mine is {a.process}"))
    assert got == ["mine is 0", "mine is 0"]
    assert not any(key.endswith("/1") for key in store.values)  # process 1 sent nothing


def test_topics_count_their_own_rounds():
    """A topic's n-th round meets the n-th round elsewhere, whatever other topics did."""
    store = Store()

    def uneven(agreement: Agreement) -> list:
        if agreement.process == 0:
            agreement.broadcast_from_first("other", 1)  # sends, waits for no one
        return agreement.all_values("t", agreement.process)

    assert _both(store, uneven) == [[0, 1], [0, 1]]


def test_a_process_that_never_arrives_is_named():
    agreement = Agreement(Store(), 0, 2)
    start = time.monotonic()
    with pytest.raises(PeerMissing, match=r"process 1 did not arrive to agree on 'rows'") as e:
        agreement.all_values("rows", [1], timeout_s=0.2)
    assert e.value.process == 1 and time.monotonic() - start < 5


def test_one_process_agrees_with_itself_without_a_runtime():
    assert Agreement.current() is None
    assert agree.all_values("t", {"a": 1}) == [{"a": 1}]
    assert agree.broadcast_from_first("t", [2]) == [2]
