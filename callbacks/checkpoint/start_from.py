"""``CheckpointWeights``: a new run started from the model of an earlier run's checkpoint
(``Trainer(init_from=CheckpointWeights("runs/sft"))``, ``--config.init_from=runs/sft``).

The step is found here (the newest finished one of a workdir, of its ``checkpoints/``
directory, or a step directory itself); its model parameters are read by
``step_reader.read_params``, the reader of a resume narrowed to the parameters, each
array straight into the new run's layout (any strategy, any device count).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orbax.checkpoint as ocp
from flax import nnx

from nnx_spmd_trainer.adapters import orbax_private
from nnx_spmd_trainer.weights import Pretrained, WeightMap, param_targets, pretrained_state

from .step_reader import read_params

if TYPE_CHECKING:
    from nnx_spmd_trainer import Plan

#: The folder of a workdir that holds its steps (the CLI's ``<workdir>/checkpoints``).
CHECKPOINTS = "checkpoints"


def newest_step(directory: str | os.PathLike[str]) -> Path:
    """The step directory a run starts from: ``directory`` itself when it is a step
    (``…/<step>``), else the newest finished step of ``directory`` or of its
    ``checkpoints/`` folder. ``ValueError`` in one line when there is none (or the step
    given was not finished)."""
    path = Path(directory).absolute()
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory of checkpoints (nothing there).")
    if path.name.isdigit() and (path / "state").is_dir():
        if not orbax_private.is_committed(path):
            raise ValueError(f"checkpoint step {path} was not finished (no commit marker).")
        return path
    if (path / CHECKPOINTS).is_dir():
        path = path / CHECKPOINTS
    steps = [p for p in path.iterdir() if p.name.isdigit() and orbax_private.is_committed(p)]
    if not steps:
        raise ValueError(
            f"{path} holds no finished checkpoint step: give a run's workdir, its "
            "checkpoints/ folder or one step's directory."
        )
    return max(steps, key=lambda p: int(p.name))


@dataclasses.dataclass(frozen=True)
class CheckpointWeights(Pretrained):
    """The model parameters of a checkpoint step this library wrote, as a run's first
    state: the optimizer's state starts fresh (its count, the step, at 0), and so does
    every other variable the model's initialiser makes (RNG streams; LoRA adapters,
    ``fresh``). A ``weights.Pretrained`` whose source is that step (``source``: a
    workdir, its ``checkpoints/`` folder or one step's directory; the newest finished
    step is read, found when the object is made); no weight map is used.

    The step may have been written under any strategy and device count: each parameter
    is read straight into the new plan's sharding. ``check(plan)`` raises, before a run
    writes anything, ``CheckpointOfAnotherModel`` naming the first parameter the step
    lacks or holds in another shape (from its metadata), or ``DamagedCheckpoint`` for
    parameters that cannot be read or disagree with their fingerprints (read and dropped).

    With ``whole_model=True`` the step's model is read as its run trained it, LoRA
    adapters included (and ``fresh`` unused): every parameter of the plan's model comes
    from the step, and a step lacking one is ``CheckpointOfAnotherModel``. What reads a
    run's model back to evaluate, generate from or score it (``nnx_spmd_trainer.app.
    load_run``), whatever metrics and optimizer the run kept: neither is read.

    Example::

        trainer = Trainer(make_model, optax.adamw(1e-4), strategy=FSDP(),
                          loss_fn=loss, init_from=CheckpointWeights("runs/sft"))
    """

    weight_map: WeightMap = dataclasses.field(default_factory=lambda: WeightMap({}))
    whole_model: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", newest_step(self.source))  # type: ignore[arg-type]

    @property
    def _fresh(self) -> nnx.filterlib.Filter:
        if self.whole_model:  # the run's own model: its adapters are read too
            return nnx.Nothing
        # LoRA adapters are the new run's own, always: a step holding adapters is refused
        # (check_same_params), so the plan's are never read from one.
        return nnx.Any(self.fresh, nnx.LoRAParam)

    @property
    def step(self) -> int:
        """The step read."""
        return int(Path(self.source).name)  # type: ignore[arg-type]

    def check(self, plan: Plan) -> None:
        """Raises what ``state`` would, before a run writes anything:
        ``CheckpointOfAnotherModel`` when the step's parameters are not the plan's model's
        (names, shapes; from the metadata), and ``DamagedCheckpoint`` when they cannot be
        read or disagree with their fingerprints: the parameters are read (straight into
        the plan's layout, nothing else of the step) and dropped."""
        self.params(plan)  # read (read_params checks the names and shapes first); freed

    def params(self, plan: Plan) -> Any:
        """The step's model parameters (``weights.param_targets(plan)``'s structure, less
        ``fresh`` ones), read into the plan's layout and checked against their
        fingerprints; nothing else of the step is read."""
        step_dir = Path(self.source)  # type: ignore[arg-type]
        targets = param_targets(plan, self._fresh)
        with orbax_private.quiet_listing():
            options = ocp.CheckpointManagerOptions(read_only=True, create=False)
            manager = ocp.CheckpointManager(step_dir.parent, options=options)
        try:
            return read_params(manager, self.step, targets)
        finally:
            manager.close()

    def state(self, plan: Plan) -> nnx.State:
        """The plan's whole initial state, with the step's model parameters."""
        return pretrained_state(plan, self.params(plan))
