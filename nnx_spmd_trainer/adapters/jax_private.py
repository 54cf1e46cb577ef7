"""JAX's insides that the package needs, in one place (checked against jax 0.10.2).

``jax.distributed`` exposes ``initialize``, ``is_initialized`` and ``shutdown`` only:
neither the coordination service's key-value store (which ``distributed.agree`` and
``distributed.peers`` exchange host values through) nor the cluster detection
``initialize`` runs (which ``distributed.runtime`` asks before JAX starts) has a
public API. ``tests/test_adapters.py`` checks both assumptions.

``cudnn_attention`` reaches cuDNN's fused attention below ``jax.nn.dot_product_attention``
for its float32 log-sum-exp (ring attention merges its blocks by it); see there.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

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


#: The prefix of cuDNN's fused attention kernels' names in a compiled HLO
#: (``__cudnn$fmhaSoftmax``, ``__cudnn$fmhaScaleBiasSoftmax``, their ``Backward``s).
CUDNN_ATTENTION_TARGET = "__cudnn$fmha"
#: The keywords ``cudnn_attention`` passes to JAX's private ``dot_product_attention``.
CUDNN_ATTENTION_KEYWORDS = ("mask", "scale", "mask_type", "return_residual")


def cudnn_attention() -> Callable[..., tuple[Any, Any]] | None:
    """cuDNN's fused attention with its float32 log-sum-exp: ``attend(q, k, v, mask, *,
    causal) -> (out [b, t, h, d], lse [b, h, t] float32)`` over ``[b, t, h, d]`` fp16/bf16
    arrays (``mask``: ``[b, 1, t, s]`` bool, True to keep, or None); None where JAX moved
    ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``.

    Private because the public ``jax.nn.dot_product_attention(..., implementation="cudnn",
    return_residual=True)`` (jax 0.10.2) casts the kernel's float32 log-sum-exp to the
    output's dtype: in bf16 (8 significant bits) an lse of 5-10 is off by up to 0.04,
    and blocks merged by it would be weighted ~4% wrong. The kernel itself runs on a GPU
    only; this builds no array until called."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fused
    except ImportError:  # pragma: no cover - moved in a future JAX
        return None
    attention = getattr(fused, "dot_product_attention", None)
    mask_types = getattr(fused, "MaskType", None)
    if attention is None or mask_types is None:  # pragma: no cover - moved
        return None
    if not set(CUDNN_ATTENTION_KEYWORDS) <= set(inspect.signature(attention).parameters):
        return None  # pragma: no cover - its keywords changed

    def attend(q: Any, k: Any, v: Any, mask: Any, *, causal: bool) -> tuple[Any, Any]:
        out, lse = attention(
            q,
            k,
            v,
            mask=mask,
            scale=float(1.0 / np.sqrt(q.shape[-1])),
            mask_type=mask_types.CAUSAL if causal else mask_types.NO_MASK,
            return_residual=True,
        )
        return out, lse.astype(jnp.float32)

    return attend
