"""JAX's insides that the package needs, in one place (checked against jax 0.10.2).

``jax.distributed`` exposes ``initialize``, ``is_initialized`` and ``shutdown`` only:
neither the coordination service's key-value store (which ``distributed.agree`` and
``distributed.peers`` exchange host values through) nor the cluster detection
``initialize`` runs (which ``distributed.runtime`` asks before JAX starts) has a
public API. ``tests/test_adapters.py`` checks both assumptions.
"""

from __future__ import annotations

import contextlib
from typing import Any

#: The client methods ``coordination_client`` promises (the calls the package makes).
CLIENT_METHODS = (
    "key_value_set",
    "blocking_key_value_get",
    "key_value_dir_get",
)


def coordination_client() -> Any | None:
    """The client of JAX's coordination service that ``jax.distributed.initialize`` set up
    (``jax._src.distributed.global_state.client``), or None: not initialised, or JAX
    moved it (then nothing that needs it can run; the callers say what is lost).

    Private because JAX keeps its key-value store to itself: ``multihost_utils`` offers
    device collectives only, which need the devices and a common order of programs;
    the store does not (it is reached from any thread, while steps run)."""
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - moved in a future JAX
        return None
    client = getattr(getattr(distributed, "global_state", None), "client", None)
    if client is None or not all(hasattr(client, m) for m in CLIENT_METHODS):
        return None
    return client


def cluster_types() -> list[Any]:
    """The cluster environments JAX's detection knows (``ClusterEnv._cluster_types``, in
    registration order; empty if JAX moved them)."""
    try:
        from jax._src import clusters
    except ImportError:  # pragma: no cover - moved in a future JAX
        return []
    return list(getattr(clusters.ClusterEnv, "_cluster_types", []))


def detected_cluster(cluster_detection_method: str | None = None) -> Any | None:
    """The cluster environment ``jax.distributed.initialize`` would take its process count
    from, found the way it finds it (``ClusterEnv.auto_detect_unset_distributed_params``):
    the one named ``cluster_detection_method`` if that one is present; without a name,
    the first present one that is not opt-in only (``opt_in_only_method``: mpi4py's,
    "present" wherever mpi4py is installed, is used only when named). None: no cluster.

    Private because JAX offers no way to ask what ``initialize`` would detect without
    initialising; an environment whose check fails counts as absent."""
    for cluster in cluster_types():
        if cluster_detection_method is not None:
            if getattr(cluster, "name", None) != cluster_detection_method:
                continue
        elif getattr(cluster, "opt_in_only_method", False):
            continue
        with contextlib.suppress(Exception):
            if cluster.is_env_present():
                return cluster
        if cluster_detection_method is not None:
            return None
    return None


def cluster_process_count(cluster_detection_method: str | None = None) -> int:
    """How many processes ``detected_cluster`` says the job has (1 without a cluster, or
    when the environment cannot tell)."""
    cluster = detected_cluster(cluster_detection_method)
    if cluster is None:
        return 1
    with contextlib.suppress(Exception):
        return int(cluster.get_process_count())
    return 1
