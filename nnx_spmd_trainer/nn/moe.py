"""A mixture-of-experts feed-forward block (GShard dispatch), its auxiliary losses and metrics.

``MoE`` replaces a transformer block's MLP: a router picks ``top_k`` of
``num_experts`` expert MLPs per token, each expert takes at most ``capacity``
tokens per sequence (the rest are dropped: they pass through the residual
only), and the outputs are combined with the router's weights.

Dispatch is the GShard einsum form: one-hot ``dispatch``/``combine`` tensors
``(batch, seq, experts, capacity)`` and plain einsums, so the program is
written over global arrays and the compiler partitions it. The expert
weights ``(experts, ...)`` carry the logical axis name ``experts``
(``EXPERTS``): ``ExpertParallel`` maps it to its mesh axis, and the block
moves the dispatched tokens ``(batch, experts, capacity, embed)`` from rows
split over that axis to experts split over it and back, one ``all_to_all``
each way, so each device runs only its own experts on every token routed to
them. Without an expert axis the weights are laid out as any other leaf
(replicated, or split by FSDP's fallback) and no tokens move.

``MoE(..., capacity_factor=None)`` drops nothing: each device sorts its token choices
by expert and runs the experts with ``jax.lax.ragged_dot`` (``moe_dropless``, which
says which collective each backend uses under an expert axis).

Routing groups are whole sequences: a token's slot in its expert's buffer is
counted along its own sequence (first choices of every token before any
second choice, as GShard orders them), and ``capacity`` is per sequence. So
which tokens are dropped depends on the sequence alone, never on how the
batch is split over devices: every layout computes the one-device result.

Auxiliary losses and metrics leave the block as ``nnx.sow`` would leave them
(an ``nnx.Intermediate`` attribute holding one entry per call, not carried by
the Trainer from step to step); a
``loss_fn`` adds them with ``moe_losses(model)``, which also returns the
metrics (``METRIC_NAMES``) to put in ``aux``; declare them in the metrics
collection with ``moe_metrics(num_experts)``::

    def loss_fn(model, batch):
        loss, aux = my_loss(model, batch)
        extra, moe_aux = moe_losses(model)
        return loss + extra, {**aux, **moe_aux}
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from clu import metrics as clu_metrics
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer.nn import tracing
from nnx_spmd_trainer.nn.moe_dropless import dropless_experts

__all__ = ["EXPERTS", "METRIC_NAMES", "MoE", "expert_axes", "moe_losses", "moe_metrics"]

#: The logical name of the experts dimension of expert weights and dispatched tokens.
EXPERTS = "experts"
#: The metrics ``moe_losses`` returns (``moe_expert_load_{e}`` per expert as well).
METRIC_NAMES = (
    "moe_load_balance",
    "moe_router_z",
    "moe_dropped_fraction",
    "moe_dropped_tokens",
)
_SOWN = "moe_stats"


def expert_axes() -> tuple[str, ...]:
    """The mesh axes splitting the experts while a step is traced: where the enclosing
    ``nnx.logical_axis_rules`` map ``experts``, kept if the current mesh has them with
    more than one device; ``()`` when the experts are not split.

    >>> expert_axes()  # no rules, no mesh
    ()
    """
    return tracing.traced_axes(EXPERTS)


def _exchange(x: jax.Array, *, to_experts: bool) -> jax.Array:
    """Dispatched tokens ``(batch, experts, capacity, ...)`` moved between a layout with the
    rows split over the expert axis and one with the experts split over it: one
    ``all_to_all`` over that axis (in a ``shard_map`` manual over it alone; every other
    axis stays the compiler's). A sharding constraint alone let the compiler gather the
    rows instead. Without an expert axis, ``x`` as it is."""
    axes = expert_axes()
    if not axes:
        return x
    if len(axes) > 1:
        raise ValueError(f"MoE: the experts map to several mesh axes {axes}; map them to one.")
    (axis,) = axes
    rows, experts = P(axis), P(None, axis)

    def exchange(local: jax.Array) -> jax.Array:
        split, concat = (1, 0) if to_experts else (0, 1)
        return jax.lax.all_to_all(local, axis, split, concat, tiled=True)

    return jax.shard_map(
        exchange,
        in_specs=rows if to_experts else experts,
        out_specs=experts if to_experts else rows,
        axis_names={axis},
    )(x)


class MoE(nnx.Module):
    """Top-k routed expert MLPs with a per-sequence capacity: ``(batch, seq, embed)`` in and out.

    Args:
      embed_dim: the model width.
      ff_dim: each expert's hidden width.
      num_experts: ``E``; expert weights are ``(E, embed_dim, ff_dim)`` and
        ``(E, ff_dim, embed_dim)``, annotated ``(experts, None, mlp)`` and
        ``(experts, mlp, None)`` (tensor parallelism splits each expert's ``mlp``).
      top_k: experts per token; their router weights are renormalised to sum to 1.
      capacity_factor: each expert takes at most
        ``ceil(capacity_factor * seq * top_k / E)`` tokens per sequence. ``None``:
        dropless, every token reaches its ``top_k`` experts (tokens sorted by expert,
        ``jax.lax.ragged_dot``; ``nn.moe_dropless`` says which collective each backend
        uses under an expert axis).
      load_balance_weight: the coefficient of the Switch/GShard load-balance
        loss ``E * sum_e(fraction routed to e * mean router probability of e)``.
      z_loss_weight: the coefficient of the router z-loss ``mean(logsumexp(logits)**2)``.

    >>> with nnx.use_eager_sharding(False):
    ...     block = MoE(16, 32, num_experts=4, top_k=2, rngs=nnx.Rngs(0))
    >>> block(jnp.ones((2, 8, 16))).shape
    (2, 8, 16)
    >>> extra, metrics = moe_losses(block)
    >>> sorted(metrics)[:2]
    ['moe_dropped_fraction', 'moe_dropped_tokens']
    """

    def __init__(
        self,
        embed_dim: int,
        ff_dim: int,
        num_experts: int,
        *,
        top_k: int = 2,
        capacity_factor: float | None = 1.25,
        load_balance_weight: float = 1e-2,
        z_loss_weight: float = 0.0,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
    ) -> None:
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k={top_k} must be between 1 and num_experts={num_experts}.")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(
                f"MoE: capacity_factor={capacity_factor} must be positive, or None for "
                "dropless routing."
            )
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.load_balance_weight, self.z_loss_weight = load_balance_weight, z_loss_weight
        self.dtype = dtype
        # The router is small and read whole by every token: left to the strategy.
        self.router = nnx.Param(
            nnx.initializers.normal(0.02)(rngs.params(), (embed_dim, num_experts), param_dtype)
        )
        # Each expert is one MLP; the stacked initializer keeps each expert's fan-in/out.
        init = nnx.initializers.xavier_uniform(batch_axis=(0,))
        self.wi = nnx.Param(
            init(rngs.params(), (num_experts, embed_dim, ff_dim), param_dtype),
            out_sharding=(EXPERTS, None, "mlp"),
        )
        self.wo = nnx.Param(
            init(rngs.params(), (num_experts, ff_dim, embed_dim), param_dtype),
            out_sharding=(EXPERTS, "mlp", None),
        )

    def capacity(self, seq_len: int) -> int:
        """Tokens each expert takes per sequence (dropless blocks have no capacity)."""
        if self.capacity_factor is None:
            raise ValueError("MoE: a dropless block (capacity_factor=None) has no capacity.")
        return max(1, math.ceil(self.capacity_factor * seq_len * self.top_k / self.num_experts))

    def __call__(self, x: jax.Array) -> jax.Array:
        logits = jnp.einsum(
            "bsd,de->bse", x.astype(jnp.float32), self.router[...].astype(jnp.float32)
        )
        probs = jax.nn.softmax(logits, axis=-1)
        weights, chosen_ids = jax.lax.top_k(probs, self.top_k)  # (b, s, k)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        chosen = jax.nn.one_hot(chosen_ids, self.num_experts, dtype=jnp.int32)  # (b, s, k, e)
        if self.capacity_factor is None:
            y = dropless_experts(
                x.astype(self.dtype), weights, chosen_ids, self.wi[...], self.wo[...],
                expert_axes=expert_axes(),
            )  # fmt: skip
            self._sow_stats(logits, probs, chosen, chosen)  # nothing dropped
            return y.astype(x.dtype)
        capacity = self.capacity(x.shape[1])
        # Slots counted along the sequence, every first choice before any second one.
        b, s, k, e = chosen.shape
        by_priority = chosen.transpose(0, 2, 1, 3).reshape(b, k * s, e)
        slot = (jnp.cumsum(by_priority, axis=1) - 1) * by_priority
        slot = slot.reshape(b, k, s, e).transpose(0, 2, 1, 3)
        kept = chosen * (slot < capacity)
        # A token's k choices are distinct experts: summing over k keeps one entry per expert.
        kept_e = kept.sum(axis=2)  # (b, s, e), 0 or 1
        dispatch = jax.nn.one_hot((slot * kept).sum(axis=2), capacity, dtype=self.dtype)
        dispatch = dispatch * kept_e[..., None].astype(self.dtype)  # (b, s, e, c)
        weight_e = jnp.sum(weights[..., None] * kept, axis=2)  # (b, s, e)
        combine = dispatch * weight_e[..., None].astype(self.dtype)

        tokens = _exchange(
            jnp.einsum("bsec,bsd->becd", dispatch, x.astype(self.dtype)), to_experts=True
        )
        hidden = nnx.gelu(jnp.einsum("becd,edf->becf", tokens, self.wi[...].astype(self.dtype)))
        out = jnp.einsum("becf,efd->becd", hidden, self.wo[...].astype(self.dtype))
        out = _exchange(out, to_experts=False)
        y = jnp.einsum("bsec,becd->bsd", combine, out)

        self._sow_stats(logits, probs, chosen, kept)
        return y.astype(x.dtype)

    def _sow_stats(
        self, logits: jax.Array, probs: jax.Array, chosen: jax.Array, kept: jax.Array
    ) -> None:
        routed = chosen.sum(axis=2).astype(jnp.float32)  # (b, s, e): 1 where a token chose e
        tokens = routed.shape[0] * routed.shape[1]
        load = routed.sum(axis=(0, 1)) / (tokens * self.top_k)  # fraction of choices per expert
        balance = self.num_experts * jnp.sum(load * probs.mean(axis=(0, 1)))
        dropped = jnp.sum(chosen) - jnp.sum(kept)
        stats = {
            "moe_load_balance": balance,
            "moe_router_z": jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
            "moe_dropped_fraction": dropped / (tokens * self.top_k),
            "moe_dropped_tokens": dropped.astype(jnp.float32),
            "load": load,
        }
        # What nnx.sow does (one more entry per call), kept as an attribute: sow outside
        # nnx.capture is deprecated in Flax 0.12, and the Trainer drops nnx.Intermediate
        # from the carried state either way.
        earlier = getattr(self, _SOWN).get_value() if hasattr(self, _SOWN) else ()
        setattr(self, _SOWN, nnx.Intermediate((*earlier, stats)))


def moe_losses(model: nnx.Module) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Pops what every ``MoE`` block in ``model`` sowed in its forward passes: the sum of
    their weighted auxiliary losses, and the metrics (``METRIC_NAMES`` averaged over the
    blocks, ``moe_dropped_tokens`` summed, ``moe_expert_load_{e}`` per expert averaged).

    ``(0.0, {})`` for a model without MoE blocks (or not called since the last pop).
    """
    extra = jnp.zeros((), jnp.float32)
    found: list[dict[str, jax.Array]] = []
    for _, block in nnx.iter_modules(model):
        if not isinstance(block, MoE) or not hasattr(block, _SOWN):
            continue
        calls = getattr(block, _SOWN).get_value()
        delattr(block, _SOWN)
        for stats in calls:
            extra = extra + block.load_balance_weight * stats["moe_load_balance"]
            extra = extra + block.z_loss_weight * stats["moe_router_z"]
            found.append(stats)
    if not found:
        return extra, {}
    metrics = {name: jnp.mean(jnp.stack([f[name] for f in found])) for name in METRIC_NAMES}
    metrics["moe_dropped_tokens"] = jnp.sum(jnp.stack([f["moe_dropped_tokens"] for f in found]))
    loads = jnp.mean(jnp.stack([f["load"] for f in found]), axis=0)
    metrics.update({f"moe_expert_load_{i}": load for i, load in enumerate(loads)})
    return extra, metrics


def moe_metrics(num_experts: int) -> dict[str, type[clu_metrics.Metric]]:
    """CLU metrics averaging ``moe_losses``'s values over a log period; spread into
    ``clu.metrics.Collection.create(loss=..., **moe_metrics(E))``."""
    names = [*METRIC_NAMES, *(f"moe_expert_load_{i}" for i in range(num_experts))]
    return {name: clu_metrics.Average.from_output(name) for name in names}
