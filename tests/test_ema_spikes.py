"""Issue 40, parts 2-3: EMA weights and loss/grad-norm spike skipping, on the devices, in the
optimizer's state and so in every checkpoint.

The references are independent: a one-device plain optax loop over the same batches whose
EMA and spike rule are written out here in NumPy (``reference_run``), never the library's
wrappers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from toy_models import Net, classification_loss, flat_params, make_batches

from nnx_spmd_trainer import EMA, FSDP, Hybrid, SpikeSkip, TensorParallel, Trainer
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint
from nnx_spmd_trainer.optim.ema import find_average
from nnx_spmd_trainer.optim.spikes import find_spike_state

FSDP_TP = Hybrid(FSDP(4, min_size=1), TensorParallel(2))
OUTLIER = 6  # the batch of step 7: its loss and gradients are 30x a normal step's
RULE = SpikeSkip(z=3.0, window=4, min_steps=3)


def scaled_loss(model, batch):
    loss, aux = classification_loss(model, batch)
    return loss * batch["scale"].mean(), aux


def batches(n: int, outliers: tuple[int, ...] = (OUTLIER,)) -> list[dict[str, np.ndarray]]:
    made = make_batches(n)
    for i, batch in enumerate(made):
        batch["scale"] = np.full((16,), 30.0 if i in outliers else 1.0, np.float32)
    return made


def reference_run(tx, made, *, decay=None, rule=None):
    """Plain optax on one device. ``decay``: the EMA (warmup as documented) in NumPy after
    each update; ``rule``: the spike rule in NumPy over the accepted steps' losses and
    gradient norms. Returns (params, ema, skipped step indices), as flat NumPy dicts."""
    device = jax.devices()[0]
    with jax.default_device(device), nnx.use_eager_sharding(False):
        graphdef, params, rest = nnx.split(Net(nnx.Rngs(0)), nnx.Param, ...)
        params = jax.device_put(params, device)
        opt_state = tx.init(params)

        @jax.jit
        def grad(p, batch):
            return jax.value_and_grad(
                lambda q: scaled_loss(nnx.merge(graphdef, q, rest), batch)[0]
            )(p)

        ema = flat_params(params)
        losses, norms, skipped, count = [], [], [], 0
        for i, batch in enumerate(made):
            loss, grads = grad(params, batch)
            loss = float(loss)
            norm = float(
                np.sqrt(sum(np.sum(np.square(np.asarray(g))) for g in jax.tree.leaves(grads)))
            )
            if rule is not None and len(losses) >= rule.least_steps:
                spike = False
                for value, seen in ((loss, losses), (norm, norms)):
                    last = np.asarray(seen[-rule.window :], np.float64)
                    std = max(last.std(), 1e-6 * abs(last.mean()))
                    spike |= value > last.mean() + rule.z * std
                if spike:
                    skipped.append(i)
                    continue
            losses.append(loss)
            norms.append(norm)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            if decay is not None:
                d = np.float32(min(decay, (1 + count) / (10 + count)))
                ema = {
                    k: d * ema[k] + (np.float32(1) - d) * v for k, v in flat_params(params).items()
                }
            count += 1
    return flat_params(params), ema, skipped


def ema_of(trainer: Trainer) -> dict[str, np.ndarray]:
    average = find_average(trainer.optimizer.opt_state)
    assert average is not None
    return flat_params(average.ema)


def spike_arrays(trainer: Trainer) -> dict[str, np.ndarray]:
    state = find_spike_state(trainer.optimizer.opt_state)
    assert state is not None
    return {
        name: np.asarray(jax.device_get(getattr(state, name).get_value()))
        for name in ("losses", "grad_norms", "seen", "skipped", "in_a_row")
    }


def assert_close(got: dict, want: dict, tol: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=tol, atol=tol, err_msg=key)


@pytest.fixture(scope="module")
def ema_run() -> Trainer:
    trainer = Trainer(
        Net, optax.adam(1e-2), strategy=FSDP_TP, loss_fn=scaled_loss, ema=EMA(decay=0.9)
    )
    trainer.fit(batches(6, outliers=()), max_steps=6)
    return trainer


def test_ema_under_fsdp_x_tp_equals_a_one_device_optax_loop_keeping_the_same_average(ema_run):
    params, ema, _ = reference_run(optax.adam(1e-2), batches(6, outliers=()), decay=0.9)
    assert_close(flat_params(nnx.state(ema_run.model, nnx.Param)), params, 1e-5)
    assert_close(ema_of(ema_run), ema)
    assert not all(np.allclose(ema[k], params[k]) for k in ema)  # an average, not a copy


def test_the_ema_leaves_have_their_parameters_specs(ema_run):
    specs = {
        "/".join(map(str, path)): v.get_value().sharding.spec
        for path, v in nnx.to_flat_state(nnx.state(ema_run.model, nnx.Param))
    }
    average = find_average(ema_run.optimizer.opt_state)
    got = {
        "/".join(map(str, path)): v.get_value().sharding.spec
        for path, v in nnx.to_flat_state(average.ema)
    }
    assert got == specs
    assert any("model" in str(s) for s in specs.values())  # TP splits some of them
    assert any("fsdp" in str(s) for s in specs.values())  # and FSDP others


def test_ema_weights_swaps_the_average_in_for_evaluation_and_back(ema_run, tmp_path):
    trained = flat_params(nnx.state(ema_run.model, nnx.Param))
    data = batches(2, outliers=())
    with ema_run.ema_weights():
        assert_close(flat_params(nnx.state(ema_run.model, nnx.Param)), ema_of(ema_run), 0)
        on_average = ema_run.evaluate(data)["loss"]
        ema_run.export(tmp_path / "ema")
    assert_close(flat_params(nnx.state(ema_run.model, nnx.Param)), trained, 0)
    assert on_average != pytest.approx(ema_run.evaluate(data)["loss"], rel=1e-4)
    exported = (
        __import__("orbax.checkpoint").checkpoint.PyTreeCheckpointer().restore(tmp_path / "ema")
    )
    np.testing.assert_array_equal(exported["l1"]["kernel"], ema_of(ema_run)["l1/kernel"])


def test_a_trainer_without_ema_says_how_to_ask_for_it():
    trainer = Trainer(Net, optax.sgd(0.1), loss_fn=classification_loss)
    with pytest.raises(ValueError, match=r"ema=EMA\(decay=0.999\)"), trainer.ema_weights():
        pass


def test_bad_settings_name_the_fix():
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\)"):
        EMA(decay=1.0)
    with pytest.raises(ValueError, match=r"window=1 must be an int >= 2"):
        SpikeSkip(window=1)
    with pytest.raises(ValueError, match=r"min_steps=9 must be in \[2, window=4\]"):
        SpikeSkip(window=4, min_steps=9)
    with pytest.raises(TypeError, match=r"skip_spikes must be a SpikeSkip"):
        Trainer(Net, optax.sgd(0.1), loss_fn=classification_loss, skip_spikes=3.0)


def spike_trainer(**settings) -> Trainer:
    """Adam under FSDP x TP with the EMA and the spike rule (what the reference runs)."""
    return Trainer(Net, optax.adam(1e-2), strategy=FSDP_TP, loss_fn=scaled_loss,
                   ema=EMA(decay=0.9), skip_spikes=RULE, **settings)  # fmt: skip


@pytest.fixture(scope="module")
def spike_run(tmp_path_factory) -> tuple[Trainer, dict, Path]:
    directory = tmp_path_factory.mktemp("spikes")
    trainer = spike_trainer(
        log_every_n_steps=5,
        track_norms=False,  # the count is logged without the norms
        callbacks=[OrbaxCheckpoint(directory, save_every_n_steps=5)],
    )
    history = trainer.fit(batches(10), max_steps=10)
    return trainer, history.history, directory


def test_an_outlier_batch_is_skipped_like_a_one_device_loop_skipping_it(spike_run):
    trainer, history, _ = spike_run
    made = batches(10)
    params, ema, skipped = reference_run(optax.adam(1e-2), made, decay=0.9, rule=RULE)
    assert skipped == [OUTLIER]  # the reference's own rule: the outlier and nothing else
    assert history["train/skipped_spikes"] == [0.0, 1.0]  # logged at steps 5 and 10
    assert_close(flat_params(nnx.state(trainer.model, nnx.Param)), params, 1e-5)
    assert_close(ema_of(trainer), ema)  # the average skipped the step too
    assert trainer.step == 10 and int(trainer.optimizer.step[...]) == 10  # the count moved on
    assert int(spike_arrays(trainer)["seen"]) == 9
    # Trained on, the outlier would have left other weights: the skip is what matched.
    unskipped, _, _ = reference_run(optax.adam(1e-2), made)
    assert not np.allclose(unskipped["l1/kernel"], params["l1/kernel"], atol=1e-3)


def test_the_statistics_and_the_average_survive_a_checkpoint_round_trip(spike_run):
    trained, _, directory = spike_run
    restored = spike_trainer()
    assert OrbaxCheckpoint(directory).restore_into(restored) == 10
    want, got = spike_arrays(trained), spike_arrays(restored)
    assert int(got["skipped"]) == 1 and int(got["seen"]) == 9
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert_close(ema_of(restored), ema_of(trained), 0)


# -- kill -9 after a checkpoint, then resume: bitwise ------------------------------------
SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import jax, numpy as np, optax
from flax import nnx
from test_checkpoint import Dropped, FSDP_TP, grain_data
from test_ema_spikes import ema_of, spike_arrays
from toy_models import classification_loss, flat_params
from nnx_spmd_trainer import EMA, Callback, SpikeSkip, Trainer
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint

directory, kill_at, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
checkpoint = OrbaxCheckpoint(directory, save_every_n_steps=3)

class Kill(Callback):
    def on_step_end(self, step):
        if step == kill_at:
            checkpoint.manager.wait_until_finished()
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no final save

trainer = Trainer(lambda r: Dropped(r), optax.adamw(1e-2), strategy=FSDP_TP,
                  loss_fn=classification_loss, callbacks=[checkpoint, Kill()],
                  ema=EMA(decay=0.9), skip_spikes=SpikeSkip(z=0.5, window=4, min_steps=2))
trainer.fit(grain_data(), epochs=3)
arrays = {{"params." + k: v for k, v in flat_params(nnx.state(trainer.model, nnx.Param)).items()}}
arrays.update({{"ema." + k: v for k, v in ema_of(trainer).items()}})
arrays.update({{"spikes." + k: v for k, v in spike_arrays(trainer).items()}})
arrays = {{k.replace("/", "."): v for k, v in arrays.items()}}
np.savez(out, first=checkpoint.restored_step or 0, **arrays)
"""


def run_script(directory: Path, kill_at: int, out: Path) -> subprocess.CompletedProcess[str]:
    script = SCRIPT.format(tests=str(Path(__file__).parent))
    args = [sys.executable, "-c", script, str(directory), str(kill_at), str(out)]
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=os.environ)


@pytest.mark.serial
def test_a_run_killed_after_a_checkpoint_resumes_its_average_and_statistics_bitwise(tmp_path):
    whole = run_script(tmp_path / "whole", 0, tmp_path / "whole.npz")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = run_script(tmp_path / "ckpt", 8, tmp_path / "x.npz")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run_script(tmp_path / "ckpt", 0, tmp_path / "resumed.npz")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = np.load(tmp_path / "whole.npz"), np.load(tmp_path / "resumed.npz")
    assert int(b["first"]) == 6  # resumed mid-epoch 2, from the save at step 6
    assert int(a["spikes.skipped"]) > 0  # z=0.5: some steps were skipped, so the test bites
    assert a.files == b.files
    for key in a.files:
        if key != "first":
            np.testing.assert_array_equal(b[key], a[key], err_msg=key)


def test_the_cli_keys_make_the_settings_and_a_bad_one_names_its_key():
    from nnx_spmd_trainer.app.run_config import ConfigError, averaging_and_spikes
    from nnx_spmd_trainer.configs._base import training_config

    config = training_config()
    assert averaging_and_spikes(config) == {"ema": None, "skip_spikes": None}  # off by default
    config.ema_decay, config.skip_spikes_z, config.skip_spikes_window = 0.99, 4.0, 50
    assert averaging_and_spikes(config) == {
        "ema": EMA(decay=0.99),
        "skip_spikes": SpikeSkip(z=4.0, window=50, min_steps=20),
    }
    config.ema_decay = 1.0
    with pytest.raises(ConfigError, match=r"^config\.ema_decay=1\.0: .*decay must be in"):
        averaging_and_spikes(config)
