"""OrbaxCheckpoint: exact resume, restore under another layout, integrity, NaN, preemption."""

import json
import os
import shutil
import signal
import warnings
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from toy_models import Net, RecordLosses, classification_loss, flat_params, make_batches

from nnx_spmd_trainer import FSDP, Callback, DataParallel, Hybrid, TensorParallel, Trainer
from nnx_spmd_trainer.callbacks import (
    DamagedCheckpoint,
    LambdaCallback,
    MetricsLogger,
    OrbaxCheckpoint,
    TerminateOnNaN,
)

FSDP_TP = Hybrid(FSDP(4, min_size=64), TensorParallel(2))


class Dropped(Net):
    """Net with dropout: its RNG state must be saved and restored for an exact resume."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        super().__init__(rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, x):
        return super().__call__(self.drop(x))


class Crash(Callback):
    """Kills the run at ``step``, as a crash would: an exception, no final save."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, step, logs):
        if step == self.step:
            raise RuntimeError("simulated crash")


def trainer_for(strategy=FSDP_TP, callbacks=(), devices=None, model=Dropped) -> Trainer:
    return Trainer(
        lambda r: model(r),
        optax.adamw(1e-2),
        strategy=strategy,
        loss_fn=classification_loss,
        callbacks=[MetricsLogger(2), *callbacks],
        devices=devices,
    )


def grain_data() -> grain.MapDataset:
    """5 batches an epoch, so saves at steps 3 and 6 fall mid-epoch."""
    rows = make_batches(1, batch_size=80)[0]
    return (
        grain.MapDataset.source(np.arange(80))
        .shuffle(seed=1)
        .batch(16)
        .map(lambda i: {"x": rows["x"][i], "y": rows["y"][i]})
    )


def params(trainer: Trainer) -> dict[str, np.ndarray]:
    return flat_params(nnx.state(trainer.model, nnx.Param))


def assert_bitwise(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("source", ["grain", "list"])
def test_a_crashed_run_resumes_bitwise_mid_epoch(tmp_path, source):
    data = grain_data() if source == "grain" else list(grain_data())
    whole = RecordLosses()
    uninterrupted = trainer_for(callbacks=[whole])
    uninterrupted.fit(data, epochs=3, eval_data=data, eval_every_n_steps=3)

    crashed = trainer_for(callbacks=[OrbaxCheckpoint(tmp_path, save_every_n_steps=3), Crash(8)])
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit(data, epochs=3, eval_data=data, eval_every_n_steps=3)
    assert OrbaxCheckpoint(tmp_path).steps() == [3, 6]  # 6 is mid-epoch 2, batch 1

    after = RecordLosses()
    checkpoint = OrbaxCheckpoint(tmp_path, save_every_n_steps=3)
    resumed = trainer_for(callbacks=[checkpoint, after])
    if source == "list":
        with pytest.warns(UserWarning, match="first 1 batches are read and discarded"):
            history = resumed.fit(data, epochs=3, eval_data=data, eval_every_n_steps=3)
    else:
        history = resumed.fit(data, epochs=3, eval_data=data, eval_every_n_steps=3)
    assert checkpoint.restored_step == 6 and resumed.step == uninterrupted.step == 15
    assert after.losses == whole.losses[6:]  # bitwise, step by step
    assert_bitwise(params(resumed), params(uninterrupted))

    # History (a callback's checkpointed state) continues with no gap and no duplicate.
    # Timings (perf/: the resumed process compiles again) aside, bitwise, norms included.
    def timeless(table: dict) -> dict:
        return {k: v for k, v in table.items() if not k.startswith(("perf/", "goodput/"))}

    assert timeless(history.steps) == timeless(uninterrupted.history.steps)
    assert timeless(history.history) == timeless(uninterrupted.history.history)
    assert "train/grad_norm" in history.history


def test_the_checkpoint_holds_the_run_and_its_description(tmp_path):
    trainer = trainer_for(
        callbacks=[OrbaxCheckpoint(tmp_path, save_every_n_steps=2, keep=2)], model=Net
    )
    trainer.config = {"lr": 0.01, "note": "x"}
    trainer.fit(grain_data(), max_steps=7)
    assert OrbaxCheckpoint(tmp_path).steps() == [6, 7]  # keep=2, and the final step
    meta = json.loads((tmp_path / "7" / "meta" / "metadata").read_text())
    assert meta["step"] == 7 and meta["epoch"] == 1 and meta["batches_in_epoch"] == 2
    assert meta["strategy"] == repr(FSDP_TP) and meta["mesh"] == {"fsdp": 4, "model": 2}
    assert {"jax", "flax", "orbax-checkpoint"} <= meta["versions"].keys()
    assert meta["config"] == {"lr": 0.01, "note": "x"} and meta["data"] == "grain"
    assert "History" in meta["callbacks"]


# -- another layout ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> tuple[Path, object, list[float]]:
    """FSDP on 8 devices, saved at step 4 and trained on to 8: (its checkpoints, the state
    at step 4, every step's loss). The same run for every layout below, so written once;
    each test restores from a copy of it."""
    directory = tmp_path_factory.mktemp("fsdp-run")
    batches = make_batches(8)
    going_on = RecordLosses()
    writer = trainer_for(
        FSDP(min_size=64), [OrbaxCheckpoint(directory, save_every_n_steps=4), going_on], model=Net
    )
    writer.fit(batches[:4], max_steps=4)
    saved = jax.device_get(writer.state)
    writer.fit(batches[4:], max_steps=8)
    return directory, saved, going_on.losses


@pytest.mark.parametrize(
    "strategy, num_devices",
    [(Hybrid(DataParallel(), TensorParallel(2)), 8), (DataParallel(), 4), (DataParallel(), 1)],
    ids=["dp4xtp2", "dp-on-4", "one-device"],
)
def test_a_checkpoint_restores_under_another_strategy_and_device_count(
    tmp_path, strategy, num_devices, fsdp_run
):
    batches = make_batches(8)
    written, saved, going_on_losses = fsdp_run
    shutil.copytree(written, tmp_path, dirs_exist_ok=True)

    restored: list = []
    moved_losses = RecordLosses()
    moved = trainer_for(
        strategy,
        [
            OrbaxCheckpoint(tmp_path / "moved", restore=tmp_path / "4"),
            LambdaCallback(  # what on_fit_start restored, before training donates it
                on_train_begin=lambda logs: restored.append(
                    (
                        [x.sharding for x in jax.tree.leaves(moved.state)],
                        jax.device_get(moved.state),
                    )
                )
            ),
            moved_losses,
        ],
        devices=jax.devices()[:num_devices],
        model=Net,
    )
    with pytest.warns(UserWarning, match="first 4 batches are read and discarded"):
        moved.fit(batches, max_steps=8)  # the same data: the first 4 batches were trained on
    _, state = restored[0]
    checkpoint = next(c for c in moved.callbacks if isinstance(c, OrbaxCheckpoint))
    # Orbax delivered every leaf already in the new layout: no whole copy on one device.
    assert checkpoint.restored_layouts == moved.plan.leaf_shardings
    for (path, want), got in zip(
        jax.tree_util.tree_flatten_with_path(saved)[0], jax.tree.leaves(state), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=jax.tree_util.keystr(path))
    assert moved.step == 8 and len(moved.mesh.devices.flat) == num_devices
    np.testing.assert_allclose(moved_losses.losses, going_on_losses[4:], rtol=1e-5, atol=1e-6)


# -- integrity ---------------------------------------------------------------------------------
def largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip_a_byte(step_dir: Path) -> None:
    data = largest_file(step_dir / "state" / "d")  # the arrays (zstd-compressed by Orbax)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))


def change_values_silently(step_dir: Path) -> None:
    """Valid arrays with other values in place of the saved ones: Orbax reads them without
    complaint (it keeps no checksum of array data); only the fingerprints can tell."""
    checkpointer = ocp.StandardCheckpointer()
    saved = checkpointer.restore(step_dir / "state")
    checkpointer.save(
        step_dir / "state",
        jax.tree.map(lambda x: x * 1.5 if np.issubdtype(x.dtype, np.floating) else x, saved),
        force=True,
    )
    checkpointer.wait_until_finished()


def truncate(step_dir: Path) -> None:
    data = largest_file(step_dir / "state" / "d")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def drop_commit_marker(step_dir: Path) -> None:
    (step_dir / "commit_success.txt").unlink()


def delete_an_item(step_dir: Path) -> None:
    for path in sorted((step_dir / "train_metrics").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    (step_dir / "train_metrics").rmdir()


@pytest.fixture(scope="module")
def saved_at_2_and_4(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """A run saved at steps 2 and 4, and its parameters at step 2. The same run for every
    kind of damage below, so written once; each test damages a copy of it."""
    directory = tmp_path_factory.mktemp("saved-2-4")
    batches = make_batches(4)
    first = trainer_for(callbacks=[OrbaxCheckpoint(directory, save_every_n_steps=2)], model=Net)
    first.fit(batches, max_steps=2)
    at_2 = params(first)
    first.fit(batches[2:], max_steps=4)
    return directory, at_2


@pytest.mark.parametrize(
    "damage", [flip_a_byte, change_values_silently, truncate, drop_commit_marker, delete_an_item]
)
# Orbax's reads still in flight after the failed restore once printed "Event loop is
# closed" as unraisable exceptions (adapters/orbax_private.quiet_reads_after_a_failed_restore).
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_latest_step_is_named_set_aside_and_the_previous_one_used(
    tmp_path, damage, saved_at_2_and_4
):
    batches = make_batches(4)
    written, at_2 = saved_at_2_and_4
    shutil.copytree(written, tmp_path, dirs_exist_ok=True)
    assert OrbaxCheckpoint(tmp_path).steps() == [2, 4]
    damage(tmp_path / "4")

    reports: list[str] = []
    checkpoint = OrbaxCheckpoint(tmp_path, print_fn=reports.append)
    again = trainer_for(callbacks=[checkpoint], model=Net)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.fit(batches[2:], max_steps=2)  # restores, then has nothing left to train
    assert checkpoint.restored_step == 2 and again.step == 2
    assert_bitwise(params(again), at_2)
    assert (tmp_path / "4.damaged").is_dir()  # kept for inspection, not deleted
    assert checkpoint.steps() == [2]
    # Reported once: a line through print_fn, no warning of it besides. Only warnings that
    # name this directory count: one CI run (of 1,440 tests in two processes) caught some
    # other RuntimeWarning here, not reproduced in 30 runs since; the assertion prints them.
    (told,) = [line for line in reports if f"checkpoint step 4 at {tmp_path / '4'}" in line]
    assert "4.damaged" in told
    warned = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert not [message for message in warned if str(tmp_path) in message], warned


# Orbax's reads still in flight after the failed restore once printed "Event loop is
# closed" as unraisable exceptions (adapters/orbax_private.quiet_reads_after_a_failed_restore).
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_asking_for_a_damaged_step_by_number_raises_and_names_it(tmp_path):
    trainer = trainer_for(callbacks=[OrbaxCheckpoint(tmp_path)], model=Net)
    trainer.fit(make_batches(2), max_steps=2)
    change_values_silently(tmp_path / "2")
    again = trainer_for(callbacks=[OrbaxCheckpoint(tmp_path, restore=2)], model=Net)
    with pytest.raises(DamagedCheckpoint, match="step 2 .* do not match the fingerprints"):
        again.fit(make_batches(2), max_steps=2)


class WithValue(nnx.Module):
    """A submodule named ``value`` (as attention's) beside a parameter named ``kernel``:
    leaf names that drop every ``value`` key would give both ``model/kernel``."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.value = nnx.Linear(16, 4, rngs=rngs)
        self.kernel = nnx.Param(jnp.ones((4,)))

    def __call__(self, x):
        return self.value(x) * self.kernel


def as_written_before_0_1_0(step_dir: Path) -> None:
    """The step's fingerprint record as 0.1.0's predecessors wrote it: no ``"paths"``
    version, every ``value`` key left out of the leaf names (the last one kept on a clash)."""
    record_file = step_dir / "fingerprints" / "fingerprints.json"
    record = json.loads(record_file.read_text())
    assert record.pop("paths") == 2
    record["leaves"] = {
        "/".join(k for k in name.split("/") if k != "value"): value
        for name, value in record["leaves"].items()
    }
    record_file.write_text(json.dumps(record))


def test_leaf_names_keep_a_submodule_named_value_and_older_checkpoints_still_check(tmp_path):
    def loss(model, batch):
        return jnp.mean((model(batch["x"]) - jax.nn.one_hot(batch["y"], 4)) ** 2), {}

    def make(checkpoint):
        return Trainer(
            lambda r: WithValue(r), optax.adam(1e-2), loss_fn=loss, callbacks=[checkpoint]
        )

    written = make(OrbaxCheckpoint(tmp_path))
    written.fit(make_batches(2), max_steps=2)
    record = json.loads((tmp_path / "2" / "fingerprints" / "fingerprints.json").read_text())
    assert {"state/model/kernel", "state/model/value/kernel"} <= record["leaves"].keys()

    as_written_before_0_1_0(tmp_path / "2")
    again = make(OrbaxCheckpoint(tmp_path))
    again.fit(make_batches(2), max_steps=2)  # restores under the old names, nothing to train
    assert again.step == 2
    assert_bitwise(params(again), params(written))

    change_values_silently(tmp_path / "2")  # the old record still catches damage
    damaged = make(OrbaxCheckpoint(tmp_path, restore=2))
    with pytest.raises(DamagedCheckpoint, match="step 2 .* do not match the fingerprints"):
        damaged.fit(make_batches(2), max_steps=2)


# -- NaN and preemption ---------------------------------------------------------------------------
def test_no_non_finite_state_is_saved_and_a_restart_uses_the_last_finite_step(tmp_path):
    batches = make_batches(8)
    batches[4] = dict(batches[4], x=np.full_like(batches[4]["x"], np.nan))  # step 5 diverges
    guard = TerminateOnNaN()
    trainer = trainer_for(
        callbacks=[guard, OrbaxCheckpoint(tmp_path, save_every_n_steps=2)], model=Net
    )
    with pytest.warns(RuntimeWarning, match="loss is nan at step 5"):
        trainer.fit(batches, max_steps=8)
    assert OrbaxCheckpoint(tmp_path).steps() == [2, 4]  # not 6, not the final step
    again = trainer_for(callbacks=[OrbaxCheckpoint(tmp_path)], model=Net)
    again.fit(batches[:4], max_steps=4)
    assert again.step == 4 and all(np.isfinite(v).all() for v in params(again).values())


def test_sigterm_finishes_the_step_saves_and_a_restart_continues_bitwise(tmp_path):
    data = grain_data()
    whole = RecordLosses()
    uninterrupted = trainer_for(callbacks=[whole])
    uninterrupted.fit(data, max_steps=9)

    class Terminate(Callback):
        def on_train_batch_begin(self, step, logs):
            if step == 4:  # while step 5 is about to run
                os.kill(os.getpid(), signal.SIGTERM)

    checkpoint = OrbaxCheckpoint(tmp_path, save_every_n_steps=100)
    stopped = trainer_for(callbacks=[checkpoint, Terminate()])
    stopped.fit(data, max_steps=9)  # returns normally
    assert stopped.progress.preempted and stopped.step == 5 and checkpoint.steps() == [5]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler given back

    after = RecordLosses()
    resumed = trainer_for(callbacks=[OrbaxCheckpoint(tmp_path), after])
    resumed.fit(data, max_steps=9)
    assert after.losses == whole.losses[5:]
    assert_bitwise(params(resumed), params(uninterrupted))


def test_a_directory_ahead_of_the_run_is_refused_unless_resumed(tmp_path):
    trainer_for(callbacks=[OrbaxCheckpoint(tmp_path)], model=Net).fit(make_batches(2), max_steps=2)
    fresh = trainer_for(callbacks=[OrbaxCheckpoint(tmp_path, restore=None)], model=Net)
    with pytest.raises(ValueError, match="already holds checkpoints up to step 2"):
        fresh.fit(make_batches(2), max_steps=2)


def test_best_steps_are_kept_and_restored_by_the_monitored_value(tmp_path):
    class FakeMetric(Callback):  # a monitored value that is best at step 2
        def on_train_batch_end(self, step, logs):
            logs["score"] = float(abs(step - 2))

    checkpoint = OrbaxCheckpoint(
        tmp_path, save_every_n_steps=1, keep=1, monitor="score", keep_best=1
    )
    batches = make_batches(6)
    first = trainer_for(callbacks=[FakeMetric(), checkpoint], model=Net)
    first.fit(batches[:2], max_steps=2)
    at_2 = params(first)
    first.fit(batches[2:5], max_steps=5)
    assert checkpoint.steps() == [2, 5]  # the best, and the latest

    best = OrbaxCheckpoint(tmp_path, monitor="score", restore="best", save_every_n_steps=1)
    again = trainer_for(callbacks=[best], model=Net)
    again.fit(batches, max_steps=2)  # restores step 2; nothing left to train
    assert best.restored_step == 2 and again.step == 2
    assert_bitwise(params(again), at_2)
    assert (tmp_path / "5.after-2").is_dir()  # set aside, so saves from step 2 go on
    again.fit(batches, max_steps=3)
    assert best.steps() == [2, 3]


def test_only_the_first_fit_resumes(tmp_path):
    batches = make_batches(8)
    plain = trainer_for(model=Net)
    plain.fit(batches[:4], max_steps=4)
    plain.fit(batches[4:], max_steps=8)
    with_checkpoints = trainer_for(callbacks=[OrbaxCheckpoint(tmp_path)], model=Net)
    with_checkpoints.fit(batches[:4], max_steps=4)
    with_checkpoints.fit(batches[4:], max_steps=8)  # goes on; does not re-seek its data
    assert_bitwise(params(with_checkpoints), params(plain))


def test_a_state_made_non_finite_by_its_update_is_set_aside(tmp_path):
    def loss(model, batch):
        value, aux = classification_loss(model, batch)
        # Finite value, NaN gradient when poisoned: sqrt'(0) is infinite.
        kernel = model.l3.kernel.get_value()
        return value + 0.0 * jnp.sqrt(jnp.sum(kernel * 0.0) + 1.0 - batch["poison"].mean()), aux

    batches = [dict(b, poison=np.zeros(16, np.float32)) for b in make_batches(8)]
    batches[3]["poison"][:] = 1.0  # step 4: finite loss, NaN parameters after its update
    trainer = Trainer(
        lambda r: Net(r), optax.adamw(1e-2), strategy=FSDP_TP, loss_fn=loss,
        callbacks=[TerminateOnNaN(), OrbaxCheckpoint(tmp_path, save_every_n_steps=2)],
    )  # fmt: skip
    with pytest.warns(RuntimeWarning, match="non-finite values"):
        trainer.fit(batches, max_steps=8)
    assert OrbaxCheckpoint(tmp_path).steps() == [2]
    assert (tmp_path / "4.nonfinite").is_dir()
    again = trainer_for(callbacks=[OrbaxCheckpoint(tmp_path)], model=Net)
    again.fit(batches[:2], max_steps=2)
    assert again.step == 2 and all(np.isfinite(v).all() for v in params(again).values())


def test_a_checkpoint_of_another_model_is_an_error_and_stays_where_it_is(tmp_path):
    trainer_for(callbacks=[OrbaxCheckpoint(tmp_path)], model=Net).fit(make_batches(2), max_steps=2)

    class Wider(Net):
        def __init__(self, rngs: nnx.Rngs) -> None:
            super().__init__(rngs, hidden=64)

    other = trainer_for(callbacks=[OrbaxCheckpoint(tmp_path)], model=Wider)
    with pytest.raises(ValueError, match=r"written for another model .*model/l1/kernel"):
        other.fit(make_batches(2), max_steps=2)

    class WithDropout(Net):  # its RNG counters sort first by name, but tell nothing
        def __init__(self, rngs: nnx.Rngs) -> None:
            super().__init__(rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.out2 = nnx.Linear(8, 8, rngs=rngs)

    other = trainer_for(callbacks=[OrbaxCheckpoint(tmp_path)], model=WithDropout)
    with pytest.raises(ValueError, match=r"only in this model \(model/out2/bias, model/out2/k"):
        other.fit(make_batches(2), max_steps=2)
    assert OrbaxCheckpoint(tmp_path).steps() == [2]  # not mistaken for damage
    missing = trainer_for(callbacks=[OrbaxCheckpoint(tmp_path, restore=7)], model=Net)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint step 7 .*steps there: \[2\]"):
        missing.fit(make_batches(2), max_steps=2)
