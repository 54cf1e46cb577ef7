"""export_params: trained, sharded parameters that plain Orbax loads with no code of ours."""

import inspect
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import environment_for_own_devices
from flax import nnx
from toy_models import Net, classification_loss, flat_params, make_batches, train_reference

from nnx_spmd_trainer import FSDP, Hybrid, TensorParallel, Trainer, export_params


def docstring_snippet() -> str:
    """The loading snippet of ``export_params``'s docstring: the indented block after ``::``."""
    lines = inspect.cleandoc(export_params.__doc__ or "").splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith("::")) + 1
    block = []
    for line in lines[start:]:
        if line.strip() and not line.startswith(" "):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block)).strip("\n")


#: Runs the docstring's snippet with ``path`` = argv[1]; writes the arrays to the .npz argv[2].
PLAIN_ORBAX = f"""
import sys
path = sys.argv[1]
{docstring_snippet()}
import numpy as np

assert "flax" not in sys.modules and "nnx_spmd_trainer" not in sys.modules, "imported our code"
flat = {{}}


def walk(prefix, tree):
    for key, value in tree.items():
        assert isinstance(key, str), key
        if isinstance(value, dict):
            walk(prefix + key + "/", value)
        else:
            assert type(value) is np.ndarray, (prefix + key, type(value))
            flat[prefix + key] = value


walk("", params)
np.savez(sys.argv[2], **flat)
"""


def load_in_plain_orbax(path, tmp_path) -> dict[str, np.ndarray]:
    """Restores ``path`` in a fresh interpreter that imports only orbax.checkpoint and numpy."""
    env = environment_for_own_devices()  # one plain CPU device
    out = tmp_path / "restored.npz"
    proc = subprocess.run(
        [sys.executable, "-c", PLAIN_ORBAX, str(path), str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out) as restored:
        return dict(restored)


def test_the_snippet_is_plain_orbax():
    snippet = docstring_snippet()
    assert "import orbax.checkpoint as ocp" in snippet
    assert "params = ocp.PyTreeCheckpointer().restore(path)" in snippet
    assert "nnx_spmd_trainer" not in snippet and "flax" not in snippet


def test_sharded_trained_parameters_load_in_plain_orbax(tmp_path):
    batches = make_batches(3)
    trainer = Trainer(
        lambda r: Net(r),
        optax.adam(1e-2),
        strategy=Hybrid(FSDP(4, min_size=64), TensorParallel(2)),
        loss_fn=classification_loss,
    )
    trainer.fit(batches, max_steps=3)
    kernel = trainer.model.l1.kernel.get_value()
    assert len(kernel.sharding.device_set) == 8 and not kernel.sharding.is_fully_replicated

    path = export_params(trainer.model, tmp_path / "export")
    assert path == (tmp_path / "export").absolute()

    restored = load_in_plain_orbax(path, tmp_path)
    trained = flat_params(nnx.state(trainer.model, nnx.Param))
    reference = flat_params(train_reference(lambda r: Net(r), optax.adam(1e-2), batches)[0])
    assert restored.keys() == trained.keys() == reference.keys()
    assert "l1/kernel" in restored and "norm/scale" in restored
    for key, value in restored.items():
        assert value.dtype == trained[key].dtype, key
        np.testing.assert_array_equal(value, trained[key], err_msg=key)
        np.testing.assert_allclose(value, reference[key], rtol=1e-4, atol=1e-5, err_msg=key)


class Stack(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])
        self.dropout = nnx.Dropout(0.5, rngs=rngs)  # RNG state: not a parameter


def test_layer_list_indices_are_string_keys_and_only_params_are_written(tmp_path):
    model = Stack(nnx.Rngs(0))
    path = export_params(model, tmp_path / "export")
    params = ocp.PyTreeCheckpointer().restore(path)
    assert params.keys() == {"layers"}
    assert params["layers"].keys() == {"0", "1"}
    np.testing.assert_array_equal(
        params["layers"]["1"]["kernel"], np.asarray(model.layers[1].kernel.get_value())
    )


def test_refuses_to_overwrite_without_overwrite(tmp_path):
    model = Stack(nnx.Rngs(0))
    path = tmp_path / "export"
    path.mkdir()  # an empty directory is fine
    export_params(model, path)
    before = sorted(p.name for p in path.rglob("*"))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_params(Stack(nnx.Rngs(1)), path)
    assert sorted(p.name for p in path.rglob("*")) == before  # untouched
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not an empty directory"):
        export_params(model, tmp_path / "file")

    other = Stack(nnx.Rngs(1))
    export_params(other, path, overwrite=True)
    kernel = ocp.PyTreeCheckpointer().restore(path)["layers"]["0"]["kernel"]
    np.testing.assert_array_equal(kernel, np.asarray(other.layers[0].kernel.get_value()))


def _cli(*args, cwd):
    env = environment_for_own_devices()  # the CLI sets it
    return subprocess.run(
        [sys.executable, "-m", "nnx_spmd_trainer", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_cli_exports_the_trained_mlp(tmp_path):
    args = (
        "--config=mlp",
        "--config.max_steps=3",
        "--config.batch_size=16",
        "--config.log_every_n_steps=1",
        "--config.eval_every_n_steps=0",
        "--config.max_eval_batches=1",
        f"--workdir={tmp_path}",
        f"--export={tmp_path / 'export'}",
    )
    proc = _cli(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final after 3 steps" in proc.stdout
    assert f"parameters exported to {tmp_path / 'export'}" in proc.stdout
    assert "PyTreeCheckpointer().restore(" in proc.stdout

    # The CLI writes with export_params, whose output loads in a fresh interpreter with
    # only Orbax (test_sharded_trained_parameters_load_in_plain_orbax): here, what it wrote.
    params = ocp.PyTreeCheckpointer().restore(tmp_path / "export")
    restored = {f"{layer}/{k}": np.asarray(v) for layer, d in params.items() for k, v in d.items()}
    assert {k: v.shape for k, v in restored.items()} == {
        "fc1/kernel": (32, 256),
        "fc1/bias": (256,),
        "fc2/kernel": (256, 8),
        "fc2/bias": (8,),
    }
    assert all(np.isfinite(v).all() for v in restored.values())
    # A second run onto the export is refused before training: the same check_export_path
    # refusal as test_cli_config_errors.test_an_occupied_export_path_is_one_line_exit_2.


@pytest.mark.slow
def test_the_cli_exports_the_average_of_the_weights_with_export_ema(tmp_path):
    """``--export_ema`` writes the EMA the run's last checkpoint holds in its optimizer
    state, not the trained parameters the same checkpoint holds."""
    args = ("--config=mlp", "--config.max_steps=3", "--config.batch_size=16",
            "--config.eval_every_n_steps=0", "--config.max_eval_batches=1",
            "--config.ema_decay=0.5", f"--workdir={tmp_path / 'run'}",
            f"--export={tmp_path / 'export'}", "--export_ema")  # fmt: skip
    proc = _cli(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"the average of the parameters (EMA) exported to {tmp_path / 'export'}" in (proc.stdout)
    exported = ocp.PyTreeCheckpointer().restore(tmp_path / "export")
    # The checkpoint of step 3, read with plain Orbax: the model's and the average's leaves.
    step = tmp_path / "run" / "checkpoints" / "3" / "state"
    saved = ocp.PyTreeCheckpointer().restore(step)
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(saved)}
    for layer, params in exported.items():
        for name, value in params.items():
            trained = [v for k, v in flat.items() if k.startswith("['model']") and
                       f"['{layer}']['{name}']" in k]  # fmt: skip
            average = [v for k, v in flat.items() if "['ema']" in k and
                       f"['{layer}']['{name}']" in k]  # fmt: skip
            assert len(trained) == 1 and len(average) == 1, (layer, name, sorted(flat))
            np.testing.assert_array_equal(np.asarray(value), np.asarray(average[0]))
            assert not np.array_equal(np.asarray(value), np.asarray(trained[0]))
