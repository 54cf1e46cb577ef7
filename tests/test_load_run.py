"""``app.load_run``: one way from a workdir to a model, and every command reading a run
through it (``generate``, ``evaluate``, ``lm_eval``, ``init_from``). A DPO run's model is
read whatever metrics and optimizer it kept, equal to Orbax's own read of the step; a
damaged newest step is said in one line and the step before read; a step that cannot be
read as the model is an error in every command, never fresh weights."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from nnx_spmd_trainer import callbacks, path_str
from nnx_spmd_trainer.app import datasets, evaluate, generate, job, load_run, loader, tasks
from nnx_spmd_trainer.app import post_training_job as post_training

WORDS = ["red", "blue", "green", "gold", "pink", "gray", "teal", "navy"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def dpo_config(pairs: Path, **keys):
    from nnx_spmd_trainer.configs import dpo

    config = dpo.get_config()
    config.update(max_steps=2, checkpoint_every_n_steps=1, log_every_n_steps=1, loggers="csv")
    config.update(**keys)
    config.data.preferences = str(pairs)
    return config


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory) -> Path:
    """A DPO run of the dpo config's GPT (tiny), saved at steps 1 and 2: read, never written."""
    base = tmp_path_factory.mktemp("load-run")
    rows = [
        {"prompt": f"say {WORDS[i % 8]}:", "chosen": f" {WORDS[i % 8]}", "rejected": " no"}
        for i in range(16)
    ]
    pairs = write_jsonl(base / "pairs.jsonl", rows)
    post_training.run(dpo_config(pairs), base / "dpo")
    return base / "dpo"


def copy_of(run: Path, where: Path) -> Path:
    shutil.copytree(run, where)
    return where


def damage(step_dir: Path) -> None:
    """Every array file of the step's state cut to half: Orbax cannot read it."""
    for data in (step_dir / "state" / "d").rglob("*"):
        if data.is_file():
            data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def orbax_params(step_dir: Path) -> dict[str, np.ndarray]:
    """The step's model parameters read by Orbax alone (no trainer, no layout)."""
    state = ocp.StandardCheckpointer().restore(step_dir / "state")
    leaves = jax.tree_util.tree_flatten_with_path(state["model"])[0]
    return {path_str(p): np.asarray(x) for p, x in leaves if "rngs" not in path_str(p)}


def named_params(model) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    return {path_str(p): np.asarray(x) for p, x in leaves}


# -- the builder ------------------------------------------------------------------------------
def test_a_dpo_runs_model_is_read_as_orbax_saved_it_in_any_layout_and_step(dpo_run):
    run = load_run(dpo_run)  # the newest step, the run's layout
    assert run.step == 2 and run.source == f"step 2 of {dpo_run}"
    assert dict(run.trainer.mesh.shape) == {"fsdp": 4, "model": 2}
    assert run.tokenizer is not None and run.config.post_training == "dpo"
    saved = orbax_params(dpo_run / "checkpoints" / "2")
    ours = named_params(run.model)
    assert ours.keys() == saved.keys() and ours
    for name, value in saved.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    other = load_run(dpo_run, step=1, strategy="fsdp=8")  # another step, another layout
    assert other.step == 1 and dict(other.trainer.mesh.shape) == {"fsdp": 8}
    earlier = orbax_params(dpo_run / "checkpoints" / "1")
    for name, value in named_params(other.model).items():
        np.testing.assert_array_equal(value, earlier[name], err_msg=name)
    assert any(not np.array_equal(earlier[k], saved[k]) for k in saved)  # it trained


def test_restore_into_a_trainer_of_other_metrics_raises_naming_them(dpo_run):
    """The plain job's trainer (its optimizer, its metrics) cannot take a DPO step whole:
    an error naming the metrics, never a warning and ``None`` (fresh weights)."""
    config = loader.run_config(dpo_run)
    layout = loader.layout_asked(config)
    task = tasks.build_task(
        datasets.from_config.run_tokenizer_config(config, dpo_run), shard=layout.shard
    )
    trainer = job.build_trainer(config, task, layout, [], None)
    checkpoint = callbacks.OrbaxCheckpoint(dpo_run / "checkpoints", print_fn=None)
    with pytest.raises(callbacks.CheckpointOfAnotherModel, match="other train metrics") as info:
        checkpoint.restore_into(trainer)
    assert "rewards" in str(info.value) and "load_run" in str(info.value)
    # A trainer of another optimizer: the same model, so the message says the optimizer
    # differs (not the layers' stacking, which is the same).
    reader = load_run(dpo_run).trainer  # optax.set_to_zero: no optimizer state
    with pytest.raises(callbacks.CheckpointOfAnotherModel, match="only the optimizer") as info:
        callbacks.OrbaxCheckpoint(dpo_run / "checkpoints", print_fn=None).restore_into(reader)
    assert "scan_layers" not in str(info.value)


# -- faults -----------------------------------------------------------------------------------
def test_generate_falls_back_past_a_damaged_step_in_one_line(dpo_run, tmp_path, capsys):
    run = copy_of(dpo_run, tmp_path / "run")
    damage(run / "checkpoints" / "2")
    argv = [str(run), "--prompt", "say red:", "--max_new_tokens", "3", "--json"]
    assert generate.main(argv) == 0
    out, err = capsys.readouterr()
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert row["source"] == f"step 1 of {run}"
    lines = err.strip().splitlines()
    assert len(lines) <= 3, err  # the damage, "generating from", the speed line
    (said,) = [line for line in lines if "checkpoint step 2" in line]
    assert "reading step 1 instead" in said
    assert "Exception ignored" not in err and "Traceback" not in err


def test_init_from_a_damaged_step_is_refused_before_anything_is_written(dpo_run, tmp_path):
    damaged = copy_of(dpo_run, tmp_path / "damaged")
    damage(damaged / "checkpoints" / "2")
    pairs = dpo_run.parent / "pairs.jsonl"  # the run's own
    new = tmp_path / "new"
    with pytest.raises(callbacks.DamagedCheckpoint, match="checkpoint step 2"):
        post_training.run(dpo_config(pairs, init_from=str(damaged)), new)
    assert not new.exists()  # no config.json, tokenizer.json, tb/, run lock


@pytest.fixture(scope="module")
def another_model(dpo_run, tmp_path_factory) -> Path:
    """The DPO run's checkpoints under a config.json of a wider model."""
    run = copy_of(dpo_run, tmp_path_factory.mktemp("another") / "run")
    record = json.loads((run / "config.json").read_text())
    record["gpt"]["embed_dim"] *= 2
    (run / "config.json").write_text(json.dumps(record))
    return run


def refused(main, argv, capsys) -> str:
    """The one error line of a refusal (exit 2); a library's own notice on stderr (lm_eval's
    and transformers' import-time lines) is not the command's."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    (line,) = [line for line in err if line.startswith("nnx-spmd-train: error: ")]
    assert not any("Traceback" in line for line in err), err
    return line


def test_a_step_of_another_model_is_an_error_in_generate_and_evaluate(another_model, capsys):
    line = refused(generate.main, [str(another_model), "--prompt", "say red:"], capsys)
    assert line.startswith("nnx-spmd-train: error: generate: ") and "another model" in line
    line = refused(evaluate.main, [str(another_model)], capsys)
    assert line.startswith("nnx-spmd-train: error: evaluate: ") and "another model" in line


def test_a_run_whose_every_step_is_damaged_is_an_error_not_fresh_weights(dpo_run, tmp_path, capsys):
    run = copy_of(dpo_run, tmp_path / "run")
    for step in (1, 2):
        damage(run / "checkpoints" / str(step))
    with pytest.raises(callbacks.DamagedCheckpoint, match="no earlier step"):
        load_run(run, print_fn=None)
    line = refused(evaluate.main, [str(run)], capsys)
    assert "checkpoint step 1" in line and "no earlier step" in line


# -- lm_eval ----------------------------------------------------------------------------------
TEXTS = [{"text": "say red: red"}, {"text": "say gold: no"}, {"text": "say teal: teal"}]


@pytest.fixture(scope="module")
def local_tasks(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tasks")
    write_jsonl(root / "texts.jsonl", TEXTS)
    (root / "words_rolling.yaml").write_text(
        f"task: words_rolling\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n"
        f"  data_files:\n    test: {root}/texts.jsonl\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: bits_per_byte\n"
    )
    return root


def bits_per_byte_by_hand(model, tokenizer) -> float:
    """lm_eval's bits per byte of TEXTS under ``model`` on one device: each text's
    log-probability from the end-of-text token on (one window: the texts are short),
    summed, over the texts' UTF-8 bytes, in bits."""
    total, size = 0.0, 0
    for doc in TEXTS:
        ids = [tokenizer.eos_id, *[int(t) for t in tokenizer.encode(doc["text"])]]
        logits = model(jnp.asarray([ids[:-1]], jnp.int32))[0].astype(jnp.float32)
        log_probs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        total += float(log_probs[np.arange(len(ids) - 1), ids[1:]].sum())
        size += len(doc["text"].encode("utf-8"))
    return -total / size / math.log(2)


def test_lm_eval_on_a_dpo_workdir_scores_its_checkpoint(dpo_run, local_tasks, capsys):
    pytest.importorskip("lm_eval")
    from nnx_spmd_trainer.app import harness

    argv = [str(dpo_run), "--tasks", "words_rolling", "--include_path", str(local_tasks)]
    assert harness.main([*argv, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    score = json.loads(out[-1])["words_rolling"]["bits_per_byte,none"]
    # The same checkpoint by hand: the model built on one device, its parameters from
    # Orbax's own read of the step, the text tokenized with the run's tokenizer.json.
    config = loader.run_config(dpo_run)
    task = tasks.build_task(datasets.from_config.run_tokenizer_config(config, dpo_run))
    tokenizer = task.splits.text_codec
    with nnx.use_eager_sharding(False):  # one device: the layout annotations unused
        model = task.model(nnx.Rngs(config.seed))
    model.eval()
    untrained = bits_per_byte_by_hand(model, tokenizer)
    saved = orbax_params(dpo_run / "checkpoints" / "2")
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    nnx.update(
        model,
        jax.tree.unflatten(treedef, [jnp.asarray(saved[path_str(p)]) for p, _ in leaves]),
    )
    by_hand = bits_per_byte_by_hand(model, tokenizer)
    assert score == pytest.approx(by_hand, rel=1e-5)
    assert abs(score - untrained) > 1e-3  # the checkpoint, not the initialization
    # A task it does not know: one line, exit 2, before the model is built.
    line = refused(
        harness.main, [*argv[:1], "--tasks", "nope", "--include_path", str(local_tasks)], capsys
    )
    assert line.startswith("nnx-spmd-train: error: lm_eval: --tasks: nope is not a task")


def test_lm_eval_on_a_step_of_another_model_is_an_error(another_model, local_tasks, capsys):
    pytest.importorskip("lm_eval")
    from nnx_spmd_trainer.app import harness

    argv = [str(another_model), "--tasks", "words_rolling", "--include_path", str(local_tasks)]
    line = refused(harness.main, argv, capsys)
    assert line.startswith("nnx-spmd-train: error: lm_eval: ") and "another model" in line


def test_a_lora_runs_adapters_are_read_with_its_base(tmp_path):
    """A LoRA run's model is its base and its trained adapters (B starts at zero: a fresh
    adapter would read back as zeros), each as Orbax saved it."""
    from test_cli import load, shrink

    config = shrink(load("default"))
    config.update(max_steps=1, checkpoint_every_n_steps=1, loggers="csv", strategy="fsdp=8")
    config.lora.rank = 2
    job.run(config, tmp_path / "lora")
    run = load_run(tmp_path / "lora", strategy="fsdp=4,model=2")
    saved = orbax_params(tmp_path / "lora" / "checkpoints" / "1")
    ours = named_params(run.model)
    adapters = [name for name in saved if name.endswith("lora_b")]
    assert adapters and ours.keys() == saved.keys()
    for name, value in saved.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    assert all(np.abs(saved[name]).max() > 0 for name in adapters)  # trained, not fresh


# Orbax's read coroutines as a failed restore leaves them: started, closed when collected,
# raising then (the "Exception ignored in: <coroutine object ...>" of a damaged step).
_READ = """
class _Pending:
    def __await__(self):
        yield  # a read not finished


async def _read_array_index_and_device_put():
    try:
        await _Pending()
    finally:
        raise ValueError("DATA_LOSS: the chunk cannot be read")
"""


def _left_in_flight(filename: str):
    """A coroutine of a module at ``filename``, started and then dropped."""
    namespace: dict = {}
    exec(compile(_READ, filename, "exec"), namespace)
    coroutine = namespace["_read_array_index_and_device_put"]()
    coroutine.send(None)  # suspended in the read: closing it raises
    return coroutine


def test_a_failed_read_drops_orbaxs_coroutines_and_no_other_unraisable(tmp_path, monkeypatch):
    import gc
    import sys

    from nnx_spmd_trainer.callbacks.checkpoint import step_reader

    seen: list = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(unraisable))
    with pytest.raises(callbacks.DamagedCheckpoint), step_reader.quiet_reads(tmp_path):
        orbax = [_left_in_flight("/site-packages/orbax/checkpoint/fake.py") for _ in range(3)]
        mine = _left_in_flight(str(tmp_path / "mine.py"))  # not Orbax's: reported
        del orbax, mine
        raise callbacks.DamagedCheckpoint("checkpoint step 2 cannot be read")
    gc.collect()
    assert sys.unraisablehook is not None and len(seen) == 1
    assert "mine.py" in seen[0].object.cr_code.co_filename
