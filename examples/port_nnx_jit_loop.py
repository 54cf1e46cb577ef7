"""Porting a plain ``nnx.jit`` training loop to the ``Trainer``: before and after.

    python examples/port_nnx_jit_loop.py          # tiny: 30 steps
    python examples/port_nnx_jit_loop.py --full   # wider model, more steps

BEFORE is the loop of the Flax / JAX AI Stack tutorials: an ``nnx.Optimizer``,
an ``nnx.MultiMetric``, and ``@nnx.jit def train_step(model, optimizer,
metrics, batch)``, on one device. AFTER is the same model, loss, optimizer and
data on the ``Trainer``, data-parallel over 8 devices. What moves where:

* ``loss_fn`` stays; it returns ``(loss, aux)`` and ``aux`` feeds the metrics;
* ``nnx.Optimizer(model, tx)`` becomes ``Trainer(model_factory, tx)``: the model
  is built inside the mesh, its parameters born sharded;
* ``train_step`` and its ``nnx.jit`` go: the Trainer compiles the step (override
  ``Trainer.train_step`` to change it, see ``sam_train_step.py``);
* ``nnx.MultiMetric`` becomes a ``clu.metrics.Collection``, accumulated on
  the devices and read at the log points (``log_every_n_steps``);
* the ``for`` loop becomes ``fit(batches, max_steps=...)``; callbacks add
  TensorBoard, checkpoints, a progress bar.

The script checks that both reach the same losses (to float32 rounding).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from clu import metrics as clu_metrics  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_spmd_trainer import DataParallel, Trainer  # noqa: E402
from nnx_spmd_trainer.app.datasets.synthetic import make_classification  # noqa: E402

LOG_EVERY = 10


class MLP(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dhidden, rngs=rngs)
        self.linear2 = nnx.Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


def loss_fn(model, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, logits


# ---- BEFORE: the tutorials' loop ---------------------------------------------------------
@nnx.jit
def train_step(model, optimizer, metrics, batch):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


def before(batches, hidden, steps):
    model = MLP(16, hidden, 4, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    history = []
    model.train()
    for step, batch in enumerate(batches[:steps], start=1):
        train_step(model, optimizer, metrics, batch)
        if step % LOG_EVERY == 0:
            history.append(float(metrics.compute()["loss"]))
            metrics.reset()
    return history


# ---- AFTER: the same on the Trainer ------------------------------------------------------
Metrics = clu_metrics.Collection.create(
    loss=clu_metrics.Average.from_output("loss"), accuracy=clu_metrics.Accuracy
)


def trainer_loss_fn(model, batch):
    loss, logits = loss_fn(model, batch)
    return loss, {"logits": logits, "labels": batch["label"]}  # what Accuracy reads


def after(batches, hidden, steps):
    trainer = Trainer(
        lambda rngs: MLP(16, hidden, 4, rngs=rngs),  # seed=0: the same nnx.Rngs(0)
        optax.adamw(1e-2),
        strategy=DataParallel(),
        loss_fn=trainer_loss_fn,
        metrics=Metrics,
        log_every_n_steps=LOG_EVERY,
    )
    return trainer.fit(batches, max_steps=steps).history["train/loss"]


def main(full: bool = False) -> list[float]:
    hidden, steps, batch = (1024, 500, 256) if full else (64, 30, 64)
    x, y = make_classification(steps * batch, 16, 4, seed=0)
    batches = [  # the tutorials' batches: dicts of NumPy arrays
        {"image": x[i : i + batch], "label": y[i : i + batch]} for i in range(0, len(x), batch)
    ]
    with jax.default_device(jax.devices()[0]):
        old = before(batches, hidden, steps)
    new = after(batches, hidden, steps)
    print("loss every", LOG_EVERY, "steps, nnx.jit loop:", np.round(old, 4).tolist())
    print("loss every", LOG_EVERY, "steps, Trainer:     ", np.round(new, 4).tolist())
    # Equal to float32 rounding: the 8 devices sum the batch in another order than one
    # device does, so over hundreds of steps (--full) the runs drift apart slightly.
    drift = float(np.max(np.abs(np.subtract(old, new)) / np.abs(old)))
    print(f"largest relative difference {drift:.1e}")
    if drift > (1e-2 if full else 1e-4) or not new[-1] < new[0]:
        raise SystemExit(f"FAILED: the two loops differ or did not learn: {old} vs {new}")
    print("OK: port_nnx_jit_loop: the nnx.jit loop and the Trainer reach the same losses")
    return new


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="real sizes instead of tiny ones")
    main(parser.parse_args().full)
