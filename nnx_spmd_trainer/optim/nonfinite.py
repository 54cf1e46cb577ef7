"""Non-finite skipping: a train step whose loss or new parameters are not finite is undone.

``Trainer(..., skip_nonfinite_updates=True)`` (``Plan``'s setting of the same name) makes
the compiled train step keep ``held_state`` as it was before the step and put it back
when the step's loss or new parameters are not finite (``undo_if_not_finite``), as
``optax.apply_if_finite`` does for the optimizer alone. It is not an optax wrapper
because it holds more than the optimizer's state: the model's other state (batch
statistics) written by a NaN forward pass is put back too. What moves on regardless
(``COUNTERS``): the optimizer's step count, so the data position and the checkpoints'
step numbers stay in sync with the batches taken, and the RNG state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

#: What moves on even in a step ``skip_nonfinite`` undoes: the optimizer's step count
#: (the host's copy of it, and so the data position and the checkpoints' step numbers,
#: stay in sync) and the RNG state (the next step draws fresh dropout masks).
COUNTERS = nnx.Any(nnx.RngState, lambda path, _: tuple(path) == ("optimizer", "step"))


def all_finite(arrays: list[jax.Array]) -> jax.Array:
    """One boolean: every element of every floating-point array in ``arrays`` is finite.

    >>> bool(all_finite([jnp.ones(3), jnp.array(2.0)]))
    True
    >>> bool(all_finite([jnp.ones(3), jnp.array([1.0, jnp.nan])]))
    False
    """
    checks = [jnp.isfinite(x).all() for x in arrays if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.stack(checks).all() if checks else jnp.array(True)


def held_state(objects: Any) -> nnx.State:
    """What a skipped step keeps as it was: all of the state but ``COUNTERS`` (and sown
    intermediates, which are not carried): the parameters, the optimizer's moments and its
    own counts (as ``optax.apply_if_finite`` keeps them), the model's other state."""
    return nnx.state(objects, nnx.Not(nnx.Any(COUNTERS, nnx.Intermediate)))


def undo_if_not_finite(
    objects: Any, before: list[jax.Array], loss: jax.Array, wrt: nnx.filterlib.Filter
) -> jax.Array:
    """Puts ``before`` (the ``held_state`` leaves before the step) back into ``objects``
    unless the step's ``loss`` and new ``wrt`` parameters are all finite; returns whether
    they were.

    A ``jnp.where`` per leaf, not a ``lax.cond``: no control flow in the step, and under
    a sharded layout every device selects by the same flag (the check reduces over the
    whole parameters, all their shards).
    """
    finite = all_finite([loss, *jax.tree.leaves(nnx.state(objects["model"], wrt))])
    after, treedef = jax.tree.flatten(held_state(objects))
    kept = [jnp.where(finite, a, b) for a, b in zip(after, before, strict=True)]
    nnx.update(objects, jax.tree.unflatten(treedef, kept))
    return finite
