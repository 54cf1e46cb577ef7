"""A checkpoint of unrolled GPT blocks is not loaded into scanned ones, nor the reverse: the
error names both forms and the setting that resumes it, and the step stays where it is.
Converting a run state between the forms (``gpt.stack_blocks``) trains on as before."""

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import environment_for_own_devices
from flax import nnx

from nnx_spmd_trainer import FSDP, Hybrid, TensorParallel, Trainer
from nnx_spmd_trainer.app.models import GPT, gpt
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint

VOCAB, SEQ = 16, 8
pytestmark = pytest.mark.slow  # three short runs and three resumes (~2 minutes here)


def trainer(directory, *, scan_layers, callbacks=None):
    def model(rngs: nnx.Rngs) -> GPT:
        return GPT(
            vocab_size=VOCAB, seq_len=SEQ, embed_dim=16, num_heads=4, ff_dim=32, num_layers=2,
            dropout_rate=0.0, rngs=rngs, scan_layers=scan_layers,
        )  # fmt: skip

    return Trainer(
        model,
        optax.adam(1e-3),
        strategy=Hybrid(FSDP(4), TensorParallel(2)),
        loss_fn=gpt.loss_fn,
        callbacks=[OrbaxCheckpoint(directory)] if callbacks is None else callbacks,
    )


def batches():
    window = np.random.default_rng(0).integers(0, VOCAB, size=(8, SEQ + 1), dtype=np.int32)
    return [{"inputs": window[:, :-1], "targets": window[:, 1:]}]


@pytest.mark.parametrize(
    ("saved_scanned", "saved", "here"),
    [
        (False, "unrolled (model/blocks/0/", "stacked (model/blocks/"),
        (True, "stacked (model/blocks/", "unrolled (model/blocks/0/"),
    ],
    ids=["unrolled-into-scanned", "scanned-into-unrolled"],
)
def test_a_checkpoint_of_the_other_layer_form_is_a_clear_error(
    tmp_path, saved_scanned, saved, here
):
    trainer(tmp_path, scan_layers=saved_scanned).fit(batches(), max_steps=1)
    resumed = trainer(tmp_path, scan_layers=not saved_scanned)
    with pytest.raises(ValueError) as error:
        resumed.fit(batches(), max_steps=2)
    message = str(error.value)
    assert "written for another model" in message
    assert re.search(r"only in the checkpoint \(model/blocks/", message)
    assert re.search(r"only in this model \(model/blocks/", message)
    assert f"The checkpoint holds the layers {saved}" in message
    assert f"this model {here}" in message
    assert f"--config.gpt.scan_layers={saved_scanned}) to resume it" in message
    assert OrbaxCheckpoint(tmp_path).steps() == [1]  # not mistaken for damage
    assert resumed.step == 0  # nothing was loaded


def test_the_cli_says_it_in_one_line(tmp_path):
    """Through the command: exit 2 (the config does not match the workdir), one line, no
    traceback, and the step stays."""
    tiny = ["--config.gpt.embed_dim=32", "--config.gpt.ff_dim=64", "--config.gpt.num_layers=2",
            "--config.batch_size=16", "--config.max_eval_batches=1", "--workdir=out"]  # fmt: skip
    env = environment_for_own_devices()  # the CLI sets 8 devices

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "nnx_spmd_trainer", *tiny, *args]
        return subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )

    first = cli("--config.max_steps=1")
    assert first.returncode == 0, first.stderr[-3000:]
    # The longer run re-plans the schedule, which is refused on its own (test_cli_newcomer):
    # allowed here, so the model mismatch is what stops the resume.
    resumed = cli(
        "--config.max_steps=2", "--config.replan_schedule=True", "--config.gpt.scan_layers=True"
    )
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    (line,) = [x for x in resumed.stderr.splitlines() if x.startswith("nnx-spmd-train: error:")]
    assert "written for another model" in line
    assert "--config.gpt.scan_layers=False) to resume it" in line
    assert OrbaxCheckpoint(tmp_path / "out" / "checkpoints").steps() == [1]


def host(x):
    """``x`` as NumPy; an RNG key as its key data."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(jax.device_get(x))


def test_a_trained_unrolled_state_stacked_trains_on_as_the_unrolled_one():
    """``gpt.stack_blocks`` over a whole run state (parameters and Adam's moments): the
    scanned model trained on from it equals the unrolled one trained on, and
    ``unstack_blocks`` gives the unrolled state back exactly."""
    data = batches() * 3
    unrolled = trainer(None, scan_layers=False, callbacks=[])
    unrolled.fit(data[:2], max_steps=2)
    saved = jax.tree.map(jnp.copy, nnx.to_pure_dict(unrolled.state))  # steps donate theirs
    scanned = trainer(None, scan_layers=True, callbacks=[])
    target = scanned.state
    nnx.replace_by_pure_dict(target, gpt.stack_blocks(saved))
    scanned.state = target
    assert scanned.step == 2
    back = gpt.unstack_blocks(nnx.to_pure_dict(scanned.state), num_layers=2)
    for (path, a), (saved_path, b) in zip(
        nnx.traversals.flatten_mapping(back).items(),
        nnx.traversals.flatten_mapping(saved).items(),
        strict=True,
    ):
        assert path == saved_path
        np.testing.assert_array_equal(host(a), host(b), err_msg=str(path))
    unrolled.fit(data, max_steps=4)
    scanned.fit(data, max_steps=4)
    ours = gpt.unstack_blocks(nnx.to_pure_dict(nnx.state(scanned.model, nnx.Param)), 2)
    want = nnx.to_pure_dict(nnx.state(unrolled.model, nnx.Param))
    flat_want = nnx.traversals.flatten_mapping(want)
    for path, value in nnx.traversals.flatten_mapping(ours).items():
        if path[-2:] == ("key", "bias"):
            # Its true gradient is zero (a softmax ignores a shift shared by all keys), so
            # Adam turns rounding noise into steps of up to lr: bounded by two steps.
            np.testing.assert_allclose(value, flat_want[path], atol=2 * 1e-3, err_msg=str(path))
            continue
        np.testing.assert_allclose(value, flat_want[path], rtol=1e-5, atol=1e-6, err_msg=str(path))
