"""Profiler: a jax.profiler trace of a window of steps, for TensorBoard's profile tab."""

from __future__ import annotations

import os
from typing import Any

import jax
from typing_extensions import override

from nnx_spmd_trainer import Callback, Logs


class Profiler(Callback):
    """Traces steps ``start_step + 1 .. start_step + num_steps`` with ``jax.profiler``.

    The trace starts before step ``start_step + 1`` is dispatched (so
    ``start_step=0`` includes compilation; the default skips it) and stops after
    ``num_steps`` steps, once the state they produced is ready: async dispatch
    would otherwise end the trace before the device work it should contain.
    ``jax.profiler`` writes ``<logdir>/plugins/profile/<run>/<host>.xplane.pb``,
    the layout TensorBoard's profile plugin (``tensorboard-plugin-profile``) opens.
    Only one trace runs per process at a time; each process writes its own.

    Example::

        Trainer(..., callbacks=[Profiler("runs/a", start_step=10, num_steps=5)])
        # tensorboard --logdir runs/a   -> Profile tab
    """

    def __init__(
        self, logdir: str | os.PathLike[str], *, start_step: int = 5, num_steps: int = 3
    ) -> None:
        if start_step < 0 or num_steps < 1:
            raise ValueError(
                f"need start_step >= 0 and num_steps >= 1, got {start_step}, {num_steps}."
            )
        self.logdir = os.fspath(logdir)
        self.state_key = f"Profiler[{self.logdir}]"
        self.start_step = start_step
        self.num_steps = num_steps
        self.done = False
        self._active = False
        self._stop_at = start_step + num_steps

    def _stop(self) -> None:
        jax.block_until_ready(self.trainer.state)
        jax.profiler.stop_trace()
        self._active = False
        self.done = True

    @override
    def on_train_batch_begin(self, step: int, logs: Logs) -> None:
        # `step` counts the steps already done; >= so a resumed run still traces once.
        if not self.done and not self._active and step >= self.start_step:
            jax.profiler.start_trace(self.logdir)
            self._active = True
            self._stop_at = step + self.num_steps

    @override
    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        if self._active and step >= self._stop_at:
            self._stop()

    @override
    def on_train_end(self, logs: Logs) -> None:
        if self._active:  # fit ended inside the window
            self._stop()

    @override
    def on_exception(self, error: BaseException) -> None:
        # Stop without waiting on the state: the failed step may never finish. The
        # window is not done, so the next fit traces again.
        if self._active:
            jax.profiler.stop_trace()
            self._active = False

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done = bool(state["done"])
