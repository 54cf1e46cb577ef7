"""SpikeSkip: a step whose loss or gradient norm spikes far above the recent ones is skipped.

``Trainer(..., skip_spikes=SpikeSkip(z=6.0, window=100))`` wraps the optimizer
(``SpikeSkip.wrap``, outermost, around ``EMA`` too) so that its state keeps the rolling
statistics: the decision is made inside the compiled step with ``jnp.where`` (no host
sync, no control flow), and the statistics are in every checkpoint with the rest of the
optimizer's state. The count of skipped steps reaches the logs as ``train/skipped_spikes``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, NoReturn

import jax
import jax.numpy as jnp
import optax


class SpikeState(NamedTuple):
    """``SpikeSkip.wrap``'s optimizer state.

    Attributes:
      inner: the inner optimizer's state.
      losses, grad_norms: the last ``window`` accepted steps' values, a ring
        (``seen % window`` is where the next one goes).
      seen: accepted steps recorded so far.
      skipped: steps skipped as spikes so far (logged as ``train/skipped_spikes``).
      in_a_row: steps skipped since the last accepted one.
    """

    inner: optax.OptState
    losses: jax.Array
    grad_norms: jax.Array
    seen: jax.Array
    skipped: jax.Array
    in_a_row: jax.Array


def rolling_stats(values: jax.Array, seen: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The mean and the (population) standard deviation of the ring ``values``' first
    ``min(seen, len(values))`` entries.

    >>> mean, std = rolling_stats(jnp.array([1.0, 3.0, 0.0]), jnp.array(2))
    >>> float(mean), float(std)
    (2.0, 1.0)
    """
    count = jnp.minimum(seen, values.shape[0])
    filled = jnp.arange(values.shape[0]) < count
    n = jnp.maximum(count, 1).astype(jnp.float32)
    mean = jnp.where(filled, values, 0.0).sum() / n
    var = jnp.where(filled, jnp.square(values - mean), 0.0).sum() / n
    return mean, jnp.sqrt(var)


@dataclasses.dataclass(frozen=True)
class SpikeSkip:
    """Skips a step whose loss or gradient norm is more than ``z`` standard deviations
    above their mean over the last ``window`` accepted steps.

    Each step compares its loss (the ``value=loss`` the train step hands the optimizer)
    and the global norm of its gradients (as they reach the optimizer: before any
    clipping the optimizer does) with the mean and standard deviation of the last
    ``window`` steps that were *accepted*, so a spike never inflates the statistics it
    is judged by. A step is a spike when either value is above ``mean + z * std``
    (``std`` floored at ``1e-6 * |mean|``, so float noise over a flat loss is none),
    once ``min_steps`` steps were accepted. A skipped step changes neither the weights
    nor the optimizer's state (moments, its own counts and schedules, an ``EMA``): as
    ``skip_nonfinite_updates``, only the trainer's step count (``trainer.step``,
    ``optimizer.step``) moves on, so the data position and the checkpoints' step
    numbers stay in sync with the batches taken, and the model's other state (dropout
    RNG, batch statistics) moves on as the forward pass moved it.

    After ``max_in_a_row`` skipped steps in a row the next step is accepted whatever
    its values: a loss that stays high is a change of level, not a spike, and the
    statistics follow it. A step whose loss or gradient norm is not finite is no
    spike and is not recorded; ``skip_nonfinite_updates`` is the setting for those.

    Args:
      z: how many standard deviations above the mean is a spike (> 0).
      window: how many accepted steps the statistics cover (>= 2).
      min_steps: accepted steps before any step may be skipped (2 to ``window``;
        default ``min(20, window)``).
      max_in_a_row: skipped steps in a row after which the next is accepted (>= 1).

    Example::

        trainer = Trainer(factory, optax.adamw(3e-4), loss_fn=loss,
                          skip_spikes=SpikeSkip(z=6.0, window=100))
        history = trainer.fit(batches, max_steps=1000)
        history.history["train/skipped_spikes"]   # the count so far, at each log point
    """

    z: float = 6.0
    window: int = 100
    min_steps: int | None = None
    max_in_a_row: int = 10

    def __post_init__(self) -> None:
        def refuse(what: str) -> NoReturn:
            raise ValueError(f"{self!r}: {what}.")

        if isinstance(self.z, bool) or not float(self.z) > 0:
            refuse(f"z={self.z!r} must be a positive number of standard deviations, e.g. 6.0")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 2:
            refuse(f"window={self.window!r} must be an int >= 2, e.g. 100")
        if not 2 <= self.least_steps <= self.window:
            refuse(f"min_steps={self.min_steps!r} must be in [2, window={self.window}]")
        if self.max_in_a_row < 1:
            refuse(f"max_in_a_row={self.max_in_a_row!r} must be >= 1")

    @property
    def least_steps(self) -> int:
        """``min_steps``, its default resolved."""
        return min(20, self.window) if self.min_steps is None else self.min_steps

    def is_spike(self, value: jax.Array, values: jax.Array, seen: jax.Array) -> jax.Array:
        """Whether ``value`` is more than ``z`` standard deviations above the ring ``values``
        (``seen`` of them recorded), once ``min_steps`` are."""
        mean, std = rolling_stats(values, seen)
        std = jnp.maximum(std, 1e-6 * jnp.abs(mean))
        return (seen >= self.least_steps) & (value > mean + self.z * std)

    def wrap(self, inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
        """``inner`` that skips spikes: its ``update`` needs ``value=loss`` (the trainer's
        train step passes it; an overriding ``train_step`` must too)."""
        inner = optax.with_extra_args_support(inner)

        def init(params: optax.Params) -> SpikeState:
            ring = jnp.zeros((self.window,), jnp.float32)
            zero = jnp.zeros((), jnp.int32)
            return SpikeState(inner.init(params), ring, ring, zero, zero, zero)

        def update(
            updates: optax.Updates,
            state: SpikeState,
            params: optax.Params | None = None,
            *,
            value: jax.Array | None = None,
            **extra_args: Any,
        ) -> tuple[optax.Updates, SpikeState]:
            if value is None:
                raise ValueError(
                    "SpikeSkip needs the step's loss: call optimizer.update(model, grads, "
                    "value=loss) in the train step (the default train step does)."
                )
            loss = jnp.asarray(value, jnp.float32)
            grad_norm = optax.tree.norm(updates).astype(jnp.float32)
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            spike = (
                finite
                & (state.in_a_row < self.max_in_a_row)
                & (
                    self.is_spike(loss, state.losses, state.seen)
                    | self.is_spike(grad_norm, state.grad_norms, state.seen)
                )
            )
            new_updates, new_inner = inner.update(
                updates, state.inner, params, value=value, **extra_args
            )
            # Selected, not branched: every device takes the same flag (the loss and the
            # norm are global), and the inner state keeps its old arrays when skipped.
            new_updates = jax.tree.map(
                lambda u: jnp.where(spike, jnp.zeros_like(u), u), new_updates
            )
            new_inner = jax.tree.map(
                lambda new, old: jnp.where(spike, old, new), new_inner, state.inner
            )
            record = finite & ~spike
            at = state.seen % self.window
            return new_updates, SpikeState(
                inner=new_inner,
                losses=jnp.where(record, state.losses.at[at].set(loss), state.losses),
                grad_norms=jnp.where(
                    record, state.grad_norms.at[at].set(grad_norm), state.grad_norms
                ),
                seen=state.seen + record.astype(jnp.int32),
                skipped=state.skipped + spike.astype(jnp.int32),
                in_a_row=jnp.where(spike, state.in_a_row + 1, 0),
            )

        return optax.GradientTransformationExtraArgs(init, update)


def find_spike_state(opt_state: Any) -> SpikeState | None:
    """The ``SpikeState`` inside an optimizer's state, or ``None``."""
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, SpikeState))
        if isinstance(s, SpikeState)
    ]
    return found[0] if found else None


def skipped_spikes(opt_state: Any) -> jax.Array | None:
    """How many steps were skipped as spikes (an on-device scalar), or ``None`` without
    ``SpikeSkip``. Inside a traced step the live state's ``Variable`` is unwrapped."""
    found = find_spike_state(opt_state)
    if found is None:
        return None
    skipped: Any = found.skipped
    return jnp.asarray(skipped.get_value() if hasattr(skipped, "get_value") else skipped)
