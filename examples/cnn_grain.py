"""Image classification: a small CNN trained data-parallel on a Grain input pipeline.

    python examples/cnn_grain.py          # tiny: ~40 steps on 8 simulated CPU devices
    python examples/cnn_grain.py --full   # bigger images, wider net, more steps

The images are synthetic but learnable (a noisy bar whose orientation is the
class), generated with NumPy. ``grain_pipeline`` shuffles, repeats and batches
example indices; ``batch_fn`` gathers each batch of indices into arrays in one
vectorised call. The script checks that the held-out loss fell and the
accuracy beats chance.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import optax  # noqa: E402
from clu import metrics  # noqa: E402

from nnx_spmd_trainer import DataParallel, Trainer  # noqa: E402
from nnx_spmd_trainer.app.datasets.synthetic import make_images  # noqa: E402
from nnx_spmd_trainer.app.models import CNN  # noqa: E402
from nnx_spmd_trainer.app.models.mlp import loss_fn  # noqa: E402  # cross entropy + accuracy
from nnx_spmd_trainer.callbacks import MetricsLogger  # noqa: E402
from nnx_spmd_trainer.data.grain_input import grain_pipeline  # noqa: E402

Metrics = metrics.Collection.create(
    loss=metrics.Average.from_output("loss"), accuracy=metrics.Average.from_output("accuracy")
)


def main(full: bool = False) -> dict[str, float]:
    size, channels, steps, batch = (28, 32, 600, 128) if full else (12, 8, 40, 64)
    num_classes = 4
    images, labels = make_images(4096 if full else 1536, size, num_classes, seed=0)
    train_x, train_y = images[:-512], labels[:-512]
    eval_x, eval_y = images[-512:], labels[-512:]

    trainer = Trainer(
        lambda rngs: CNN(in_channels=1, channels=channels, num_classes=num_classes, rngs=rngs),
        optax.adam(1e-2),
        strategy=DataParallel(),  # the state replicated, each batch split over 8 devices
        loss_fn=loss_fn,
        metrics=Metrics,
        callbacks=[MetricsLogger(log_every_n_steps=10)],
    )
    # This process's rows of each global batch (one process here: all of them).
    shard = trainer.placement.data_shard
    train = grain_pipeline(
        len(train_x),
        batch,
        shard,
        seed=0,
        batch_fn=lambda i: {"inputs": train_x[i], "labels": train_y[i]},
    )
    held_out = grain_pipeline(
        len(eval_x),
        batch,
        shard,
        seed=None,
        repeat=False,
        batch_fn=lambda i: {"inputs": eval_x[i], "labels": eval_y[i]},
    )

    before = trainer.evaluate(held_out)
    trainer.fit(train, max_steps=steps)
    after = trainer.evaluate(held_out)
    print(f"held-out loss {before['loss']:.3f} -> {after['loss']:.3f}, "
          f"accuracy {before['accuracy']:.2f} -> {after['accuracy']:.2f}")  # fmt: skip
    if not after["loss"] < before["loss"] or not after["accuracy"] > 2 / num_classes:
        raise SystemExit(f"FAILED: the CNN did not learn ({before} -> {after})")
    print("OK: cnn_grain: held-out loss fell and accuracy beats chance")
    return after


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="real sizes instead of tiny ones")
    main(parser.parse_args().full)
