"""The GRPO objective, pure over per-token log-probabilities (Shao et al. 2024, as TRL's
``GRPOTrainer`` computes it with ``loss_type="dapo"``: the token mean).

With ``logp`` the policy's log-probability of a completion token, ``old`` the one at the
rollout (the policy before this rollout's first update), ``A`` the completion's advantage
(``rewards.group_advantages``) and ``ref`` the reference model's::

    ratio = exp(logp - old)
    per_token = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon) * A) + beta * kl
    kl = exp(ref - logp) - (ref - logp) - 1        (the k3 estimator, >= 0)
    loss = sum(per_token * w) / sum(w)             (w: 1 on the completions' tokens)

The mean is over every completion token of the batch (``token_weight``: a step that
accumulates gradients over microbatches gives the same mean).

``logp``, ``old`` and ``ref`` are log-probabilities under the distribution the completions
were sampled from (``GRPOTrainer.policy_logps``): the logits divided by the temperature
and, with top-k or top-p, renormalised over the tokens sampling kept at that position
(those whose scaled logit is at least ``kept_min_logit``, fixed at the rollout).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nnx_spmd_trainer.nn.logprob import scores_from_logits
from nnx_spmd_trainer.planner.step import TOKEN_WEIGHT

__all__ = ["grpo_loss", "loosened", "token_logps"]


def token_logps(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``[rows, seq]``: the log-probability of each target under ``logits``, in float32
    (``nn.logprob``'s one implementation, on logits a model has already written; a model
    with an ``OutputHead`` is read without them, ``token_log_probs``)."""
    return scores_from_logits(logits, targets)[0]


#: How far below ``kept_min_logit`` a scaled logit still counts as kept, relative: the
#: learner's teacher-forced logits and the sampler's cached ones differ in the last bits.
KEPT_TOLERANCE = 1e-5


def loosened(kept_min_logit: jax.Array) -> jax.Array:
    """``kept_min_logit`` lowered by ``KEPT_TOLERANCE`` (relative; ``-inf`` stays): the
    threshold a learner's own pass compares its scaled logits with."""
    kept = kept_min_logit.astype(jnp.float32)
    return kept - KEPT_TOLERANCE * (1.0 + jnp.abs(jnp.where(jnp.isfinite(kept), kept, 0.0)))


def grpo_loss(
    logps: jax.Array,
    old_logps: jax.Array,
    advantages: jax.Array,
    weights: jax.Array,
    reference_logps: jax.Array | None = None,
    *,
    epsilon: float,
    beta: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(loss, aux)``: the clipped objective's token mean, and ``aux`` with
    ``ratio_deviation`` (the largest ``abs(ratio - 1)`` over the completion tokens),
    ``clip_fraction`` (the share of tokens whose ratio was clipped), the ratio before
    clipping (``ratio/mean``, ``ratio/max`` over the completion tokens) and TRL's
    ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean`` (the
    share of tokens clipped below with a negative advantage, above with a positive one,
    either), ``kl`` (the k3 mean, where a reference is given) and ``token_weight``.

    ``logps``, ``old_logps``, ``weights``, ``reference_logps``: ``[rows, seq]``;
    ``advantages``: ``[rows]``.
    """
    weights = weights.astype(jnp.float32)
    total = jnp.sum(weights)
    safe_total = jnp.where(total > 0, total, 1.0)
    ratio = jnp.exp(logps - old_logps)
    clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon)
    adv = advantages[:, None]
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    aux: dict[str, jax.Array] = {}
    if reference_logps is not None:
        delta = reference_logps - logps
        kl = jnp.exp(delta) - delta - 1.0
        per_token = per_token + beta * kl
        aux["kl"] = jnp.sum(kl * weights) / safe_total
    loss = jnp.sum(per_token * weights) / safe_total
    trained = weights > 0
    deviation = jnp.where(trained, jnp.abs(ratio - 1.0), 0.0)
    aux["ratio_deviation"] = jax.lax.stop_gradient(jnp.max(deviation))
    aux["clip_fraction"] = jax.lax.stop_gradient(
        jnp.sum(jnp.where(trained & (ratio != clipped), 1.0, 0.0)) / safe_total
    )
    low = trained & (ratio < 1.0 - epsilon) & (adv < 0)
    high = trained & (ratio > 1.0 + epsilon) & (adv > 0)
    share = lambda mask: jax.lax.stop_gradient(jnp.sum(jnp.where(mask, 1.0, 0.0)) / safe_total)  # noqa: E731
    aux["ratio/mean"] = jax.lax.stop_gradient(jnp.sum(ratio * weights) / safe_total)
    aux["ratio/max"] = jax.lax.stop_gradient(jnp.max(jnp.where(trained, ratio, 0.0)))
    aux["clip_ratio/low_mean"] = share(low)
    aux["clip_ratio/high_mean"] = share(high)
    aux["clip_ratio/region_mean"] = share(low | high)
    aux[TOKEN_WEIGHT] = total
    return loss, aux
