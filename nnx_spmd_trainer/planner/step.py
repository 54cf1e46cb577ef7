"""Pure step builders: loss, gradients, accumulation, on-device metrics.

The steps are functions of split state (``nnx.split``) so they are jitted with
plain ``jax.jit``: ``nnx.merge`` runs once at trace time, not per call. The
model's mode is set on the merged copy inside the trace (train for the train
step, eval for the eval step), so the live module is never flipped.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from clu import metrics as clu_metrics
from flax import nnx

from nnx_spmd_trainer.data.batch_reads import refuse_unread, tracked
from nnx_spmd_trainer.optim import spikes
from nnx_spmd_trainer.optim.nonfinite import held_state, undo_if_not_finite
from nnx_spmd_trainer.planner.microbatch import join_microbatches, microbatches, rows_sharding

LossFn = Callable[[nnx.Module, Any], tuple[jax.Array, dict[str, jax.Array]]]
Batch = Any

#: The ``aux`` key under which a loss reports the total weight of the targets its loss is
#: the mean over (a scalar: the number of trained tokens, or the sum of their weights).
#: Gradient accumulation weights each microbatch by it, so the step's loss and gradients
#: are the mean over the whole batch's trained tokens, whatever the split
#: (docs/topics/packing.md, "The token mean").
TOKEN_WEIGHT = "token_weight"


def checked_loss(output: Any, name: str = "loss_fn") -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(loss, aux)`` as the step needs it, or a TypeError saying what came back instead.

    Runs while jax traces the step, so a wrong return is reported before any
    state is donated.
    """
    if not isinstance(output, tuple) or len(output) != 2:
        # An array is described by its type (its repr while traced names jax's tracers).
        shape = getattr(output, "shape", None)
        got = (
            f"an array {getattr(output, 'dtype', '')}{list(shape)}" if shape is not None
            else f"{type(output).__name__} {output!r:.120}"
        )  # fmt: skip
        fix = " (return loss, {})" if shape == () else ""
        raise TypeError(
            f"{name} must return (loss, aux): a scalar loss and a dict of arrays for the "
            f"metrics (use {{}} for none); it returned {got}{fix}."
        )
    loss, aux = output
    if not isinstance(aux, dict):
        raise TypeError(
            f"{name} must return (loss, aux) with aux a dict of arrays; aux is {aux!r:.120}."
        )
    if getattr(loss, "shape", None) != ():
        raise TypeError(
            f"{name} must return a scalar loss; it has shape {getattr(loss, 'shape', None)}. "
            "Reduce it over the batch, e.g. losses.mean()."
        )
    return loss, aux


def batch_mask(batch: Batch) -> jax.Array:
    """Which rows of ``batch`` are real examples: its ``"mask"`` (padding is 0), or all ones."""
    if isinstance(batch, Mapping) and "mask" in batch:
        return jnp.asarray(batch["mask"])
    return jnp.ones(jax.tree.leaves(batch)[0].shape[:1], jnp.float32)


def masked_mean(values: jax.Array, batch: Batch) -> jax.Array:
    """The mean of per-example ``values`` (leading dimension: the batch rows) over the
    batch's real examples, leaving out the rows ``batch["mask"]`` marks as padding.

    Use it in a ``loss_fn`` so a padded batch (an eval set's last one, or
    ``Trainer.padded``) gives the loss of its real examples alone.
    """
    mask = batch_mask(batch).astype(bool)
    mask = mask.reshape(mask.shape + (1,) * (values.ndim - mask.ndim))
    mask = jnp.broadcast_to(mask, values.shape)
    total = jnp.where(mask, values, 0).sum(dtype=jnp.float32)
    return total / jnp.maximum(mask.sum(), 1)


def _as_fp32(x: Any) -> Any:
    """Floats (bf16 included) and booleans (per-example correctness) as fp32; others as given."""
    x = jnp.asarray(x)
    averaged = jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.bool_
    return x.astype(jnp.float32) if averaged else x


def _merge_metrics(
    metrics: clu_metrics.Collection, loss: jax.Array, aux: dict[str, jax.Array], batch: Batch
) -> clu_metrics.Collection:
    """Adds one batch to the metrics, weighted by its real examples.

    The loss is fed once per example row (and ``mask`` with it), so an average
    over steps is the per-example average whatever the batch sizes; per-example
    ``aux`` values are masked by CLU through the same ``mask``. A scalar ``aux``
    value is a value of the whole batch, as the loss is, and is fed the same way:
    once per row, masked (so CLU's ``from_output`` metrics never drop the mask
    and warn). Accumulated in fp32.
    """
    mask = batch_mask(batch)

    def per_row(x: Any) -> jax.Array:
        x = _as_fp32(x)
        return jnp.broadcast_to(x, mask.shape[:1]) if x.ndim == 0 else x

    outputs = {"mask": mask, **jax.tree.map(per_row, aux)}
    outputs["loss"] = per_row(loss)
    return metrics.merge(type(metrics).single_from_model_output(**outputs))


def _microbatch_weight(aux: dict[str, jax.Array], microbatch: Batch, masked: bool) -> Any:
    """What one microbatch counts for in the batch's mean: its trained tokens' weight when
    the loss reports it (``TOKEN_WEIGHT``), else its real examples when the batch has a
    ``"mask"``, else 1 (the microbatches equally)."""
    if TOKEN_WEIGHT in aux:
        return jnp.asarray(aux[TOKEN_WEIGHT], jnp.float32)
    return batch_mask(microbatch).sum(dtype=jnp.float32) if masked else 1.0


def compute_gradients(
    model: nnx.Module,
    batch: Batch,
    loss_fn: LossFn,
    *,
    wrt: nnx.filterlib.Filter = nnx.Param,
    grad_accum_steps: int = 1,
    batch_sharding: Any = None,
    checkpoint: Callable[..., Any] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array], nnx.State]:
    """``(loss, aux, grads)`` of ``loss_fn`` on ``batch``, gradients for the ``wrt`` variables.

    Inside a traced step. The model's other state (dropout RNG counts, batch
    statistics) is updated in place. With ``grad_accum_steps=k`` the batch is
    cut into k microbatches scanned in one compiled step (no data moves: row
    ``r * k + j`` goes to microbatch ``j``); gradients and losses are averaged,
    so they equal one pass over the whole batch when the loss is a mean over
    examples (weighted by each microbatch's real examples when the batch has a
    ``"mask"``).

    The token mean: a loss that is a mean over weighted targets (packed rows, chat
    rows' ``loss_weights``) reports the total weight it averaged over as
    ``aux[TOKEN_WEIGHT]`` (``"token_weight"``; the shipped GPT losses do). Each
    microbatch then counts by that weight, and the step's loss and gradients are the
    mean over the whole batch's trained tokens, the same for any ``grad_accum_steps``
    (not a mean of the microbatches' means, which would change with the split). A
    loss of one's own takes part by returning ``{TOKEN_WEIGHT: weights.sum(), ...}``
    beside ``(losses * weights).sum() / weights.sum()``; the returned ``aux`` then
    holds the whole batch's weight under that key.

    While jax traces it, ``loss_fn`` is handed the batch (a ``dict``) as a
    ``data.batch_reads.ReadBatch``: a key it reads and the batch lacks names the keys
    the batch has, and a packing field (``segment_ids``, ``positions``, Grain's
    ``*_segment_ids``...) it never reads is refused, never trained as if unpacked.

    ``aux`` comes back shaped as one pass over the whole batch would give it
    (``join_microbatches``): a per-example value (leading dimension: the
    microbatch's rows) has its rows put back in the batch's order, so the
    batch's ``"mask"`` leaves out exactly the padding rows; any other value (a
    scalar, such as an accuracy the ``loss_fn`` already averaged) is averaged
    over the microbatches with the loss's weights, so it stays a scalar and
    equals the whole batch's value when it is a mean over the real examples.
    The metrics then count a scalar once per real example, as they count the
    loss (``_merge_metrics``).

    With ``checkpoint`` (a ``jax.checkpoint`` policy: ``remat.checkpoint_policy``)
    the forward pass of each microbatch keeps only what the policy saves and
    recomputes the rest in the backward pass; ``None``: no checkpointing.
    """
    model_def, params, rest = nnx.split(model, wrt, ...)  # type: ignore[misc]
    # What a forward pass sows (nnx.Intermediate) is the loss's to read, not carried state.
    carried = nnx.Not(nnx.Any(wrt, nnx.Intermediate))

    def compute(params: nnx.State, rest: nnx.State, batch: Batch) -> Any:
        module = nnx.merge(model_def, params, rest, copy=True)  # fresh vars: dropout mutates
        batch = tracked(batch, "loss_fn")
        loss, aux = checked_loss(loss_fn(module, batch))
        refuse_unread(batch)
        return loss, (aux, nnx.state(module, carried))

    if checkpoint is not None:
        # A scan body (accumulation) already keeps XLA from merging the recomputation
        # back into the forward pass; JAX's own guard against that is then a cost.
        compute = jax.checkpoint(compute, policy=checkpoint, prevent_cse=grad_accum_steps == 1)
    grad_fn = jax.value_and_grad(compute, has_aux=True)
    if grad_accum_steps == 1:
        (loss, (aux, rest)), grads = grad_fn(params, rest, batch)
    else:
        masked = isinstance(batch, Mapping) and "mask" in batch

        def accumulate(carry: Any, microbatch: Batch) -> tuple[Any, Any]:
            grad_sum, rest, loss_sum, weight_sum = carry
            (loss, (aux, rest)), grads = grad_fn(params, rest, microbatch)
            weight = _microbatch_weight(aux, microbatch, masked)
            grad_sum = jax.tree.map(lambda s, g: (s + g * weight).astype(s.dtype), grad_sum, grads)
            carry = (grad_sum, rest, loss_sum + loss * weight, weight_sum + weight)
            return carry, (aux, jnp.asarray(weight, jnp.float32))

        zeros = jax.tree.map(jnp.zeros_like, params)
        init = (zeros, rest, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
        mbs = microbatches(batch, grad_accum_steps, batch_sharding)
        (grads, rest, loss, weight), (auxes, weights) = jax.lax.scan(accumulate, init, mbs)
        token_weighted = TOKEN_WEIGHT in auxes
        weighted = masked or token_weighted
        # No trained token (or real row) at all: every microbatch added 0; divide by 1.
        total: Any = jnp.where(weight > 0, weight, 1.0) if weighted else grad_accum_steps
        grads = jax.tree.map(lambda g: (g / total).astype(g.dtype), grads)
        loss = loss / total
        rows = jax.tree.leaves(batch)[0].shape[0]
        auxes = {name: value for name, value in auxes.items() if name != TOKEN_WEIGHT}
        aux = join_microbatches(auxes, weights / total, rows, rows_sharding(batch_sharding))
        if token_weighted:
            aux[TOKEN_WEIGHT] = weight  # the whole batch's, as one pass would report it
    nnx.update(model, rest)
    return loss, aux, grads


TrainStepFn = Callable[[nnx.Module, nnx.Optimizer[Any], Batch], tuple[jax.Array, dict[str, Any]]]


def global_norm(leaves: list[jax.Array]) -> jax.Array:
    """The fp32 L2 norm of all ``leaves`` together."""
    squares = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves]
    return jnp.sqrt(sum(squares, jnp.zeros((), jnp.float32)))


def make_train_step(
    graphdef: nnx.GraphDef[Any],
    train_step_fn: TrainStepFn,
    *,
    wrt: nnx.filterlib.Filter = nnx.Param,
    norms: bool = True,
    skip_nonfinite: bool = False,
) -> Callable[..., tuple[nnx.State, clu_metrics.Collection, jax.Array, dict[str, jax.Array]]]:
    """``(state, metrics, batch) -> (state, metrics, loss, norms)`` over
    ``{"model", "optimizer"}`` state.

    ``train_step_fn(model, optimizer, batch) -> (loss, aux)`` does the work on
    the merged objects (``Trainer.train_step``); the metrics are fed its
    ``loss`` and ``aux``. With ``norms``, ``norms`` holds the global norms of
    the ``wrt`` parameters after the step, of the step's change to them, and
    ``aux["grad_norm"]`` when the step returns it; they stay on the devices. With a
    ``SpikeSkip`` optimizer, every step's ``norms`` also holds ``skipped_spikes``.
    With ``skip_nonfinite``, a step whose loss or new parameters are not finite
    changes nothing but ``nonfinite.COUNTERS`` (``undo_if_not_finite``); its loss and
    metrics are still reported, so ``TerminateOnNaN`` and the logs see it.
    """

    def train_step(
        state: nnx.State, metrics: clu_metrics.Collection, batch: Batch
    ) -> tuple[nnx.State, clu_metrics.Collection, jax.Array, dict[str, jax.Array]]:
        objects = nnx.merge(graphdef, state)
        model, optimizer = objects["model"], objects["optimizer"]
        model.train()
        before = jax.tree.leaves(nnx.state(model, wrt))
        held = jax.tree.leaves(held_state(objects)) if skip_nonfinite else []
        loss, aux = checked_loss(train_step_fn(model, optimizer, batch), "train_step")
        if skip_nonfinite:
            undo_if_not_finite(objects, held, loss, wrt)
        found: dict[str, jax.Array] = {}
        if (skipped := spikes.skipped_spikes(optimizer.opt_state)) is not None:
            found["skipped_spikes"] = skipped  # every step: the count at a log point
        if norms:
            after = jax.tree.leaves(nnx.state(model, wrt))
            found["param_norm"] = global_norm(after)
            found["update_norm"] = global_norm([a - b for a, b in zip(after, before, strict=True)])
            if "grad_norm" in aux:
                found["grad_norm"] = _as_fp32(aux["grad_norm"])
        # Sown intermediates are not carried: the state keeps its structure step to step.
        carried = nnx.state(objects, nnx.Not(nnx.Intermediate))
        return carried, _merge_metrics(metrics, loss, aux, batch), loss, found

    return train_step


def make_eval_step(
    graphdef: nnx.GraphDef[Any], eval_fn: LossFn
) -> Callable[..., clu_metrics.Collection]:
    """``(state, metrics, batch) -> metrics``; the state is read, not changed."""

    def eval_step(
        state: nnx.State, metrics: clu_metrics.Collection, batch: Batch
    ) -> clu_metrics.Collection:
        model = nnx.merge(graphdef, state)["model"]
        model.eval()
        read = tracked(batch, "eval_fn")
        loss, aux = checked_loss(eval_fn(model, read), "eval_fn")
        refuse_unread(read)
        return _merge_metrics(metrics, loss, aux, batch)

    return eval_step


def make_predict_step(
    graphdef: nnx.GraphDef[Any], predict_fn: Callable[[nnx.Module, Batch], Any]
) -> Callable[..., Any]:
    """``(state, None, batch) -> outputs`` of ``predict_fn(model, batch)`` in eval mode;
    the unused second argument keeps the eval step's calling convention."""

    def predict_step(state: nnx.State, unused: None, batch: Batch) -> Any:
        del unused
        model = nnx.merge(graphdef, state)["model"]
        model.eval()
        return predict_fn(model, batch)

    return predict_step


def over_flat_state(
    step_fn: Callable[..., Any], treedef: Any, *, returns_state: bool
) -> Callable[..., Any]:
    """``step_fn(state, ...)`` as a function of the state's flat list of arrays.

    The trainer keeps the state in live Variables and hands the step their
    arrays: a flat list crosses the jit boundary without walking Variables in
    Python. With ``returns_state``, ``(state, *rest)`` comes back as ``(arrays, *rest)``.
    """

    def flat_step(arrays: list[jax.Array], *args: Any) -> Any:
        out = step_fn(jax.tree.unflatten(treedef, arrays), *args)
        return (jax.tree.leaves(out[0]), *out[1:]) if returns_state else out

    return flat_step


def traced_within(
    step_fn: Callable[..., Any], context: Callable[[], contextlib.AbstractContextManager[Any]]
) -> Callable[..., Any]:
    """``step_fn`` that runs inside ``context()``: entered while jax traces it
    (``Plan.trace_context``: the strategy's logical rules for activation constraints)."""

    @functools.wraps(step_fn)
    def within(*args: Any) -> Any:
        with context():
            return step_fn(*args)

    return within


def apply_gradients(
    model: nnx.Module,
    optimizer: nnx.Optimizer[Any],
    loss: jax.Array,
    aux: dict[str, jax.Array],
    grads: nnx.State,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The default second half of a train step: one update, and the gradients' norm in
    ``aux`` (XLA drops it from the steps that do not report it)."""
    optimizer.update(model, grads, value=loss)  # value: plateau schedules, line searches
    return loss, {**aux, "grad_norm": optax.tree.norm(grads)}
