"""The reference model: a frozen copy of the policy's starting weights, laid out as the
policy is, and the compiled program that gives its log-probabilities of a batch.

It is built by ``Trainer.initial_state`` (the run's first state built anew, every leaf
born with the plan's sharding), so its leaves have exactly the policy's specs under any
strategy, and a resumed run rebuilds the same bytes instead of reading them from the
checkpoint. It is never an input of the train step's gradients nor of the optimizer:
its outputs reach the step as batch leaves (``Trainer.prepare_batch``).

With LoRA (``Trainer(..., lora=LoRA(...))``, only the adapters trained), the reference is
the policy's own frozen base: ``ReferenceModel(..., adapters_off=True)`` holds no copy,
and its program reads the live model's arrays with the adapters switched off
(``nn.lora.adapters_off``), so ``bytes_per_device()`` is 0.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_spmd_trainer.nn import lora

#: ``(model, batch) -> outputs``: a forward pass of the reference (``ReferenceModel.run``).
ForwardFn = Callable[[nnx.Module, Any], Any]

if TYPE_CHECKING:
    from nnx_spmd_trainer.trainer import Trainer


def base_is_reference(trainer: Trainer) -> bool:
    """Whether ``trainer``'s own frozen base can be its reference: it has LoRA adapters
    (``lora=``) and trains nothing else, so its base weights are the starting model's
    (``ReferenceModel(..., adapters_off=True)``: no second copy)."""
    if getattr(trainer.plan, "lora", None) is None:
        return False
    others = nnx.state(trainer.model, nnx.All(trainer.plan.wrt, nnx.Not(nnx.LoRAParam)))
    return not jax.tree.leaves(others)


class ReferenceModel:
    """A frozen copy of ``trainer``'s starting model, laid out as its policy; or, with
    ``adapters_off``, the policy's own base, read from the live model (no copy); or
    another ``model`` of the policy's structure, placed in the policy's layout.

    It runs any forward pass, ``run(fn, batch)``, as one compiled program of the
    trainer's plan (``Plan.forward_program``): DPO asks it for the summed
    log-probabilities of a batch of pairs, GRPO for per-token ones.

    Args:
      trainer: the trainer whose plan lays the copy out (``trainer.initial_state()``).
      side_logps: deprecated: ``(model, batch, side) -> [rows]``, read by ``logps``
        only; give the function to ``run`` instead.
      adapters_off: the trainer has LoRA adapters and trains nothing else: the reference is
        its live model computed with the adapters switched off (``nn.lora.adapters_off``),
        the frozen base being the starting model; no second copy of the weights exists.
      model: another model to be the reference (an ``nnx.Module`` with the policy's
        structure and shapes: an SFT model under a policy started elsewhere); its arrays
        are copied into the policy's layout.

    Attributes:
      graphdef, state: the copy (``nnx.split`` of the model); ``state`` leaves carry the
        policy's shardings. With ``adapters_off``, ``state`` is the live model's state,
        read again at each call (the arrays the next step reads).
    """

    #: The batch keys DPO's reference log-probabilities are given under.
    KEYS = ("reference_chosen_logps", "reference_rejected_logps")

    def __init__(
        self,
        trainer: Trainer,
        side_logps: Callable[[nnx.Module, Any, str], jax.Array] | None = None,
        *,
        adapters_off: bool = False,
        model: nnx.Module | None = None,
    ) -> None:
        self.adapters_off = adapters_off
        self._trainer = trainer
        self._copy: nnx.State | None = None
        if adapters_off and model is not None:
            raise ValueError(
                "ReferenceModel: adapters_off=True makes the policy's own base the "
                "reference; a model= reference is another model. Give one of them."
            )
        if adapters_off:
            if not lora.adapted_layers(trainer.model):
                raise ValueError(
                    "ReferenceModel(adapters_off=True) needs a policy with LoRA adapters "
                    "(Trainer(..., lora=LoRA(...))); without them, leave adapters_off unset."
                )
            self.graphdef = nnx.graphdef(trainer.model)
        elif model is not None:
            self.graphdef, self._copy = nnx.graphdef(model), _placed_as_policy(trainer, model)
        else:
            objects = nnx.merge(trainer.plan.graphdef, trainer.initial_state())
            built = objects["model"]
            built.eval()  # no dropout in the reference's log-probabilities
            self.graphdef, self._copy = nnx.split(built)
        self._plan = trainer.plan
        self._side_logps = side_logps

    @property
    def state(self) -> nnx.State:
        """The reference's weights: the copy, or (``adapters_off``) the live model's state."""
        if self._copy is None:
            return nnx.state(self._trainer.model)
        return self._copy

    def bytes_per_device(self) -> int:
        """The bytes of the copy one device holds (its shards of every leaf); 0 with
        ``adapters_off``: the reference holds no weights of its own."""
        if self._copy is None:
            return 0
        return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(self._copy))

    def shardings(self) -> Any:
        """The ``NamedSharding`` of each leaf of ``state``."""
        return jax.tree.map(lambda leaf: leaf.sharding, self.state)

    def program(self, fn: ForwardFn, batch: Any) -> Callable[[nnx.State, Any], Any]:
        """The compiled ``program(state, batch) -> fn(reference, batch)`` for batches like
        ``batch`` (``Plan.forward_program``: compiled once, kept in the plan)."""
        enter = lora.adapters_off if self.adapters_off else None
        return self._plan.forward_program(fn, self.graphdef, self.state, batch, enter=enter)

    def run(self, fn: ForwardFn, batch: Any) -> Any:
        """``fn(reference, batch)`` on a placed ``batch``, in eval mode, as one compiled
        program; its outputs laid out as the plan lays out the batch's rows."""
        state = self.state
        return self.program(fn, batch)(state, batch)

    def logps(self, batch: Any) -> dict[str, jax.Array]:
        """Deprecated (``run``): ``{KEYS[0]: [rows], KEYS[1]: [rows]}`` of a placed batch of
        pairs, by the ``side_logps`` given at construction."""
        side_logps = self._side_logps
        if side_logps is None:
            raise TypeError(
                "ReferenceModel.logps reads the side_logps given at construction; this one "
                "has none: call reference.run(fn, batch) with the forward pass wanted."
            )
        warnings.warn(
            "ReferenceModel.logps and side_logps are deprecated: call "
            "reference.run(fn, batch) (DPOTrainer.reference_logps does).",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.run(_both_sides(side_logps), batch)  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def traced(self, state: nnx.State) -> Iterator[nnx.Module]:
        """Inside a traced program: the reference as a module merged from ``state``, in
        eval mode (the live model's mode stays the user's), with its adapters switched
        off while the block runs when ``adapters_off`` (read where the layers run)."""
        switch = lora.adapters_off if self.adapters_off else contextlib.nullcontext
        with switch():
            model = nnx.merge(self.graphdef, state)
            model.eval()  # no dropout in the reference's log-probabilities
            yield model


_SIDE_FNS: dict[Any, ForwardFn] = {}


def _both_sides(side_logps: Callable[[nnx.Module, Any, str], jax.Array]) -> ForwardFn:
    """One function object per ``side_logps`` (a compiled program is kept per function)."""
    if side_logps not in _SIDE_FNS:

        def both(model: nnx.Module, batch: Any) -> dict[str, jax.Array]:
            sides = (side_logps(model, batch, "chosen"), side_logps(model, batch, "rejected"))
            return dict(zip(ReferenceModel.KEYS, sides, strict=True))

        _SIDE_FNS[side_logps] = both
    return _SIDE_FNS[side_logps]


def _placed_as_policy(trainer: Trainer, model: nnx.Module) -> nnx.State:
    """``model``'s state copied into the layout of ``trainer``'s policy; a ValueError naming
    the first leaf whose path or shape differs."""
    policy = nnx.state(trainer.model)
    mine = nnx.state(model)
    theirs, want = (
        jax.tree_util.tree_flatten_with_path(mine),
        jax.tree_util.tree_flatten_with_path(policy),
    )
    paths = {jax.tree_util.keystr(p): x for p, x in want[0]}
    given = {jax.tree_util.keystr(p): x for p, x in theirs[0]}
    for path in sorted(set(paths) | set(given)):
        a, b = given.get(path), paths.get(path)
        if a is None or b is None or np.shape(a) != np.shape(b):
            raise ValueError(
                f"reference=: the reference model is not laid out as the policy: at {path} "
                f"the reference has {None if a is None else np.shape(a)}, the policy "
                f"{None if b is None else np.shape(b)}. Give a model of the policy's "
                "architecture and sizes."
            )
    shardings = jax.tree.map(lambda leaf: leaf.sharding, policy)
    return jax.tree.map(lambda x, s: jax.device_put(jnp.asarray(x).copy(), s), mine, shardings)
