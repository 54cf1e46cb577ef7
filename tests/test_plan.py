"""The plan apart from the run: lowering from shapes, resuming with one copy of the state,
the run state a plain-Orbax callback saves, and the step counter of a custom train step."""

import gc

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from live_memory import PeakLiveBytes, live_bytes
from toy_models import Net, classification_loss, flat_params, make_batches

from nnx_spmd_trainer import FSDP, Callback, Hybrid, Plan, RunState, TensorParallel, Trainer
from nnx_spmd_trainer.callbacks import MetricsLogger, OrbaxCheckpoint

FSDP_TP = Hybrid(FSDP(4, min_size=64), TensorParallel(2))
WIDE = {"din": 512, "hidden": 1024, "dout": 16}  # ~1.6M parameters: 3 copies with Adam


def wide(rngs: nnx.Rngs) -> Net:
    return Net(rngs, **WIDE)


def state_bytes(trainer: Trainer) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(trainer.state))


@pytest.mark.slow
def test_resuming_never_holds_two_copies_of_the_state(tmp_path):
    batches = make_batches(4, batch_size=16, din=WIDE["din"], classes=WIDE["dout"])

    def trainer(*callbacks) -> Trainer:
        return Trainer(
            wide,
            optax.adam(1e-3),
            strategy=FSDP_TP,
            loss_fn=classification_loss,
            callbacks=[OrbaxCheckpoint(tmp_path), *callbacks],
        )

    first = trainer()
    first.fit(batches[:2], max_steps=2)
    one_state = state_bytes(first)
    del first
    gc.collect()  # the first run's arrays are gone before the baseline

    class RestoreEnds(Callback):  # after the checkpoint's on_fit_start: the restore is done
        def on_fit_start(self, logs):
            restoring.stop()

    baseline = live_bytes()
    restoring, fitting = PeakLiveBytes().start(), PeakLiveBytes().start()  # fit: not asserted
    resumed = trainer(RestoreEnds())
    resumed.fit(batches, max_steps=4)
    fitting.stop()
    assert resumed.step == 4  # it resumed at 2
    restore_peak = (restoring.stop() - baseline) / one_state
    fit_peak = (fitting.stop() - baseline) / one_state
    print(f"live arrays / one state: {restore_peak:.2f} while restoring, {fit_peak:.2f} in fit")
    assert restore_peak <= 1.1


def test_a_plan_lowers_from_shapes_with_no_state_array_and_its_trainer_runs_that_step():
    before = {id(a) for a in jax.live_arrays()}
    plan = Plan(wide, optax.adam(1e-3), strategy=FSDP_TP, loss_fn=classification_loss)
    shapes = {
        "x": jax.ShapeDtypeStruct((16, WIDE["din"]), jnp.float32),
        "y": jax.ShapeDtypeStruct((16,), jnp.int32),
    }
    planned = plan.lower(shapes).compile()
    created = [a for a in jax.live_arrays() if id(a) not in before]
    assert created == [], [a.shape for a in created]  # not one array: no state, no metrics
    planned_memory = planned.memory_analysis()

    trainer = Trainer(plan)
    batch = make_batches(1, batch_size=16, din=WIDE["din"], classes=WIDE["dout"])[0]
    trainer.fit([batch], max_steps=1)
    placed = trainer.placement.place(batch)
    ran, new = trainer._loop.cached_step("train", placed)
    assert not new  # the jitted step the trainer ran, from the plan's cache
    running = ran.lower(trainer.run.objects().arrays(), trainer.metric_log.train, placed).compile()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes")
    for field in fields:
        assert getattr(planned_memory, field) == getattr(running.memory_analysis(), field)
    # the planned argument bytes are what a device really holds of the state
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(trainer.state))
    assert planned_memory.argument_size_in_bytes >= per_device
    assert planned_memory.argument_size_in_bytes < 1.05 * per_device + 64 * 1024


class PlainOrbax(Callback):
    """A whole checkpointing callback on ``run_state()`` / ``load_run_state()``: plain Orbax."""

    def __init__(self, directory, every: int) -> None:
        self.manager = ocp.CheckpointManager(directory)
        self.every = every

    def on_fit_start(self, logs):
        step = self.manager.latest_step()
        if step is None:
            return
        target = self.trainer.run_state(abstract=True)  # shapes and layouts, no arrays
        saved = self.manager.restore(
            step,
            args=ocp.args.Composite(
                arrays=ocp.args.StandardRestore(target.arrays()), host=ocp.args.JsonRestore()
            ),
        )
        self.trainer.load_run_state(RunState.from_saved(saved["arrays"], saved["host"]))

    def on_step_end(self, step):
        if step % self.every == 0:
            run = self.trainer.run_state()
            args = ocp.args.Composite(
                arrays=ocp.args.StandardSave(run.arrays()), host=ocp.args.JsonSave(run.host())
            )
            self.manager.save(step, args=args)

    def on_fit_end(self, logs):
        self.manager.wait_until_finished()

    def on_exception(self, error):
        self.manager.wait_until_finished()


def test_a_plain_orbax_callback_on_the_run_state_resumes_exactly(tmp_path):
    rows = make_batches(1, batch_size=80)[0]
    data = (
        grain.MapDataset.source(np.arange(80))
        .shuffle(seed=1)
        .batch(16)
        .map(lambda i: {"x": rows["x"][i], "y": rows["y"][i]})
    )

    class Dropped(Net):  # its RNG state must come back too
        def __init__(self, rngs):
            super().__init__(rngs)
            self.drop = nnx.Dropout(0.3, rngs=rngs)

        def __call__(self, x):
            return super().__call__(self.drop(x))

    def trainer(*callbacks) -> Trainer:
        return Trainer(
            Dropped,
            optax.adamw(1e-2),
            strategy=FSDP_TP,
            loss_fn=classification_loss,
            callbacks=[MetricsLogger(2), *callbacks],
        )

    whole = trainer()
    whole.fit(data, max_steps=8)

    class Crash(Callback):
        def on_step_end(self, step):
            if step == 6:
                raise RuntimeError("simulated crash")

    crashed = trainer(PlainOrbax(tmp_path, every=3), Crash())
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit(data, max_steps=8)
    resumed = trainer(PlainOrbax(tmp_path, every=3))
    resumed.fit(data, max_steps=8)  # resumes step 6, mid-epoch 2 of 5-batch epochs

    assert resumed.step == whole.step == 8
    ours = flat_params(nnx.state(resumed.model, nnx.Param))
    theirs = flat_params(nnx.state(whole.model, nnx.Param))
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    # metrics and history resume with the run: the same losses logged at the same steps
    assert resumed.history.steps["train/loss"] == whole.history.steps["train/loss"]
    assert resumed.history.history["train/loss"] == whole.history.history["train/loss"]


def test_a_train_step_that_updates_twice_keeps_the_step_equal_to_the_optimizers():
    class TwiceTrainer(Trainer):
        def train_step(self, model, optimizer, batch):
            loss, aux, grads = self.compute_gradients(model, batch)
            optimizer.update(model, grads)
            optimizer.update(model, grads)
            return loss, aux

    trainer = TwiceTrainer(Net, optax.sgd(0.1), loss_fn=classification_loss)
    trainer.fit(make_batches(3), max_steps=4)
    counted = int(np.asarray(trainer.optimizer.step.get_raw_value().addressable_data(0)))
    assert trainer.step == counted == 4  # steps 1 and 2 made 4 updates: fit stopped there
