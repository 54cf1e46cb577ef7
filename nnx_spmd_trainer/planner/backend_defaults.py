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
    # Donation: within 0.985-1.06 of none there, but 15% slower on the tutorial miniGPT with
    # its 50,257-id vocabulary (issue 56: 1.147 vs 0.970 its own loop). The compiled step
    # shows why (benchmarks/results/minigpt_overhead.md, 2026-12-02): XLA updates the
    # replicated embeddings' Adam moment on halves split over "model" and gathers it into
    # the output; when that buffer is the donated input, XLA first copies the input, a whole
    # [50304, 32] table per device per step (bytes accessed 314.6 MB vs 301.7 MB) with 3x
    # the temporaries (19.7 MB vs 6.4 MB). Whether a model pays that depends on XLA's layout
    # choices; on the CPU the second copy of the state that donation saves is host memory,
    # so it is off there (the user's own jitted loop donates nothing either). Devices keep it.
    "cpu": {"prefetch": 0, "donate": False},
}


def backend_default(name: str, mesh: Mesh) -> Any:
    """The measured default of setting ``name`` on the backend of ``mesh``'s devices."""
    platform = mesh.devices.flat[0].platform
    return MEASURED.get(platform, ON_ACCELERATORS)[name]
