"""MetricsLogger: training metrics in ``logs`` every n steps."""

from __future__ import annotations

from typing_extensions import override

from nnx_spmd_trainer import Callback, Trainer


class MetricsLogger(Callback):
    """Asks the trainer to bring the on-device CLU metrics to ``logs`` every n steps.

    The metrics are accumulated on device inside the compiled step. The
    trainer alone flushes them (one device-to-host copy, averaged over the
    steps since the last flush) at its log steps, each epoch end and the end
    of ``fit``, and puts them in ``logs`` before any hook runs; this callback
    only adds its ``log_every_n_steps`` to the trainer's log steps
    (``Trainer(log_every_n_steps=n)`` does the same). On the other steps
    nothing is copied from the devices.

    Example::

        trainer = Trainer(factory, optax.adam(1e-3), loss_fn=loss_fn,
                          callbacks=[MetricsLogger(log_every_n_steps=50), TensorBoard("runs/a")])
        history = trainer.fit(batches, max_steps=1000)
        history.history["train/loss"]   # one value per 50 steps (averaged over them)
    """

    def __init__(self, log_every_n_steps: int = 50) -> None:
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}.")
        self.log_every_n_steps = log_every_n_steps

    @override
    def set_trainer(self, trainer: Trainer) -> None:
        super().set_trainer(trainer)
        trainer.log_schedule.request_log_every(self.log_every_n_steps)
