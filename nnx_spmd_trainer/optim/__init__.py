"""What wraps the optimizer: optax-shaped wrappers of its update, and a guard around the step.

- ``ema.py``: ``EMA``, the weights' average kept in the optimizer's state (``EMA.wrap(tx)``)
- ``spikes.py``: ``SpikeSkip``, a spiking step skipped, its statistics in the optimizer's state
- ``nonfinite.py``: a step whose loss or new parameters are not finite undone, model state too
- ``muon.py``: ``muon``, ``optax.contrib.muon``'s update with Newton-Schulz run once per
  matrix across the mesh (``muon_layout.py``: each matrix moved whole to its owner with one
  ``all_to_all`` and back; ``muon_report.py``: the optimizer's update compiled alone, its
  collectives apart from the model's)
- ``muon_layout.py``: each matrix moved whole to its owner by one ``all_to_all``, and back
- ``muon_report.py``: the optimizer's update compiled alone, its collectives apart

The ``Plan`` wraps the optimizer with the first two (``planner/plan.py``); its train step
calls the third (``planner/step.py``), which is no optax wrapper: it puts back the model's
state (batch statistics) as well as the optimizer's. In the layers (pyproject.toml's
import contracts) the room sits below the planner, beside strategies and data.
"""

from nnx_spmd_trainer.optim.muon import matrix_dimension_numbers, muon

__all__ = ["matrix_dimension_numbers", "muon"]
