"""Small classifiers: the seeds' MLP and a tiny CNN, annotated for tensor parallelism.

Annotations are physical mesh-axis names (``"model"``); an axis the current
mesh lacks replicates that dimension. The hidden sizes and channel counts
that carry ``"model"`` must be divisible by the ``model`` axis size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nnx_spmd_trainer import masked_mean
from nnx_spmd_trainer.app.models.annotations import MODEL, annotated

__all__ = ["CNN", "MLP", "loss_fn"]


class MLP(nnx.Module):
    """The seeds' two-layer MLP: ``(None, "model")`` first kernel, ``("model", None)`` second.

    Each device computes a slice of the hidden layer; the second matmul sums
    the slices (one all-reduce per layer pair, the Megatron layout).

    >>> with nnx.use_eager_sharding(False):  # outside a mesh; the Trainer builds it inside one
    ...     model = MLP(in_features=4, hidden_dim=16, num_classes=3, rngs=nnx.Rngs(0))
    >>> model(jnp.ones((2, 4))).shape
    (2, 3)
    """

    def __init__(
        self,
        in_features: int,
        hidden_dim: int,
        num_classes: int,
        *,
        dropout_rate: float = 0.0,
        rngs: nnx.Rngs,
    ) -> None:
        lecun = nnx.initializers.lecun_normal()
        zeros = nnx.initializers.zeros_init()
        self.fc1 = nnx.Linear(
            in_features,
            hidden_dim,
            kernel_init=annotated(lecun, None, MODEL),
            bias_init=annotated(zeros, MODEL),
            rngs=rngs,
        )
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
        self.fc2 = nnx.Linear(
            hidden_dim, num_classes, kernel_init=annotated(lecun, MODEL, None), rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.dropout(nnx.relu(self.fc1(x))))


class CNN(nnx.Module):
    """Two 3x3 convolutions (output channels split on ``"model"``), global pooling, a head.

    Input images are ``(batch, height, width, channels)``.

    >>> with nnx.use_eager_sharding(False):
    ...     model = CNN(in_channels=1, channels=8, num_classes=4, rngs=nnx.Rngs(0))
    >>> model(jnp.ones((2, 12, 12, 1))).shape
    (2, 4)
    """

    def __init__(
        self, in_channels: int, channels: int, num_classes: int, *, rngs: nnx.Rngs
    ) -> None:
        lecun = nnx.initializers.lecun_normal()
        zeros = nnx.initializers.zeros_init()
        self.conv1 = nnx.Conv(
            in_channels,
            channels,
            (3, 3),
            kernel_init=annotated(lecun, None, None, None, MODEL),
            bias_init=annotated(zeros, MODEL),
            rngs=rngs,
        )
        self.conv2 = nnx.Conv(
            channels,
            2 * channels,
            (3, 3),
            kernel_init=annotated(lecun, None, None, None, MODEL),
            bias_init=annotated(zeros, MODEL),
            rngs=rngs,
        )
        self.head = nnx.Linear(
            2 * channels, num_classes, kernel_init=annotated(lecun, MODEL, None), rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.conv1(x))
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nnx.relu(self.conv2(x))
        return self.head(x.mean(axis=(1, 2)))


def loss_fn(
    model: nnx.Module, batch: dict[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean softmax cross entropy of ``batch["labels"]`` over the real examples (a padded
    batch's ``mask``); ``aux`` holds each example's correctness, averaged by the metrics."""
    logits = model(batch["inputs"]).astype(jnp.float32)
    labels = batch["labels"]
    loss = masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels), batch)
    return loss, {"accuracy": jnp.argmax(logits, axis=-1) == labels}
