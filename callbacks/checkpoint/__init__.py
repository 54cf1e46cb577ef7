"""The checkpoint room: ``OrbaxCheckpoint`` and what it is built of.

* ``orbax_checkpoint.py``: ``OrbaxCheckpoint``, the callback: its settings and the hooks
  that decide when to save and restore; it holds the three parts below.
* ``tiers.py``: ``Tiers``, each directory (persistent, local) with its lock and Orbax
  manager; half-deleted steps cleaned, steps set aside.
* ``writer.py``: ``CheckpointWriter``, one step saved into one tier (blocking only while
  the arrays leave the devices), a non-finite save set aside.
* ``resumer.py``: ``CheckpointResumer``, which step to restore (latest, best, a number, a
  directory) across tiers, falling back past damaged ones, and restoring it.
* ``format.py``: what a step holds: the item names, the format ``VERSION`` both sides
  read, the metadata written with each step.
* ``step_reader.py``: one step read into a trainer's layout and checked (or its model
  parameters alone: ``read_params``).
* ``start_from.py``: ``CheckpointWeights``, a new run's first state from an earlier run's
  newest step (its model parameters).
* ``merged_start.py``: ``MergedLoRAWeights``, the same from a LoRA run's step, its adapters
  folded into their kernels.
* ``checks.py``: the checks before a read (model match, data position, damage agreed
  on); ``DamagedCheckpoint``, ``CheckpointOfAnotherModel``.
* ``fingerprint.py``: per-leaf fingerprints computed on the devices, written in the
  background commit.
* ``save_errors.py``: writability checked before a save; ``CheckpointWriteError``.
* ``timer.py``: ``SaveTimer``, saving by process 0's clock; the timing and local-tier
  settings checked.
* ``reports.py``: ``Reports``, each event reported once (``print_fn`` or a warning).

Importing this package changes no global state: Orbax's listing notes are quieted only
while a manager opens (``adapters.orbax_private.quiet_listing``).
"""

from .checks import CheckpointOfAnotherModel, DamagedCheckpoint
from .format import NewerCheckpointFormat
from .merged_start import MergedLoRAWeights
from .orbax_checkpoint import OrbaxCheckpoint
from .resumer import Restore
from .save_errors import CheckpointWriteError
from .start_from import CheckpointWeights

__all__ = [
    "CheckpointOfAnotherModel",
    "CheckpointWeights",
    "CheckpointWriteError",
    "MergedLoRAWeights",
    "DamagedCheckpoint",
    "NewerCheckpointFormat",
    "OrbaxCheckpoint",
    "Restore",
]
