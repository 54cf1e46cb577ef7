"""The DPO losses, pure over log-probabilities: sigmoid (Rafailov et al. 2023, with
label smoothing: conservative DPO) and IPO (Azar et al. 2023), and TRL's metrics.

With ``pi`` the policy's and ``ref`` the reference's log-probability of a completion
given its prompt (``c`` chosen, ``r`` rejected)::

    h = (pi_c - ref_c) - (pi_r - ref_r)
    sigmoid: -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)
    ipo:     (h - 1 / (2 * beta)) ** 2      (log-probabilities averaged over tokens, as TRL)

The loss is the mean over pairs. Metrics, as TRL names them: ``rewards/chosen`` (the
mean of ``beta * (pi_c - ref_c)``), ``rewards/rejected``, ``rewards/accuracies`` (the
share of pairs whose chosen reward is the larger), ``rewards/margins`` and
``logps/chosen``, ``logps/rejected`` (the policy's summed log-probabilities).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nnx_spmd_trainer.nn.logprob import scores_from_logits

#: The loss types ``dpo_loss`` computes.
LOSS_TYPES = ("sigmoid", "ipo")


def sequence_logps(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """``[rows]``: each row's weighted sum of the log-probabilities of its targets
    (``logits`` ``[rows, seq, vocab]``, ``targets`` and ``weights`` ``[rows, seq]``)."""
    picked, _ = scores_from_logits(logits, targets)  # the one per-token formula
    return jnp.sum(picked * weights, axis=-1)


def check_loss(loss_type: str, beta: float, label_smoothing: float) -> None:
    """Raises ``ValueError`` naming a loss setting that cannot be used."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}.")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}.")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}.")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError("label_smoothing applies to loss_type='sigmoid' only.")


def dpo_loss(
    policy: tuple[jax.Array, jax.Array],
    reference: tuple[jax.Array, jax.Array],
    tokens: tuple[jax.Array, jax.Array],
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(loss, metrics)`` of a batch of pairs.

    Args:
      policy: the policy's summed log-probabilities ``(chosen, rejected)``, ``[rows]`` each.
      reference: the reference model's, the same way.
      tokens: the completions' trained token counts ``(chosen, rejected)`` (IPO averages).
      beta, loss_type, label_smoothing: as the module says.
    """
    (pi_c, pi_r), (ref_c, ref_r) = policy, reference
    if loss_type == "ipo":
        n_c, n_r = (jnp.maximum(n, 1.0) for n in tokens)
        h = (pi_c / n_c - ref_c / n_c) - (pi_r / n_r - ref_r / n_r)
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        h = (pi_c - ref_c) - (pi_r - ref_r)
        eps = label_smoothing
        losses = -(1 - eps) * jax.nn.log_sigmoid(beta * h) - eps * jax.nn.log_sigmoid(-beta * h)
    chosen = jax.lax.stop_gradient(beta * (pi_c - ref_c))
    rejected = jax.lax.stop_gradient(beta * (pi_r - ref_r))
    metrics = {
        "rewards/chosen": jnp.mean(chosen),
        "rewards/rejected": jnp.mean(rejected),
        "rewards/accuracies": jnp.mean((chosen > rejected).astype(jnp.float32)),
        "rewards/margins": jnp.mean(chosen - rejected),
        "logps/chosen": jnp.mean(jax.lax.stop_gradient(pi_c)),
        "logps/rejected": jnp.mean(jax.lax.stop_gradient(pi_r)),
    }
    return jnp.mean(losses), metrics
