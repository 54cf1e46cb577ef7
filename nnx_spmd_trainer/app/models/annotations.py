"""The sharding annotation the example models use, spelled as the seed documents spell it."""

from flax import nnx

MODEL = "model"


def annotated(init: nnx.Initializer, *spec: str | None) -> nnx.Initializer:
    """``init`` carrying a physical-axis annotation, e.g. ``annotated(xavier, None, MODEL)``.

    ``sharding=`` is the seeds' spelling; flax 0.12 maps it to ``out_sharding``
    (with a DeprecationWarning).
    """
    return nnx.with_metadata(init, sharding=spec)
