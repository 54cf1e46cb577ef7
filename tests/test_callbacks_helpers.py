"""Shared pieces of the callback tests: a linear classifier, data, and NumPy references.

The model is small on purpose: every test here builds a real Trainer on the 8
simulated devices and compiles its step, and the machine has two cores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import optax
from clu import metrics as clu_metrics
from flax import nnx

from nnx_spmd_trainer import Callback, Trainer

DIN, CLASSES, BATCH = 4, 3, 16  # BATCH: two rows per simulated device

Metrics = clu_metrics.Collection.create(
    loss=clu_metrics.Average.from_output("loss"), accuracy=clu_metrics.Accuracy
)


class Linear(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l = nnx.Linear(DIN, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.l(x)


def loss_fn(model, batch):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    # `scale` lets a test poison one batch with NaN at a known step.
    if "scale" in batch:
        loss = loss * batch["scale"].mean()
    return loss, {"logits": logits, "labels": batch["y"]}


def make_batches(
    n: int, *, seed: int = 0, nan_at: int | None = None
) -> list[dict[str, np.ndarray]]:
    """``n`` batches of ``BATCH`` rows; batch ``nan_at`` (0-based) carries a NaN scale."""
    rng = np.random.default_rng(seed)
    batches = []
    for i in range(n):
        batch = {
            "x": rng.normal(size=(BATCH, DIN)).astype(np.float32),
            "y": rng.integers(0, CLASSES, size=(BATCH,)).astype(np.int32),
        }
        if nan_at is not None:
            batch["scale"] = np.full((BATCH,), np.nan if i == nan_at else 1.0, np.float32)
        batches.append(batch)
    return batches


def make_trainer(
    callbacks: Sequence[Callback] = (),
    tx: optax.GradientTransformation | None = None,
    *,
    trainer_cls: type[Trainer] = Trainer,
    **kwargs: Any,
) -> Trainer:
    kwargs.setdefault("metrics", Metrics)
    return trainer_cls(
        lambda rngs: Linear(rngs),
        tx if tx is not None else optax.sgd(0.1),
        loss_fn=loss_fn,
        callbacks=callbacks,
        **kwargs,
    )


def params_np(trainer: Trainer) -> tuple[np.ndarray, np.ndarray]:
    """(kernel, bias) of the live model as float64 NumPy arrays."""
    layer = trainer.model.l
    return np.asarray(layer.kernel[...], np.float64), np.asarray(layer.bias[...], np.float64)


def np_logits(kernel: np.ndarray, bias: np.ndarray, x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) @ kernel + bias


def np_cross_entropy(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-example softmax cross-entropy, computed in float64."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=1))
    return log_z - shifted[np.arange(len(y)), y]


def np_metrics(kernel: np.ndarray, bias: np.ndarray, batches: Sequence[dict]) -> dict[str, float]:
    """What the Metrics collection must report over ``batches`` for fixed weights.

    ``Average.from_output("loss")`` averages the per-step mean losses;
    ``Accuracy`` averages over every example.
    """
    losses, correct = [], []
    for batch in batches:
        logits = np_logits(kernel, bias, batch["x"])
        losses.append(np_cross_entropy(logits, batch["y"]).mean())
        correct.append(logits.argmax(axis=1) == batch["y"])
    return {"loss": float(np.mean(losses)), "accuracy": float(np.concatenate(correct).mean())}


def np_sgd(kernel: np.ndarray, bias: np.ndarray, batches: Sequence[dict], lr: float):
    """Plain NumPy SGD on mean cross-entropy; yields (kernel, bias) after each step."""
    for batch in batches:
        logits = np_logits(kernel, bias, batch["x"])
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        probs[np.arange(len(batch["y"])), batch["y"]] -= 1.0
        delta = probs / len(batch["y"])
        kernel = kernel - lr * batch["x"].astype(np.float64).T @ delta
        bias = bias - lr * delta.sum(axis=0)
        yield kernel, bias
