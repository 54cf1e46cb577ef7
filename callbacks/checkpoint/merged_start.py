"""``MergedLoRAWeights``: a new run started from a LoRA run's step with its adapters
folded into their kernels (``W + scale * A B``): the model that run trained, as a plain
model (``--config.init_from=<a LoRA run> --config.lora.init_from_adapters=merge``).

The step holds each adapted layer's base ``.../kernel`` and its ``.../lora_a``
``[(layers,) *inputs, r]`` and ``.../lora_b`` ``[(layers,) r, *outputs]``
(``nn.lora``'s layout; the kernel ``[(layers,) *inputs, *outputs]``). They are read
with the base, the adapters whole on every device (they are small: rank ``r``), folded
on the devices into the kernel's own layout, and dropped: the new run's model has no
adapters of the old run (its own ``LoRA``, if any, starts afresh over the merged base).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_spmd_trainer import path_str
from nnx_spmd_trainer.adapters import orbax_private
from nnx_spmd_trainer.weights import param_targets, pretrained_state

from .checks import _saved_leaves
from .start_from import CheckpointWeights
from .step_reader import read_params

if TYPE_CHECKING:
    from nnx_spmd_trainer import Plan

#: The names of an ``nn.lora`` layer's adapters, beside its ``kernel``.
_A, _B, _KERNEL = "lora_a", "lora_b", "kernel"


@dataclasses.dataclass(frozen=True)
class MergedLoRAWeights(CheckpointWeights):
    """The model of a LoRA run's newest step (``source``: its workdir, ``checkpoints/`` or
    a step's directory), every adapted kernel folded with its adapters,
    ``W + scale * A B``, as the new run's first state; the optimizer starts fresh.

    ``scale``: the ``alpha / rank`` the step's run trained with (``LoRA.scale``; the step
    does not record it: the CLI reads it from that run's ``config.json``). A step without
    adapters is read as ``CheckpointWeights`` reads it. The folded model computes what
    the adapted one did: the DPO reference of a run started so is the SFT model itself.

    Example::

        trainer = Trainer(make_model, optax.adamw(1e-5), loss_fn=loss,
                          init_from=MergedLoRAWeights("runs/sft_lora", scale=16 / 8))
    """

    scale: float = 1.0

    def check(self, plan: Plan) -> None:
        """Raises what ``state`` would (``CheckpointOfAnotherModel``, ``DamagedCheckpoint``,
        a ``ValueError`` for adapters that do not fit their kernel) before a run writes
        anything: the parameters are read, folded and dropped."""
        self.folded(plan)

    def state(self, plan: Plan) -> nnx.State:
        """The plan's whole initial state, with the step's folded model parameters."""
        return pretrained_state(plan, self.folded(plan))

    def folded(self, plan: Plan) -> nnx.State:
        """The plan's parameters (less its ``fresh`` ones) from the step, each adapted
        kernel folded with the step's adapters, in the plan's layout."""
        step_dir = Path(self.source)  # type: ignore[arg-type]
        base = param_targets(plan, self._fresh)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(base)
        kernels = {path_str(p): leaf for p, leaf in leaves}
        # As a step stores a Variable: {"value": array} (path_str leaves the key out).
        stored = jax.tree.map(lambda leaf: {"value": leaf}, nnx.to_pure_dict(base))
        targets = _with_adapters(stored, kernels, _saved_leaves(step_dir) or {})
        with orbax_private.quiet_listing():
            options = ocp.CheckpointManagerOptions(read_only=True, create=False)
            manager = ocp.CheckpointManager(step_dir.parent, options=options)
        try:
            read = read_params(manager, self.step, targets)
        finally:
            manager.close()
        by_name = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(read)[0]}
        for name in [n for n in by_name if n.endswith(f"/{_A}")]:
            layer = name[: -len(_A) - 1]
            kernel = f"{layer}/{_KERNEL}"
            a, b = by_name.pop(name), by_name.pop(f"{layer}/{_B}")
            by_name[kernel] = _fold(kernel, by_name[kernel], a, b, self.scale)
        return jax.tree.unflatten(treedef, [by_name[path_str(p)] for p, _ in leaves])


def _with_adapters(
    tree: dict[Any, Any], kernels: dict[str, Any], saved: dict[str, tuple[tuple[int, ...], str]]
) -> dict[Any, Any]:
    """``tree`` (the plan's parameter targets, nested) with a target for each adapter the
    step holds beside one of its kernels: whole (replicated) on the kernel's mesh."""
    for name, (shape, dtype) in saved.items():
        if not name.startswith("model/") or not name.endswith(f"/{_A}"):
            continue
        layer = name[len("model/") : -len(_A) - 1]
        kernel = kernels.get(f"{layer}/{_KERNEL}")
        b = saved.get(f"model/{layer}/{_B}")
        if kernel is None or b is None:
            continue  # not beside a kernel of this model: check_same_params names it
        node = _node(tree, layer)
        replicated = NamedSharding(kernel.sharding.mesh, PartitionSpec())
        node[_A] = {"value": jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=replicated)}
        node[_B] = {"value": jax.ShapeDtypeStruct(b[0], jnp.dtype(b[1]), sharding=replicated)}
    return tree


def _node(tree: dict[Any, Any], layer: str) -> dict[Any, Any]:
    """The nested dict of ``layer`` (``"h/0/attn/q"``) in ``tree``, whose keys may be
    integers (a list's index) or strings."""
    node = tree
    for part in layer.split("/"):
        key: Any = part
        if key not in node and part.isdigit() and int(part) in node:
            key = int(part)
        node = node[key]
    return node


def _fold(name: str, kernel: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``kernel + scale * A B`` in float32, cast back, laid out as ``kernel``: ``A``
    ``[*lead, *inputs, r]``, ``B`` ``[*lead, r, *outputs]``, the kernel
    ``[*lead, *inputs, *outputs]``; other shapes are a ``ValueError`` naming the layer."""
    lead = a.ndim + b.ndim - 2 - kernel.ndim
    n_in = a.ndim - 1 - lead
    want = (*a.shape[:-1], *b.shape[lead + 1 :])
    if lead < 0 or n_in < 1 or a.shape[:lead] != b.shape[:lead] or want != kernel.shape:
        raise ValueError(
            f"{name} of shape {kernel.shape} cannot take the adapters beside it (lora_a "
            f"{a.shape}, lora_b {b.shape}): not nn.lora's [*inputs, r] and [r, *outputs]."
        )
    lead_shape, rank = a.shape[:lead], a.shape[-1]
    inputs, outputs = math.prod(a.shape[lead:-1]), math.prod(b.shape[lead + 1 :])

    def fold(w: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
        a2 = a.astype(jnp.float32).reshape(*lead_shape, inputs, rank)
        b2 = b.astype(jnp.float32).reshape(*lead_shape, rank, outputs)
        delta = jnp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST).reshape(w.shape)
        return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)

    return jax.jit(fold, out_shardings=kernel.sharding)(kernel, a, b)
