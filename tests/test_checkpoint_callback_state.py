"""Callback states in checkpoints (arrays, plain values, refusals) and restoring for evaluation."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from test_checkpoint import FSDP_TP, Crash, assert_bitwise, grain_data, params, trainer_for
from toy_models import Net, classification_loss, make_batches

from nnx_spmd_trainer import FSDP, Callback, DataParallel, Trainer
from nnx_spmd_trainer.callbacks import DamagedCheckpoint, OrbaxCheckpoint


@jax.jit
def _ema_update(ema, params):
    return jax.tree.map(lambda e, p: 0.75 * e + 0.25 * p, ema, params)


class EMA(Callback):
    """An exponential moving average of the parameters, on the devices and sharded like them.

    ``layout_first``: before it has its arrays (a restore comes before ``on_train_begin``),
    its state holds their layout (``jax.ShapeDtypeStruct``), so they are read into it;
    otherwise ``None`` there, and they arrive replicated.
    """

    def __init__(self, layout_first: bool = True, record: bool = False) -> None:
        self.layout_first = layout_first
        self.ema = None
        self.updates = 0
        self.restored_shardings = None
        self.seen: list | None = [] if record else None  # host copies, for a reference

    def params(self):
        return nnx.to_pure_dict(nnx.state(self.trainer.model, nnx.Param))

    def on_train_begin(self, logs):
        if self.ema is None:
            self.ema = jax.tree.map(jnp.copy, self.params())
            if self.seen is not None:
                self.seen.append(jax.device_get(self.ema))

    def on_train_batch_end(self, step, logs):
        params = self.params()
        self.ema = _ema_update(self.ema, params)
        self.updates += 1
        if self.seen is not None:
            self.seen.append(jax.device_get(params))

    def state_dict(self):
        ema = self.ema
        if ema is None and self.layout_first:
            ema = nnx.to_pure_dict(
                nnx.filter_state(self.trainer.plan.state_targets()["model"], nnx.Param)
            )
        return {"ema": ema, "decay": 0.75, "updates": self.updates}

    def load_state_dict(self, state):
        self.ema, self.updates = state["ema"], state["updates"]
        self.restored_shardings = jax.tree.map(lambda x: x.sharding, self.ema)


def flat(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): np.asarray(jax.device_get(x)) for p, x in leaves}


def reference_ema(seen: list) -> dict[str, np.ndarray]:
    """The EMA in NumPy from the parameters after each step: the independent computation."""
    ema = flat(seen[0])
    for step_params in seen[1:]:
        ema = {
            k: np.float32(0.75) * ema[k] + np.float32(0.25) * v
            for k, v in flat(step_params).items()
        }
    return ema


@pytest.fixture(scope="module")
def uninterrupted_ema() -> tuple[dict[str, np.ndarray], int, dict[str, np.ndarray]]:
    """The run that never crashed, checked against the NumPy EMA: (its EMA, the EMA's
    updates, its parameters). It does not depend on the layout case, so it runs once."""
    whole = EMA(record=True)
    uninterrupted = trainer_for(callbacks=[whole])
    uninterrupted.fit(grain_data(), max_steps=9)
    expected = flat(whole.ema)
    np.testing.assert_equal(expected.keys(), reference_ema(whole.seen).keys())
    for key, value in reference_ema(whole.seen).items():
        np.testing.assert_allclose(expected[key], value, rtol=1e-6, atol=1e-7, err_msg=key)
    return expected, whole.updates, params(uninterrupted)


@pytest.mark.parametrize("layout_first", [True, False], ids=["layout-before-arrays", "none-yet"])
def test_an_ema_of_the_weights_resumes_bitwise_after_a_crash(
    tmp_path, layout_first, uninterrupted_ema
):
    data = grain_data()
    expected, whole_updates, whole_params = uninterrupted_ema

    crashed = trainer_for(
        callbacks=[OrbaxCheckpoint(tmp_path, save_every_n_steps=3), EMA(layout_first), Crash(8)]
    )
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit(data, max_steps=9)
    assert OrbaxCheckpoint(tmp_path).steps() == [3, 6]
    assert not list(tmp_path.glob("*orbax-checkpoint-tmp*"))

    ema = EMA(layout_first)
    checkpoint = OrbaxCheckpoint(tmp_path, save_every_n_steps=3)
    resumed = trainer_for(callbacks=[checkpoint, ema])
    resumed.fit(data, max_steps=9)
    assert checkpoint.restored_step == 6 and ema.updates == whole_updates == 9
    assert_bitwise(flat(ema.ema), expected)
    assert_bitwise(params(resumed), whole_params)
    param_shardings = jax.tree.map(lambda x: x.sharding, ema.params())
    if layout_first:  # read straight into the parameters' layout
        assert ema.restored_shardings == param_shardings
    else:  # nothing to read into: replicated on the mesh
        assert all(s == resumed.plan.replicated for s in jax.tree.leaves(ema.restored_shardings))


class Holding(Callback):
    """A callback whose state holds ``value`` at ``state_dict()['info']['value']``."""

    def __init__(self, value) -> None:
        self.value = value
        self.loaded = None

    def state_dict(self):
        return {"info": {"value": self.value, "n": 1}}

    def load_state_dict(self, state):
        self.loaded = state


@pytest.mark.parametrize(
    "value, named",
    [
        ({1, 2}, "a builtins.set"),
        (object(), "a builtins.object"),
        ({3: 1.0}, "a dict key of type int"),
    ],
    ids=["set", "object", "int-key"],
)
def test_a_callback_state_that_cannot_be_stored_is_refused_at_the_first_save(
    tmp_path, value, named
):
    holding = Holding(value)
    holding.state_key = "holder"
    trainer = trainer_for(
        callbacks=[OrbaxCheckpoint(tmp_path, save_every_n_steps=2), holding], model=Net
    )
    path = r"\['info'\]\['value'\]" + (r"\[3\]" if isinstance(value, dict) else "")
    with pytest.raises(
        TypeError, match=rf"callback 'holder' holds {named} at state_dict\(\){path}"
    ):
        trainer.fit(make_batches(8), max_steps=8)
    assert trainer.step == 2  # the first save, not a later step
    assert OrbaxCheckpoint(tmp_path).steps() == []
    assert not list(tmp_path.glob("*orbax-checkpoint-tmp*"))


def test_plain_values_and_numpy_come_back_with_their_types(tmp_path):
    value = {
        "none": None, "flag": True, "count": 3, "ratio": 0.5, "name": "x", "pair": (1, "a"),
        "nested": [{"k": [1.5, None]}], "np_scalar": np.float32(2.5),
        "np_array": np.arange(4, dtype=np.int64), "np_zero_d": np.array(7, np.int32),
        "on_device": jnp.arange(3.0), "key": jax.random.key(3),
    }  # fmt: skip
    writer = Holding(value)
    trainer_for(callbacks=[OrbaxCheckpoint(tmp_path), writer], model=Net).fit(
        make_batches(2), max_steps=2
    )
    reader = Holding(None)
    OrbaxCheckpoint(tmp_path).restore_into(trainer_for(callbacks=[reader], model=Net))
    got = reader.loaded["info"]["value"]
    assert got.keys() == value.keys()
    for key in ("none", "flag", "count", "ratio", "name", "nested"):
        assert got[key] == value[key] and type(got[key]) is type(value[key]), key
    assert got["pair"] == [1, "a"]  # JSON has lists only
    assert type(got["np_scalar"]) is np.float32 and got["np_scalar"] == 2.5
    for key in ("np_array", "np_zero_d"):
        assert type(got[key]) is np.ndarray and got[key].dtype == value[key].dtype, key
        np.testing.assert_array_equal(got[key], value[key])
    assert isinstance(got["on_device"], jax.Array)
    np.testing.assert_array_equal(np.asarray(got["on_device"]), [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(
        jax.random.key_data(got["key"]), jax.random.key_data(value["key"])
    )


def test_a_changed_callback_array_fails_its_fingerprint(tmp_path):
    trainer_for(callbacks=[OrbaxCheckpoint(tmp_path), EMA()], model=Net).fit(
        make_batches(2), max_steps=2
    )
    item = tmp_path / "2" / "callback_arrays_0"
    checkpointer = ocp.StandardCheckpointer()
    saved = checkpointer.restore(item)
    checkpointer.save(item, jax.tree.map(lambda x: x * 1.5, saved), force=True)
    checkpointer.wait_until_finished()
    with pytest.raises(DamagedCheckpoint, match="do not match the fingerprints.*callback_arrays_0"):
        OrbaxCheckpoint(tmp_path, restore=2).restore_into(trainer_for(callbacks=[EMA()], model=Net))
    # A trainer without that callback does not read (or check) its arrays.
    assert OrbaxCheckpoint(tmp_path, restore=2).restore_into(trainer_for(model=Net)) == 2


# -- restoring for evaluation ------------------------------------------------------------------
def plain_trainer(strategy) -> Trainer:
    return Trainer(
        lambda r: Net(r), optax.adamw(1e-2), strategy=strategy, loss_fn=classification_loss
    )


def test_restore_into_a_fresh_trainer_of_another_strategy_evaluates_as_the_trained_one(
    tmp_path, monkeypatch
):
    batches, held_out = make_batches(6), make_batches(3, seed=1)
    trained = trainer_for(
        FSDP_TP, [OrbaxCheckpoint(tmp_path, save_every_n_steps=2), EMA()], model=Net
    )
    trained.fit(batches[:2], max_steps=2)
    at_2 = params(trained)
    trained.fit(batches, max_steps=5)
    expected = trained.evaluate(held_out)

    for strategy in (DataParallel(), FSDP(min_size=64)):
        fresh = plain_trainer(strategy)  # no checkpoint callback, no EMA: restored all the same
        monkeypatch.setattr(
            fresh.plan, "materialize", lambda: pytest.fail("the initial state was built")
        )
        checkpoint = OrbaxCheckpoint(tmp_path)
        assert checkpoint.restore_into(fresh) == 5 == checkpoint.restored_step
        assert fresh.step == 5
        assert_bitwise(params(fresh), params(trained))
        got = fresh.evaluate(held_out)
        assert got.keys() == expected.keys()
        np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-6)

    # A chosen step; the directory is only read: nothing later is moved aside.
    before = sorted(p.name for p in tmp_path.iterdir())
    older = plain_trainer(DataParallel())
    assert OrbaxCheckpoint(tmp_path, restore=2).restore_into(older) == 2 and older.step == 2
    assert_bitwise(params(older), at_2)
    by_path = plain_trainer(DataParallel())  # a step directory, of any run
    assert OrbaxCheckpoint(tmp_path / "other", restore=tmp_path / "2").restore_into(by_path) == 2
    assert_bitwise(params(by_path), at_2)
    assert sorted(p.name for p in tmp_path.iterdir()) == before

    empty = OrbaxCheckpoint(tmp_path / "none")
    assert empty.restore_into(plain_trainer(DataParallel())) is None
    assert empty.restored_step is None and not (tmp_path / "none").exists()


def test_restore_into_then_fit_goes_on_from_the_restored_step(tmp_path):
    data = grain_data()
    uninterrupted = trainer_for(model=Net)
    uninterrupted.fit(data, max_steps=7)
    trainer_for(callbacks=[OrbaxCheckpoint(tmp_path, save_every_n_steps=3)], model=Net).fit(
        data, max_steps=4
    )
    checkpoint = OrbaxCheckpoint(tmp_path, restore=3, save_every_n_steps=3)
    resumed = trainer_for(callbacks=[checkpoint], model=Net)
    assert checkpoint.restore_into(resumed) == 3
    assert Path(tmp_path / "4").is_dir()  # restore_into only reads
    resumed.fit(data, max_steps=7)  # no second restore; step 4 is moved aside as fit would
    assert checkpoint.restored_step == 3 and (tmp_path / "4.after-3").is_dir()
    assert checkpoint.steps() == [3, 6, 7]
    assert_bitwise(params(resumed), params(uninterrupted))
