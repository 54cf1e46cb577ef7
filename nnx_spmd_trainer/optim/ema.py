"""EMA: an exponential moving average of the weights, kept in the optimizer's state.

``Trainer(..., ema=EMA(decay=0.999))`` wraps the optimizer (``EMA.wrap``) so its state
holds the average beside the inner optimizer's: the average is updated inside the compiled
step (no host sync), is laid out as the parameters are (its leaves carry their parameter's
annotations, as Adam's moments do, so every strategy gives them the parameter's spec), and
is in every checkpoint with the rest of the optimizer's state. ``swapped_in`` (the
trainer's ``ema_weights()``) puts the average into the model for evaluation, prediction
and export, and the trained weights back after.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class EmaState(NamedTuple):
    """``EMA.wrap``'s optimizer state: the inner optimizer's, the count of updates
    averaged, and the average (a tree like the parameters)."""

    inner: optax.OptState
    updates: jax.Array
    ema: optax.Params


@dataclasses.dataclass(frozen=True)
class EMA:
    """An exponential moving average of the trained weights, updated on the devices.

    After each update ``t`` (0 for the first) the average moves toward the new
    parameters ``p``: ``ema = d_t * ema + (1 - d_t) * p``, starting from the initial
    parameters. With ``warmup`` (as TensorFlow's and Keras's ``ExponentialMovingAverage``
    with ``num_updates``), ``d_t = min(decay, (1 + t) / (10 + t))``, so early averages
    are not dominated by the random initial weights; without it ``d_t = decay``. The
    average is computed in float32 and stored in each parameter's dtype. A step the
    trainer skips (``skip_nonfinite_updates``, ``skip_spikes``) does not move it, nor
    its count.

    Args:
      decay: the weight of the old average, in ``[0, 1)``; ``0.999`` averages over
        roughly the last thousand steps.
      warmup: ramp the decay up from 0.1 as above (default ``True``).

    Example::

        trainer = Trainer(factory, optax.adamw(3e-4), loss_fn=loss, ema=EMA(decay=0.999))
        trainer.fit(batches, max_steps=1000)
        with trainer.ema_weights():             # the average in the model, for a while
            print(trainer.evaluate(held_out))
            trainer.export("exported_ema")

    >>> round(EMA(decay=0.99).decay_at(jnp.array(0)).item(), 6)  # the first, with warmup
    0.1
    >>> round(EMA(decay=0.99).decay_at(jnp.array(10_000)).item(), 6)
    0.99
    """

    decay: float = 0.999
    warmup: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.decay, bool) or not 0.0 <= float(self.decay) < 1.0:
            raise ValueError(
                f"EMA(decay={self.decay!r}): the decay must be in [0, 1), e.g. 0.999 to "
                "average over about the last 1000 steps."
            )

    def decay_at(self, count: jax.Array) -> jax.Array:
        """The decay of update number ``count`` (0 for the first), in float32."""
        decay = jnp.float32(self.decay)
        if not self.warmup:
            return decay
        t = count.astype(jnp.float32)
        return jnp.minimum(decay, (1.0 + t) / (10.0 + t))

    def wrap(self, inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
        """``inner`` whose state also keeps this average of the parameters it updates.

        The updates are ``inner``'s, unchanged; ``update`` needs ``params`` (an
        ``nnx.Optimizer`` passes them).
        """
        inner = optax.with_extra_args_support(inner)

        def init(params: optax.Params) -> EmaState:
            # A map over the parameters' Variables keeps their annotations: the
            # average is laid out as the parameters are (see the module docstring).
            average = jax.tree.map(lambda p: p, params)
            return EmaState(inner.init(params), jnp.zeros((), jnp.int32), average)

        def update(
            updates: optax.Updates,
            state: EmaState,
            params: optax.Params | None = None,
            **extra_args: Any,
        ) -> tuple[optax.Updates, EmaState]:
            if params is None:
                raise ValueError(
                    "EMA needs the parameters: call tx.update(grads, state, params) "
                    "(nnx.Optimizer.update passes them)."
                )
            updates, inner_state = inner.update(updates, state.inner, params, **extra_args)
            new_params = optax.apply_updates(params, updates)
            d = self.decay_at(state.updates)

            def step(average: jax.Array, p: jax.Array) -> jax.Array:
                mixed = d * average.astype(jnp.float32) + (1.0 - d) * p.astype(jnp.float32)
                return mixed.astype(average.dtype)

            average = jax.tree.map(step, state.ema, new_params)
            return updates, EmaState(inner_state, state.updates + 1, average)

        return optax.GradientTransformationExtraArgs(init, update)


def find_average(opt_state: Any) -> EmaState | None:
    """The ``EmaState`` inside an optimizer's state (an ``nnx.Optimizer``'s ``opt_state``),
    or ``None`` when its optimizer keeps no average."""
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, EmaState))
        if isinstance(s, EmaState)
    ]
    return found[0] if found else None


@contextlib.contextmanager
def swapped_in(model: nnx.Module, optimizer: nnx.Optimizer[Any]) -> Iterator[None]:
    """Within the block, ``model``'s trained parameters hold ``optimizer``'s average of
    them (``EMA``); on leaving, the trained values are back, as they were.

    The arrays are swapped, not copied: the average's arrays have the parameters'
    shapes, dtypes and shardings, so a compiled evaluation or prediction step runs on
    them as it is, without compiling again. Do not train inside the block: a step
    would train (and donate) the average.
    """
    found = find_average(optimizer.opt_state)
    if found is None:
        raise ValueError(
            "This trainer's optimizer keeps no average of the weights: build it with "
            "Trainer(..., ema=EMA(decay=0.999)) (or optimizer=EMA(...).wrap(tx))."
        )
    # Walked per Variable (not per array) so the raw values can be swapped in place.
    is_variable = lambda x: isinstance(x, nnx.Variable)
    params = jax.tree.leaves(nnx.state(model, optimizer.wrt), is_leaf=is_variable)
    averages = jax.tree.leaves(found.ema, is_leaf=is_variable)
    if len(params) != len(averages):
        raise ValueError(
            f"The optimizer's average holds {len(averages)} arrays and the model "
            f"{len(params)} trained ones: was the model changed after the optimizer was built?"
        )
    trained = [p.get_raw_value() for p in params]
    for p, average in zip(params, averages, strict=True):
        p.set_raw_value(average.get_raw_value())
    try:
        yield
    finally:
        for p, value in zip(params, trained, strict=True):
            p.set_raw_value(value)
