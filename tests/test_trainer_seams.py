"""The seams later features lean on: one state and one step counter, the exception path,
the live iterator, typed hooks and callback state keys, placement without host copies."""

import re
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from toy_models import (
    Net,
    RecordLosses,
    assert_params_match,
    classification_loss,
    make_batches,
    train_reference,
)

from nnx_spmd_trainer import FSDP, Callback, DataParallel, Hybrid, TensorParallel, Trainer
from nnx_spmd_trainer.callbacks import (
    EarlyStopping,
    LambdaCallback,
    LearningRateMonitor,
    MetricsLogger,
    Profiler,
    ProgressBar,
    TensorBoard,
)

FSDP_TP = Hybrid(FSDP(4, min_size=64), TensorParallel(2))


def net_trainer(tx=None, **kwargs) -> Trainer:
    return Trainer(lambda r: Net(r), tx or optax.adam(1e-2), loss_fn=classification_loss, **kwargs)


def optimizer_count(trainer: Trainer) -> int:
    return int(np.asarray(trainer.optimizer.step.get_value()))


# -- one state, one step counter ---------------------------------------------------------
def test_step_and_optimizer_count_agree_after_assigning_a_saved_state():
    schedule = optax.linear_schedule(0.1, 0.0, 10)
    monitor = LearningRateMonitor(log_every_n_steps=1, schedule=schedule)
    trainer = net_trainer(optax.sgd(schedule), strategy=FSDP_TP, callbacks=[monitor])
    trainer.fit(make_batches(3), max_steps=3)
    saved = jax.tree.map(jnp.copy, trainer.state)
    trainer.fit(make_batches(4, seed=1), max_steps=7)
    assert trainer.step == optimizer_count(trainer) == 7

    trainer.state = saved
    assert trainer.step == optimizer_count(trainer) == 3
    history = trainer.fit(make_batches(2, seed=2), max_steps=5)
    assert trainer.step == optimizer_count(trainer) == 5
    # The schedule was read at the restored count: steps 4 and 5 used updates 3 and 4.
    assert history.steps["lr"][-2:] == [4, 5]
    np.testing.assert_allclose(history.history["lr"][-2:], [schedule(3), schedule(4)])

    trainer.step = 10  # setting the step sets the optimizer's count: still one counter
    assert optimizer_count(trainer) == 10


def test_model_is_a_view_of_the_state_current_after_every_step():
    seen = []
    trainer = net_trainer(
        optax.sgd(0.1),
        callbacks=[
            LambdaCallback(
                on_train_batch_end=lambda step, logs: seen.append(
                    np.asarray(trainer.model.l3.kernel.get_value()).copy()
                )
            )
        ],
    )
    model = trainer.model  # one object for the whole life of the trainer
    trainer.fit(make_batches(3), max_steps=3)
    assert trainer.model is model
    state_kernel = np.asarray(trainer.state["model"]["l3"]["kernel"].get_value())
    np.testing.assert_array_equal(state_kernel, seen[-1])
    assert not np.allclose(seen[0], seen[-1])


# -- the exception path ------------------------------------------------------------------
def failing_loss(model, batch):
    # Runs while jax traces: a batch of another width is retraced, and refused here.
    if batch["x"].shape[-1] != 16:
        raise ValueError("bad batch width")
    return classification_loss(model, batch)


def test_an_exception_at_step_5_keeps_step_4_closes_profiler_and_writer_and_fit_continues(
    tmp_path,
):
    good = make_batches(9)
    bad = dict(good[4], x=np.zeros((16, 17), np.float32))
    errors: list[BaseException] = []
    profiler = Profiler(tmp_path / "prof", start_step=2, num_steps=10)  # open at step 5
    tensorboard = TensorBoard(tmp_path / "tb", write_hparams=False)
    progress = ProgressBar(use_tqdm=True, file=open(tmp_path / "bar.txt", "w"))  # noqa: SIM115
    stop = EarlyStopping("train/loss", patience=100)
    trainer = Trainer(
        lambda r: Net(r),
        optax.adam(1e-2),
        strategy=FSDP_TP,
        loss_fn=failing_loss,
        callbacks=[
            MetricsLogger(2),
            profiler,
            tensorboard,
            progress,
            stop,
            LambdaCallback(on_exception=errors.append),
        ],
    )

    with pytest.raises(ValueError, match="bad batch width"):
        trainer.fit([*good[:4], bad, *good[5:]], max_steps=9)

    assert trainer.step == optimizer_count(trainer) == 4
    reference, _ = train_reference(lambda r: Net(r), optax.adam(1e-2), good[:4])
    assert_params_match(trainer, reference)
    assert len(errors) == 1 and isinstance(errors[0], ValueError)
    # The profiler trace was stopped (a new one can start) and written.
    assert not profiler._active
    jax.profiler.start_trace(tmp_path / "other")
    jax.profiler.stop_trace()
    assert list((tmp_path / "prof").glob("plugins/profile/*/*.xplane.pb"))
    # The writer was closed with what it had: the log points of steps 2 and 4.
    assert tensorboard._writer is None
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4]
    assert progress._bar is None and not stop._fitting

    trainer.fit(good[5:], max_steps=8)  # the same trainer goes on from step 4
    assert trainer.step == 8
    reference, _ = train_reference(lambda r: Net(r), optax.adam(1e-2), [*good[:4], *good[5:9]])
    assert_params_match(trainer, reference)


@pytest.mark.parametrize("donate", [True, False])
def test_a_failure_after_the_state_was_donated_says_the_state_is_lost(donate):
    calls: list[int] = []  # over every compiled step (the last one reports norms)

    class FailsOnThirdStep(DataParallel):
        """A step whose result never arrives, as when a device fails mid-step."""

        def compile_step(self, step_fn, **kwargs):
            compiled = super().compile_step(step_fn, **kwargs)

            def run(*args):
                out = compiled(*args)  # the state arrays were donated to this call
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("device failed")
                return out

            return run

    trainer = net_trainer(optax.sgd(0.1), strategy=FailsOnThirdStep(), donate=donate)
    with pytest.raises(RuntimeError, match="device failed") as caught:
        trainer.fit(make_batches(3), max_steps=3)
    notes = " ".join(getattr(caught.value, "__notes__", []))
    if donate:
        assert "after step 2" in notes and "restore a checkpoint" in notes
    else:  # nothing was given away: the state is step 2's, and training goes on from it
        assert not notes
        reference, _ = train_reference(lambda r: Net(r), optax.sgd(0.1), make_batches(2))
        assert_params_match(trainer, reference)


# -- the live iterator and the epoch --------------------------------------------------------
def test_callbacks_read_the_live_grain_iterator_and_the_epoch():
    rows = make_batches(1, batch_size=64)[0]
    dataset = (
        grain.MapDataset.source(range(64))
        .batch(16)
        .map(lambda idx: {"x": rows["x"][idx], "y": rows["y"][idx]})
    )
    seen = []

    class Watch(Callback):
        def on_train_batch_end(self, step, logs):
            # The iterator runs ahead (prefetch); the position of the next batch is this:
            seen.append(
                (self.trainer.progress.epoch, step, self.trainer.progress.position().get_state())
            )

    trainer = net_trainer(callbacks=[Watch()])
    trainer.fit(dataset, epochs=2)
    assert [(epoch, step) for epoch, step, _ in seen] == [(e, s) for s in range(1, 9)
                                                          for e in [(s - 1) // 4]]  # fmt: skip
    for epoch, step, state in seen:
        fresh = iter(dataset)
        for _ in range(step - 4 * epoch):
            next(fresh)
        assert state == fresh.get_state(), step
    # Set back to the last step's batch when the epoch's loop ended, for a final save.
    assert trainer.progress.train_iterator.get_state() == seen[-1][2]


# -- hooks and callback state ----------------------------------------------------------------
def test_a_misspelled_hook_is_an_error_and_other_methods_are_left_alone():
    class Typo(Callback):
        def on_train_batch_ends(self, step, logs):
            pass

    class Helper(Callback):
        def on_my_own_event(self):  # not close to any hook: the user's own method
            pass

    with pytest.raises(TypeError, match="did you mean on_train_batch_end"):
        net_trainer(callbacks=[Typo()])
    net_trainer(callbacks=[Helper()])


def test_state_keys_tell_two_instances_apart_and_a_clash_is_an_error():
    by_eval, by_train = EarlyStopping("eval/loss"), EarlyStopping("train/loss")
    trainer = net_trainer(callbacks=[by_eval, by_train])
    by_eval.wait = 2
    states = trainer.callbacks.state_dict()
    assert states[by_eval.state_key]["wait"] == 2 and states[by_train.state_key]["wait"] == 0
    assert "History" in states

    with pytest.raises(ValueError, match="share the state_key"):
        net_trainer(callbacks=[EarlyStopping("eval/loss"), EarlyStopping("eval/loss")])
    twin = EarlyStopping("eval/loss")
    twin.state_key = "EarlyStopping-2"
    fresh = net_trainer(callbacks=[EarlyStopping("eval/loss"), twin])
    fresh.callbacks.load_state_dict({"EarlyStopping-2": states[by_eval.state_key]})
    assert twin.wait == 2


def test_writers_see_values_a_callback_adds_whatever_the_list_order():
    written = []
    writer = LambdaCallback(on_logs=lambda step, logs: written.append(dict(logs)))
    schedule = optax.constant_schedule(0.05)
    monitor = LearningRateMonitor(schedule=schedule)
    net_trainer(optax.sgd(schedule), callbacks=[writer, MetricsLogger(2), monitor]).fit(
        make_batches(2), max_steps=2
    )
    assert written[0]["lr"] == pytest.approx(0.05) and "train/loss" in written[0]


# -- the optimizer gets the loss -------------------------------------------------------------
def keep_value() -> optax.GradientTransformationExtraArgs:
    """Stores the ``value`` it is given: what a plateau schedule or a line search reads."""

    def update(updates, state, params=None, *, value, **extra):
        del state, params, extra
        return updates, jnp.asarray(value, jnp.float32)

    return optax.GradientTransformationExtraArgs(lambda params: jnp.zeros(()), update)


def test_the_optimizer_update_receives_the_loss_as_value():
    losses = RecordLosses()
    trainer = net_trainer(optax.chain(optax.sgd(0.1), keep_value()), callbacks=[losses])
    trainer.fit(make_batches(3), max_steps=3)
    kept = float(np.asarray(jax.tree.leaves(trainer.optimizer.opt_state)[-1]))
    assert kept == pytest.approx(losses.losses[-1], rel=1e-6)


# -- placement ---------------------------------------------------------------------------
def test_a_batch_already_on_the_devices_is_not_copied_to_the_host():
    trainer = net_trainer(optax.sgd(0.1), strategy=FSDP_TP)
    host = make_batches(3)
    placed = [trainer.placement.place(batch) for batch in host]
    with jax.transfer_guard_device_to_host("disallow"):  # any copy to the host raises
        again = [trainer.placement.place(batch) for batch in placed]
    for first, second in zip(placed, again, strict=True):
        assert second["x"] is first["x"]  # same layout: the very same array
    trainer.fit(placed, max_steps=3)
    reference, _ = train_reference(lambda r: Net(r), optax.sgd(0.1), host)
    assert_params_match(trainer, reference)


# -- the TensorBoard sharding table -------------------------------------------------------------
def test_tensorboard_sharding_total_is_what_each_device_holds(tmp_path: Path):
    trainer = net_trainer(strategy=FSDP_TP, callbacks=[TensorBoard(tmp_path)])
    trainer.fit(make_batches(1), max_steps=1)
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("sharding/text_summary")[0].tensor_proto.string_val[0].decode()
    total = int(re.search(r"\*\*total per device\*\* \|[ |]*\| (\d+) \|", text).group(1))
    device = jax.devices()[0]
    held = sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(trainer.state)  # parameters and optimizer state
        for shard in leaf.addressable_shards
        if shard.device == device
    )
    assert total == held
    assert "optimizer/opt_state" in text  # Adam's moments are in the table
