"""Optax's insides that ``optim.muon`` builds on (checked against optax 0.2.8).

``optax.contrib.muon`` is one closed function; the sharded Muon keeps its state and its
arithmetic and changes only where the Newton-Schulz iterations run, so it needs three of
the pieces optax builds it from, which optax does not export:

* ``orthogonalize_via_newton_schulz(x, ns_coeffs, ns_steps, preconditioning, eps,
  dimension_numbers)``: the iterations themselves, vmapped over a leaf's batch axes;
* ``scale_by_shape(weight_dimension_numbers, consistent_rms)``: the learning-rate scale
  by a matrix's shape;
* ``NS_COEFFS_PRESETS``: the named coefficient sets (``"standard"``, ``"dion"``).
"""

from __future__ import annotations

from optax.contrib import _muon

orthogonalize_via_newton_schulz = _muon.orthogonalize_via_newton_schulz
scale_by_shape = _muon.scale_by_shape
NS_COEFFS_PRESETS = _muon._NS_COEFFS_PRESET_DICT
