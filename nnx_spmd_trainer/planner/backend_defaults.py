"""Settings whose best value depends on the backend: measured there, overridable everywhere.

``benchmarks/trainer_overhead.py --variants`` times the trainer with each
setting on and off, interleaved with the hand-written floor; the table holds
what paid on each backend. A backend not in it gets what pays on accelerators:
batches placed by a thread while the devices compute, and the state's buffers
donated to the step (no second copy of the state on the devices).
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

ON_ACCELERATORS = {"prefetch": 2, "donate": True}
MEASURED: dict[str, dict[str, Any]] = {
    # On the CPU the "device" is the host: a placement thread takes a core from the
    # step. benchmarks/results/backend_defaults.md (the MLP, the default job's GPT and a
    # miniGPT-sized model, 2026-11-27): prefetch 2 never beat 0 by more than 1.3% on the GPTs;
    # donation within 0.985-1.06 of none, so it stays on (one copy of the state, not two).
    "cpu": {"prefetch": 0, "donate": True},
}


def backend_default(name: str, mesh: Mesh) -> Any:
    """The measured default of setting ``name`` on the backend of ``mesh``'s devices."""
    platform = mesh.devices.flat[0].platform
    return MEASURED.get(platform, ON_ACCELERATORS)[name]
