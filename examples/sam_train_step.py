"""A custom ``train_step`` with gradients in hand: sharpness-aware minimization (SAM).

    python examples/sam_train_step.py          # tiny: 40 steps on 8 simulated CPU devices
    python examples/sam_train_step.py --full   # wider model, more steps

SAM (Foret et al., 2021) takes the gradient at the worst point of a small ball
around the weights: it climbs ``rho * g / |g|`` from the weights, takes the
gradient there, steps back and updates with that gradient. A ``Trainer``
subclass writes it by overriding ``train_step``: ``compute_gradients`` gives
``(loss, aux, grads)`` with respect to the trained parameters (gradient
accumulation included) and ``optimizer.update`` applies any gradients. The
whole step stays one compiled, sharded step (here FSDP x tensor parallel).
The script checks that the loss fell and that the step is not the plain one.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_spmd_trainer import FSDP, Hybrid, TensorParallel, Trainer  # noqa: E402
from nnx_spmd_trainer.app.datasets.synthetic import make_classification  # noqa: E402
from nnx_spmd_trainer.app.models import MLP  # noqa: E402
from nnx_spmd_trainer.app.models.mlp import loss_fn  # noqa: E402
from nnx_spmd_trainer.callbacks import MetricsLogger  # noqa: E402
from nnx_spmd_trainer.data.grain_input import grain_pipeline  # noqa: E402


class SAMTrainer(Trainer):
    def __init__(self, *args, rho: float = 0.05, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rho = rho

    def loss_fn(self, model, batch):
        return loss_fn(model, batch)

    def train_step(self, model, optimizer, batch):
        loss, aux, grads = self.compute_gradients(model, batch)
        # Climb to the sharpest nearby point: w + rho * g / |g|.
        weights = nnx.state(model, nnx.Param)  # holds the model's variables: copy the values
        saved = jax.tree.map(jnp.copy, weights)
        scale = self.rho / (optax.tree.norm(grads) + 1e-12)
        nnx.update(model, jax.tree.map(lambda w, g: w + scale * g, weights, grads))
        # The gradient there, then back to w and update w with it.
        _, _, sharp_grads = self.compute_gradients(model, batch)
        nnx.update(model, saved)
        optimizer.update(model, sharp_grads, value=loss)
        return loss, {**aux, "grad_norm": optax.tree.norm(sharp_grads)}  # logged: train/grad_norm


def main(full: bool = False) -> float:
    hidden, steps, batch = (512, 500, 256) if full else (64, 40, 64)
    x, y = make_classification(8192, 16, 4, seed=0)
    data = grain_pipeline(
        len(x), batch, seed=0, batch_fn=lambda i: {"inputs": x[i], "labels": y[i]}
    )

    def train(trainer_class, **kwargs):
        trainer = trainer_class(
            lambda rngs: MLP(16, hidden, 4, rngs=rngs),
            optax.sgd(0.1, momentum=0.9),
            strategy=Hybrid(FSDP(4, min_size=1), TensorParallel(2)),
            callbacks=[MetricsLogger(log_every_n_steps=10)],
            **kwargs,
        )
        return trainer.fit(data, max_steps=steps).history["train/loss"]

    sam = train(SAMTrainer, rho=0.05)
    plain = train(Trainer, loss_fn=loss_fn)  # the same run with the default step
    print(f"SAM loss {sam[0]:.4f} -> {sam[-1]:.4f}; plain SGD {plain[0]:.4f} -> {plain[-1]:.4f}")
    if not sam[-1] < sam[0]:
        raise SystemExit(f"FAILED: the SAM loss did not fall ({sam})")
    if sam == plain:
        raise SystemExit("FAILED: the SAM step trained exactly like the plain one")
    print("OK: sam_train_step: the loss fell under the custom SAM step")
    return sam[-1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="real sizes instead of tiny ones")
    main(parser.parse_args().full)
