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
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx

from nnx_spmd_trainer.nn import lora

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
    ``adapters_off``, the policy's own base, read from the live model (no copy).

    Args:
      trainer: the trainer whose plan lays the copy out (``trainer.initial_state()``).
      side_logps: ``(model, batch, side) -> [rows]``: a model's summed log-probabilities of
        one side (``"chosen"``, ``"rejected"``) of a batch of pairs.
      adapters_off: the trainer has LoRA adapters and trains nothing else: the reference is
        its live model computed with the adapters switched off (``nn.lora.adapters_off``),
        the frozen base being the starting model; no second copy of the weights exists.

    Attributes:
      graphdef, state: the copy (``nnx.split`` of the model); ``state`` leaves carry the
        policy's shardings. With ``adapters_off``, ``state`` is the live model's state,
        read again at each call (the arrays the next step reads).
    """

    #: The batch keys the reference's log-probabilities are given under.
    KEYS = ("reference_chosen_logps", "reference_rejected_logps")

    def __init__(
        self,
        trainer: Trainer,
        side_logps: Callable[[nnx.Module, Any, str], jax.Array],
        *,
        adapters_off: bool = False,
    ) -> None:
        self.adapters_off = adapters_off
        self._trainer = trainer
        self._copy: nnx.State | None = None
        if adapters_off:
            if not lora.adapted_layers(trainer.model):
                raise ValueError(
                    "ReferenceModel(adapters_off=True) needs a policy with LoRA adapters "
                    "(Trainer(..., lora=LoRA(...))); without them, leave adapters_off unset."
                )
            self.graphdef = nnx.graphdef(trainer.model)
        else:
            objects = nnx.merge(trainer.plan.graphdef, trainer.initial_state())
            model = objects["model"]
            model.eval()  # no dropout in the reference's log-probabilities
            self.graphdef, self._copy = nnx.split(model)
        self._plan = trainer.plan
        self._side_logps = side_logps
        self._programs: dict[Any, Callable[..., Any]] = {}

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

    def logps(self, batch: Any) -> dict[str, jax.Array]:
        """``{KEYS[0]: [rows], KEYS[1]: [rows]}`` of a placed batch of pairs, laid out as
        the plan lays out those leaves of the batch; one compiled program per batch
        structure and shapes."""
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
        key = (jax.tree.structure(batch), tuple(x.shape for x in jax.tree.leaves(abstract)))
        if key not in self._programs:
            self._programs[key] = self._compile(abstract)
        program = self._programs[key]
        return program(self.state, batch)  # type: ignore[no-any-return]

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

    def _compile(self, abstract: Any) -> Callable[..., Any]:
        plan, side_logps = self._plan, self._side_logps
        rows = jax.tree.leaves(abstract)[0].shape[0]
        out = {k: jax.ShapeDtypeStruct((rows,), np.float32) for k in self.KEYS}
        batch_shardings = plan.batch_shardings(abstract)
        out_shardings = {k: plan.batch_shardings({**abstract, **out})[k] for k in self.KEYS}

        def program(state: nnx.State, batch: Any) -> dict[str, jax.Array]:
            with plan.trace_context(batch_shardings), self.traced(state) as model:
                chosen = side_logps(model, batch, "chosen")
                rejected = side_logps(model, batch, "rejected")
            return dict(zip(self.KEYS, (chosen, rejected), strict=True))

        return plan.compile_program(
            program,
            in_shardings=(self.shardings(), batch_shardings),
            out_shardings=out_shardings,
        )
