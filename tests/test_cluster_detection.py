"""The process count a job expects from JAX's cluster detection, found as
``jax.distributed.initialize`` finds it: an opt-in-only environment (mpi4py's, "present"
wherever mpi4py is installed) counts only when named, never by default."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from jax._src import clusters  # the registry the fakes join, as JAX's own clusters do

from nnx_spmd_trainer.distributed import runtime


def _fake_cluster(name: str, *, opt_in: bool, processes: int) -> type:
    """A present cluster environment of ``processes`` processes, checked first (registered
    at the front of JAX's list, as mpi4py's sits before Kubernetes' and GKE's)."""

    class Fake(clusters.ClusterEnv):
        opt_in_only_method = opt_in

        @classmethod
        def is_env_present(cls) -> bool:
            return True

        @classmethod
        def get_process_count(cls) -> int:
            return processes

    Fake.name = name
    registry = clusters.ClusterEnv._cluster_types
    registry.remove(Fake)  # __init_subclass__ appended it
    registry.insert(0, Fake)
    return Fake


@pytest.fixture
def registered() -> Iterator[list[type]]:
    """The fakes a test registers, removed from JAX's list afterwards."""
    fakes: list[type] = []
    yield fakes
    for fake in fakes:
        clusters.ClusterEnv._cluster_types.remove(fake)


@pytest.fixture(autouse=True)
def no_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(runtime.NUM_PROCESSES, raising=False)


def test_a_present_opt_in_cluster_is_not_counted(registered):
    registered.append(_fake_cluster("fake_mpi", opt_in=True, processes=4))
    assert runtime.expected_processes() == 1
    assert runtime.initialize() is False  # one process: nothing to join


def test_an_opt_in_cluster_does_not_hide_the_cluster_behind_it(registered):
    registered.append(_fake_cluster("fake_kubernetes", opt_in=False, processes=3))
    registered.append(_fake_cluster("fake_mpi", opt_in=True, processes=1))  # now first
    assert runtime.expected_processes() == 3


def test_a_present_cluster_is_counted(registered):
    registered.append(_fake_cluster("fake_slurm", opt_in=False, processes=4))
    assert runtime.expected_processes() == 4
