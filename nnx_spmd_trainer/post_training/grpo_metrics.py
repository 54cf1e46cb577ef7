"""What a GRPO run logs: the loss of each rollout's first update, the rollout's rewards and
lengths, and the ratio before clipping over its updates under TRL's names."""

# No ``from __future__ import annotations``: clu reads GRPOMetrics' annotations as objects.
import jax
from clu import metrics as clu_metrics
from flax import struct

__all__ = ["GRPOMetrics"]


@struct.dataclass
class GRPOMetrics(clu_metrics.Collection):
    """The loss of each rollout's first update and what the rollout was, averaged over the
    steps between log points (``train/reward``, ``train/ratio_deviation``, ...)."""

    loss: clu_metrics.Average.from_output("loss")  # type: ignore[valid-type]
    reward: clu_metrics.Average.from_output("reward")  # type: ignore[valid-type]
    reward_std: clu_metrics.Average.from_output("reward_std")  # type: ignore[valid-type]
    ratio_deviation: clu_metrics.Average.from_output("ratio_deviation")  # type: ignore[valid-type]
    clip_fraction: clu_metrics.Average.from_output("clip_fraction")  # type: ignore[valid-type]
    kl: clu_metrics.Average.from_output("kl")  # type: ignore[valid-type]
    completion_length: clu_metrics.Average.from_output("completion_length")  # type: ignore[valid-type]
    sampler_gap: clu_metrics.Average.from_output("sampler_gap")  # type: ignore[valid-type]
    ratio_mean: clu_metrics.Average.from_output("ratio/mean")  # type: ignore[valid-type]
    ratio_max: clu_metrics.Average.from_output("ratio/max")  # type: ignore[valid-type]
    clip_ratio_low_mean: clu_metrics.Average.from_output("clip_ratio/low_mean")  # type: ignore[valid-type]
    clip_ratio_high_mean: clu_metrics.Average.from_output("clip_ratio/high_mean")  # type: ignore[valid-type]
    clip_ratio_region_mean: clu_metrics.Average.from_output("clip_ratio/region_mean")  # type: ignore[valid-type]

    def compute(self) -> dict[str, jax.Array]:
        """The averages; the ratio's under TRL's names (``clip_ratio/low_mean``, ...)."""
        return {_METRIC_NAMES.get(k, k): v for k, v in super().compute().items()}


#: GRPOMetrics' fields logged under a name with a slash (TRL's).
_METRIC_NAMES = {
    "ratio_mean": "ratio/mean",
    "ratio_max": "ratio/max",
    "clip_ratio_low_mean": "clip_ratio/low_mean",
    "clip_ratio_high_mean": "clip_ratio/high_mean",
    "clip_ratio_region_mean": "clip_ratio/region_mean",
}
