"""Callback state round-trips, and user-written callbacks need no library change."""

import json

import numpy as np
import optax
import pytest
from flax import nnx
from test_callbacks_helpers import make_batches, make_trainer, np_sgd, params_np

from nnx_spmd_trainer import Callback
from nnx_spmd_trainer.callbacks import (
    EarlyStopping,
    LambdaCallback,
    MetricsLogger,
    Profiler,
)
from nnx_spmd_trainer.engine.metric_log import is_perf_key


def test_early_stopping_state_round_trips_and_a_resumed_run_keeps_its_patience():
    evals = make_batches(2, seed=1)
    first = EarlyStopping("eval/loss", patience=3)
    trainer = make_trainer([first], optax.sgd(0.0))
    trainer.fit(make_batches(2), eval_data=evals, max_steps=2, eval_every_n_steps=1)
    state = first.state_dict()
    assert state == {"best": first.best, "best_step": 1, "wait": 1, "stopped_step": None}
    saved = json.loads(json.dumps(state))  # checkpointable as plain JSON

    resumed = EarlyStopping("eval/loss", patience=3)
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == state
    trainer = make_trainer([resumed], optax.sgd(0.0))
    trainer.step = 2
    trainer.fit(make_batches(10), eval_data=evals, max_steps=12, eval_every_n_steps=1)
    # Two more evaluations without improvement reach patience 3: without the restored
    # wait=1 it would take three.
    assert resumed.stopped_step == 4 and trainer.step == 4


def test_stateful_callbacks_round_trip_through_json():
    stop = EarlyStopping(patience=2, mode="max")
    stop.load_state_dict({"best": 0.5, "best_step": 10, "wait": 1, "stopped_step": None})
    profiler = Profiler("unused", start_step=1)
    profiler.load_state_dict({"done": True})
    for callback, cls in [(stop, EarlyStopping), (profiler, Profiler)]:
        state = json.loads(json.dumps(callback.state_dict()))
        fresh = cls() if cls is not Profiler else Profiler("unused")
        assert fresh.state_dict() != state
        fresh.load_state_dict(state)
        assert fresh.state_dict() == state


class GlobalNorm(Callback):
    """A user's callback: the global norm of the parameters every n steps (optax.tree.norm,
    the successor of the deprecated optax.global_norm)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.norms: dict[int, float] = {}

    def on_train_batch_end(self, step: int, logs: dict[str, float]) -> None:
        if step % self.every == 0:
            params = nnx.state(self.trainer.model, nnx.Param)
            self.norms[step] = float(optax.tree.norm(params))
            logs["param_norm"] = self.norms[step]

    def state_dict(self):
        return {"norms": {str(k): v for k, v in self.norms.items()}}


def test_user_callback_sees_the_live_parameters_at_its_step():
    norms = GlobalNorm(every=2)
    trainer = make_trainer([norms], optax.sgd(0.1))
    start = params_np(trainer)
    batches = make_batches(6)
    history = trainer.fit(batches, max_steps=6)
    reference = [np.sqrt((k**2).sum() + (b**2).sum()) for k, b in np_sgd(*start, batches, 0.1)]
    assert sorted(norms.norms) == [2, 4, 6]
    np.testing.assert_allclose(
        [norms.norms[s] for s in (2, 4, 6)], [reference[1], reference[3], reference[5]], rtol=1e-5
    )
    assert history.history["param_norm"] == [norms.norms[s] for s in (2, 4, 6)]
    assert len(set(norms.norms.values())) == 3  # the parameters did move


def test_lambda_callback_calls_each_given_hook_with_its_arguments():
    calls = []

    def recorder(name):  # each hook records its name and its int argument, if any
        return lambda *args: calls.append((name, *[a for a in args if type(a) is int]))

    names = ["on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
             "on_train_batch_begin", "on_train_batch_end", "on_test_begin", "on_test_end",
             "on_test_batch_begin", "on_test_batch_end"]  # fmt: skip
    hooks = {name: recorder(name) for name in names}
    trainer = make_trainer([MetricsLogger(2), LambdaCallback(**hooks)])
    trainer.fit(make_batches(2), eval_data=make_batches(1, seed=1), max_steps=2)
    assert calls == [
        ("on_train_begin",),
        ("on_epoch_begin", 0),
        ("on_train_batch_begin", 0),
        ("on_train_batch_end", 1),
        ("on_train_batch_begin", 1),
        ("on_train_batch_end", 2),
        ("on_epoch_end", 0),
        ("on_test_begin",),
        ("on_test_batch_begin", 1),
        ("on_test_batch_end", 1),
        ("on_test_end",),
        ("on_train_end",),
    ]


def test_lambda_callback_is_dispatched_only_for_the_hooks_it_was_given():
    seen = []
    callback = LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append((epoch, sorted(logs))))
    assert "on_train_batch_end" not in vars(callback)  # nothing to call per step
    make_trainer([callback]).fit(make_batches(2), max_steps=2)
    assert [(epoch, [k for k in keys if not is_perf_key(k)]) for epoch, keys in seen] == [
        (0, ["train/accuracy", "train/loss"])
    ]


def test_lambda_callback_rejects_unknown_hooks():
    with pytest.raises(TypeError):
        LambdaCallback(on_batch_end=lambda step, logs: None)  # not a hook name
