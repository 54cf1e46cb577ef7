"""MetricsLogger: brings the on-device CLU metrics to ``logs`` every n steps."""

from __future__ import annotations

from typing_extensions import override

from nnx_spmd_trainer import Callback, Logs


class MetricsLogger(Callback):
    """Every ``log_every_n_steps`` steps, moves the training metrics into ``logs``.

    The metrics are accumulated on device inside the compiled step;
    ``trainer.flush_train_metrics()`` computes them over the steps since the
    last flush (one device-to-host copy) and resets them. On the other steps
    this callback touches nothing on the devices. The trainer itself flushes
    at each epoch end and at the end of ``fit``, and puts ``eval/...`` values
    into ``logs`` after each evaluation.

    It runs first (``order = -100``) so writers, early stopping and NaN checks
    that run later in the same hook see the values.

    Example::

        trainer = Trainer(factory, optax.adam(1e-3), loss_fn=loss_fn,
                          callbacks=[MetricsLogger(log_every_n_steps=50), TensorBoard("runs/a")])
        history = trainer.fit(batches, max_steps=1000)
        history.history["train/loss"]   # one value per 50 steps (averaged over them)
    """

    order = -100

    def __init__(self, log_every_n_steps: int = 50) -> None:
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}.")
        self.log_every_n_steps = log_every_n_steps

    @override
    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        if step % self.log_every_n_steps == 0:
            logs.update(self.trainer.flush_train_metrics())
