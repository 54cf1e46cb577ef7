"""Stacked blocks: ``num_layers`` blocks held as one, run by a scan or as a pipeline.

A *stack* is one block whose every array has a leading layer dimension named
``LAYERS`` (``sharding.LAYERS``). ``stacked`` builds it; ``run`` runs it on a
batch. That is all a model does to take part in ``PipelineParallel``:

>>> class Block(nnx.Module):
...     def __init__(self, rngs):
...         self.linear = nnx.Linear(4, 4, rngs=rngs)
...     def __call__(self, x):
...         return x + jax.nn.gelu(self.linear(x))
>>> class Deep(nnx.Module):
...     def __init__(self, rngs, num_layers=4):
...         self.blocks = stacked(Block, num_layers, rngs)  # arrays (4, ...)
...     def __call__(self, x):
...         return run(self.blocks, x)  # a scan; a pipeline under PipelineParallel
>>> with nnx.use_eager_sharding(False):
...     model = Deep(nnx.Rngs(0))
>>> model.blocks.linear.kernel.shape, model(jnp.ones((8, 4))).shape
((4, 4, 4), (8, 4))

Outside ``PipelineParallel`` (and in every other strategy) ``run`` is
``nnx.scan`` over the layers: traced once, the same maths as a loop. Inside a
step traced under ``PipelineParallel`` (its ``trace_context`` installs a
``GPipeSchedule`` here), ``run`` runs the GPipe schedule (``gpipe``).

Blocks whose call writes state (dropout's RNG streams counting up, batch
statistics) cannot be pipelined exactly: each layer runs once per microbatch,
and the bubble's iterations run on filler. ``gpipe`` reads the stack's state
and never writes it back: an active ``nnx.Dropout`` (rate above 0, not
deterministic) or an ``nnx.BatchNorm`` collecting statistics in the blocks is
a ``ValueError`` naming it and the fix (``dropout_rate=0``, ``model.eval()``,
another strategy); blocks in eval mode run. A layer of your own that writes
other state has those writes dropped under a pipeline.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer.deprecation import warn_renamed
from nnx_spmd_trainer.nn.tracing import traced_axes
from nnx_spmd_trainer.sharding import LAYERS

__all__ = [
    "LAYERS",
    "Block",
    "GPipeSchedule",
    "active_pipeline",
    "check_rows",
    "check_stages",
    "gpipe",
    "pipelined",
    "run",
    "run_layers",
    "scan",
    "stacked",
]

#: The block class a stack is built from; ``stacked`` gives one of it back.
Block = TypeVar("Block", bound=nnx.Module)


def stacked(make_block: Callable[[nnx.Rngs], Block], num_layers: int, rngs: nnx.Rngs) -> Block:
    """``num_layers`` blocks as one block whose arrays have a leading layer dimension.

    ``nnx.vmap`` over ``num_layers`` split keys (each layer its own parameters and
    dropout stream); every annotation gains a leading ``LAYERS`` entry, so the
    strategies keep the layer dimension whole (``PipelineParallel`` splits it over
    its stages) and lay out the rest as in one block.
    """

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def build(layer_rngs: nnx.Rngs) -> Block:
        return make_block(layer_rngs)

    return build(rngs)


@nnx.scan(
    in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: LAYERS}
)
def scan(x: jax.Array, block: nnx.Module) -> jax.Array:
    """Runs a stack one layer after another (``nnx.scan``): traced once."""
    return rows_split(block(rows_split(x)))


@nnx.scan(
    in_axes=(nnx.Carry, 0, None),
    out_axes=nnx.Carry,
    transform_metadata={nnx.PARTITION_NAME: LAYERS},
)
def _scan_with(x: jax.Array, block: nnx.Module, side: tuple[jax.Array, ...]) -> jax.Array:
    """``scan`` with per-row inputs every layer reads unchanged (packed rows' segment ids)."""
    return rows_split(block(rows_split(x), *side))


def rows_split(x: jax.Array) -> jax.Array:
    """``x`` (rows first) with its rows split as the step's batch is (``traced_axes
    ("batch")``), the rest left to the compiler; unchanged outside a traced step, and
    where an axis is explicit (its type carries the split already).

    Why: a scan's carry takes one layout for every layer, and XLA otherwise may choose
    the weights' (under FSDP the model dimension on the axis that splits the rows): each
    device then kept every row's activations for the backward pass, 4-5x DataParallel's
    temporaries (GPT, 4 scanned layers, FSDP(8), 8 and 32 rows)."""
    axes = traced_axes("batch")
    mesh = jax.sharding.get_abstract_mesh()
    if not axes or x.ndim == 0 or mesh.empty:
        return x
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    if any(types.get(a) != jax.sharding.AxisType.Auto for a in axes):
        return x
    spec = P(axes if len(axes) > 1 else axes[0], *[P.UNCONSTRAINED] * (x.ndim - 1))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


@dataclasses.dataclass(frozen=True)
class GPipeSchedule:
    """What ``run`` needs to pipeline a stack: the stages, microbatches and their axis
    (``PipelineParallel``'s schedule; named apart from the Grain input pipeline).

    Attributes:
      stages: devices along ``axis``; each holds ``layers / stages`` consecutive layers.
      microbatches: pieces the batch is cut into and streamed through the stages.
      axis: the mesh axis the layer dimension is split over.
      mesh: the mesh the step is traced for.
    """

    stages: int
    microbatches: int
    axis: str
    mesh: Mesh


@dataclasses.dataclass
class _Active:
    pipeline: GPipeSchedule
    ran: bool = False  # whether a stack ran pipelined while it was in force


_active: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("pipeline", default=None)


def active_pipeline() -> GPipeSchedule | None:
    """The pipeline in force (inside ``pipelined``), else ``None``."""
    active = _active.get()
    return None if active is None else active.pipeline


@contextlib.contextmanager
def pipelined(pipeline: GPipeSchedule) -> Iterator[Callable[[], bool]]:
    """``run`` pipelines stacks over ``pipeline`` inside; yields ``ran()``: whether one did."""
    active = _Active(pipeline)
    token = _active.set(active)
    try:
        yield lambda: active.ran
    finally:
        _active.reset(token)


def run(block: nnx.Module, x: jax.Array, *side: jax.Array) -> jax.Array:
    """Runs the stack ``block`` (from ``stacked``) on ``x`` (rows first): ``scan``, or
    ``gpipe`` while a ``GPipeSchedule`` is in force (a step traced under ``PipelineParallel``).

    ``side``: arrays of the same rows every layer reads besides ``x`` (``block(x, *side)``),
    e.g. packed rows' ``segment_ids``; pipelined, they travel with their microbatch.
    """
    active = _active.get()
    if active is None:
        return _scan_with(x, block, side) if side else scan(x, block)
    active.ran = True
    return gpipe(block, x, active.pipeline, *side)


def run_layers(
    layers: nnx.Module | Sequence[nnx.Module], x: jax.Array, *side: jax.Array
) -> jax.Array:
    """Runs a model's blocks on ``x``, held either way a model may hold them: a stack
    (``stacked``) by ``run`` (a scan, or the pipeline), a list of blocks (``nnx.List``)
    one after another. ``side``: arrays every block reads besides ``x`` (``block(x, *side)``).

    A model offering both forms (``scan_layers``) calls this one function for either.

    >>> with nnx.use_eager_sharding(False):
    ...     one_by_one = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(3)])
    >>> run_layers(one_by_one, jnp.ones((2, 4))).shape
    (2, 4)
    """
    if isinstance(layers, Sequence):  # nnx.List is a Sequence; a stack is one Module
        for block in layers:
            x = block(x, *side)
        return x
    return run(layers, x, *side)


def _constrained(x: jax.Array, pipeline: GPipeSchedule, *leading: Any) -> jax.Array:
    """``x`` with dimension 0 on the stage axis, then ``leading``; the rest left to the compiler."""
    rest = [P.UNCONSTRAINED] * (x.ndim - 1 - len(leading))
    spec = P(pipeline.axis, *leading, *rest)
    return jax.lax.with_sharding_constraint(x, NamedSharding(pipeline.mesh, spec))


def check_stages(layers: int, stages: int) -> None:
    """Raises a ``ValueError`` naming the fix unless ``stages`` divides ``layers``."""
    if layers % stages:
        raise ValueError(
            f"PipelineParallel: the stack has {layers} layers, which do not split into "
            f"{stages} stages of equal depth. Use a number of stages dividing {layers} "
            f"(PipelineParallel(stages=n)) or a multiple of {stages} layers."
        )


def check_rows(rows: int, micro: int) -> None:
    """Raises a ``ValueError`` naming the fix unless ``micro`` divides ``rows``."""
    if rows % micro:
        raise ValueError(
            f"PipelineParallel: a batch of {rows} rows does not split into {micro} "
            f"microbatches. Use a batch size divisible by {micro} (per grad_accum_steps "
            "microbatch), or PipelineParallel(microbatches=n) with n dividing it."
        )


def gpipe(block: nnx.Module, x: jax.Array, pipeline: GPipeSchedule, *side: jax.Array) -> jax.Array:
    """The GPipe schedule: ``x`` cut into microbatches streamed through the stages.

    The layer dimension ``[L, ...]`` (split over the stage axis) is read as
    ``[S, L/S, ...]``, a local reshape. A buffer ``[S, rows/M, ...]`` on the
    stage axis holds what each stage works on; each of the ``M + S - 1`` ticks
    runs every stage on its slot at once (``jax.vmap`` of a scan over its
    ``L/S`` layers), then shifts the buffer one stage on (``jnp.roll`` over the
    stage axis, which the compiler lowers to a collective-permute between
    neighbours), feeding the next microbatch into stage 0 and collecting stage
    ``S-1``'s output. Microbatch ``i`` is rows ``i, i+M, i+2M, ...``, so each one
    keeps the rows' split over the data axes. ``side`` arrays (per-row inputs every
    layer reads, ``block(h, *side)``) are cut the same way and shifted with ``h``.
    ``jax.grad`` of this gives the backward schedule. A shifted buffer rather than ``ppermute`` in
    ``shard_map``: the step stays one global program, so the other members'
    layouts (data, FSDP, tensor axes) compose inside each stage unchanged.
    """
    stages, micro = pipeline.stages, pipeline.microbatches
    _refuse_writers(block)
    graphdef, state = nnx.split(block)
    layers = jax.tree.leaves(state)[0].shape[0]
    check_stages(layers, stages)
    check_rows(x.shape[0], micro)

    def staged(a: jax.Array) -> jax.Array:
        return _constrained(a.reshape(stages, layers // stages, *a.shape[1:]), pipeline, None)

    stage_state = jax.tree.map(staged, state)
    rows = x.shape[0] // micro

    def cut(a: jax.Array) -> jax.Array:
        return jnp.swapaxes(a.reshape(rows, micro, *a.shape[1:]), 0, 1)

    microbatches = tuple(cut(a) for a in (x, *side))

    def layer(h: jax.Array, layer_state: nnx.State, with_side: tuple[jax.Array, ...]) -> Any:
        return nnx.merge(graphdef, layer_state)(h, *with_side), None

    def stage(one_stage: nnx.State, h: jax.Array, *with_side: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda a, s: layer(a, s, with_side), h, one_stage)[0]

    every_stage = jax.vmap(stage)

    def tick(buffer: tuple[jax.Array, ...], t: jax.Array) -> tuple[Any, jax.Array]:
        # The last S-1 ticks feed the last microbatch again: filler whose outputs are
        # never collected (real values, so its zero cotangents stay finite).
        index = jnp.minimum(t, micro - 1)
        inputs = tuple(
            _constrained(jnp.where(_first(a), m[index][None], jnp.roll(a, 1, 0)), pipeline)
            for a, m in zip(buffer, microbatches, strict=True)
        )
        out = _constrained(every_stage(stage_state, *inputs), pipeline)
        return (out, *inputs[1:]), out[stages - 1]

    def _first(a: jax.Array) -> jax.Array:
        return (jnp.arange(stages) == 0).reshape(stages, *[1] * (a.ndim - 1))

    empty = tuple(
        _constrained(jnp.zeros((stages, rows, *a.shape[1:]), a.dtype), pipeline) for a in (x, *side)
    )
    _, last = jax.lax.scan(tick, empty, jnp.arange(micro + stages - 1))
    out = last[stages - 1 :]  # microbatch i leaves the last stage at tick i + S - 1
    return jnp.swapaxes(out, 0, 1).reshape(x.shape[0], *out.shape[2:])


def _refuse_writers(block: nnx.Module) -> None:
    """Raises for the layers that write state when called: active dropout (its RNG stream
    counts up) and batch norm collecting statistics."""
    writers = [
        f"{'/'.join(map(str, path))} ({type(module).__name__})"
        for path, module in nnx.iter_modules(block)
        if (isinstance(module, nnx.Dropout) and module.rate > 0 and not module.deterministic)
        or (isinstance(module, nnx.BatchNorm) and not module.use_running_average)
    ]
    if writers:
        raise ValueError(
            f"PipelineParallel: the stacked blocks write state while they run: "
            f"{', '.join(writers)}. A pipelined stack runs each layer once per microbatch "
            "and on filler in the bubble, so such writes have no one-device meaning and "
            "are not kept. Build the blocks with dropout_rate=0 (or call model.eval()), "
            "or train this model with another strategy (FSDP, TensorParallel)."
        )


def __getattr__(name: str) -> Any:
    if name == "Pipeline":  # its 0.1 name, until 0.2.0
        warn_renamed("nnx_spmd_trainer.stack.Pipeline", "nnx_spmd_trainer.stack.GPipeSchedule")
        return GPipeSchedule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
