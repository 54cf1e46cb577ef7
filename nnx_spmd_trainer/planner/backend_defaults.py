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
    # miniGPT-sized model, 2026-11-27): prefetch 2 never beat 0 by more than 1.3% on the GPTs.
    # Donation stays on (as on accelerators). It was off for a session: the tutorial miniGPT
    # with its 50,257-id vocabulary read 15% slower with it (issue 56). On a quiet machine
    # (2026-12-02, benchmarks/results/minigpt_overhead.md) donation on and off read the same
    # there (1.513 and 1.510 of the tutorial's loop): that gap is the embedding's layout,
    # not donation. And trainer_overhead.py's donating hand-written loops are 1-6% faster
    # than the copying ones (MLP, DataParallel and FSDP(4) x TP(2); trainer_overhead.md).
    "cpu": {"prefetch": 0, "donate": True},
}


def backend_default(name: str, mesh: Mesh) -> Any:
    """The measured default of setting ``name`` on the backend of ``mesh``'s devices."""
    platform = mesh.devices.flat[0].platform
    return MEASURED.get(platform, ON_ACCELERATORS)[name]
