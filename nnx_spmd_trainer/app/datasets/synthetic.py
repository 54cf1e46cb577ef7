"""Synthetic classification tasks for the MLP and CNN examples: generated, learnable, seeded.

>>> splits = classification_splits(num_features=8, num_classes=4, batch_size=16, seed=0)
>>> sorted(next(iter(splits.train)))
['inputs', 'labels']
"""

from __future__ import annotations

import numpy as np

from nnx_spmd_trainer.app.datasets.base import Splits, index_batches
from nnx_spmd_trainer.app.datasets.text import unigram_baseline

__all__ = ["classification_splits", "image_splits", "make_classification", "make_images"]


def make_classification(
    num_examples: int, num_features: int, num_classes: int, *, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian inputs labelled by a random two-layer teacher network: ``(x float32, y int32)``."""
    rng = np.random.default_rng(seed)
    hidden = 4 * num_classes
    w1 = rng.normal(size=(num_features, hidden)) / np.sqrt(num_features)
    w2 = rng.normal(size=(hidden, num_classes)) / np.sqrt(hidden)
    x = rng.normal(size=(num_examples, num_features)).astype(np.float32)
    labels = np.argmax(np.tanh(x @ w1) @ w2, axis=-1).astype(np.int32)
    return x, labels


def make_images(
    num_examples: int, size: int, num_classes: int, *, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Noisy ``(size, size, 1)`` images of a bar; the class is its orientation.

    Class k draws a line at angle ``pi * k / num_classes`` through a random
    point, so a small convolutional net learns it and a linear model on raw
    pixels struggles.
    """
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, size=num_examples).astype(np.int32)
    angle = np.pi * labels / num_classes
    centre = rng.uniform(size * 0.3, size * 0.7, size=(num_examples, 2))
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float64)
    dy = ys[None] - centre[:, 0, None, None]
    dx = xs[None] - centre[:, 1, None, None]
    # distance of each pixel to the line through the centre at the class angle
    dist = np.abs(dx * np.sin(angle)[:, None, None] - dy * np.cos(angle)[:, None, None])
    images = np.exp(-(dist**2)) + 0.3 * rng.normal(size=dist.shape)
    return images[..., None].astype(np.float32), labels


def _splits(
    x: np.ndarray,
    labels: np.ndarray,
    *,
    num_classes: int,
    num_eval: int,
    batch_size: int,
    seed: int,
    shard: tuple[int, int],
) -> Splits:
    train_x, eval_x = x[:-num_eval], x[-num_eval:]
    train_y, eval_y = labels[:-num_eval], labels[-num_eval:]
    train = index_batches(
        len(train_x),
        batch_size,
        lambda i: {"inputs": train_x[i], "labels": train_y[i]},
        seed=seed,
        repeat=True,
        shard=shard,
    )
    held_out = index_batches(
        len(eval_x), batch_size, lambda i: {"inputs": eval_x[i], "labels": eval_y[i]}, shard=shard
    )
    if len(held_out) == 0:
        raise ValueError(f"{num_eval} held-out examples do not fill one batch of {batch_size}.")
    evaluated = eval_y[: len(held_out) * batch_size * shard[1]]
    baseline = unigram_baseline(train_y, evaluated, vocab_size=num_classes)
    return Splits(train, held_out, baseline, "label-frequency baseline")


def classification_splits(
    *,
    num_features: int,
    num_classes: int,
    batch_size: int,
    seed: int,
    num_examples: int = 8192,
    num_eval: int = 1024,
    shard: tuple[int, int] = (0, 1),
) -> Splits:
    """Batches ``{"inputs": float32 (B, F), "labels": int32 (B,)}`` of the teacher task."""
    x, labels = make_classification(num_examples, num_features, num_classes, seed=seed)
    return _splits(
        x,
        labels,
        num_classes=num_classes,
        num_eval=num_eval,
        batch_size=batch_size,
        seed=seed,
        shard=shard,
    )


def image_splits(
    *,
    image_size: int,
    num_classes: int,
    batch_size: int,
    seed: int,
    num_examples: int = 4096,
    num_eval: int = 512,
    shard: tuple[int, int] = (0, 1),
) -> Splits:
    """Batches ``{"inputs": float32 (B, H, W, 1), "labels": int32 (B,)}`` of bar images."""
    x, labels = make_images(num_examples, image_size, num_classes, seed=seed)
    return _splits(
        x,
        labels,
        num_classes=num_classes,
        num_eval=num_eval,
        batch_size=batch_size,
        seed=seed,
        shard=shard,
    )
