"""``nnx-spmd-train generate``: continuations from a workdir's checkpoint and from a
safetensors file, checked against the trained model's own forward pass; bad input is
one line and exit status 2."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import tokenizers
from test_cli import load, shrink

from nnx_spmd_trainer import Sampler
from nnx_spmd_trainer.app import generate, job, job_export
from nnx_spmd_trainer.app.datasets.text import gpt2_byte_ranks

GPT2_BYTES = {int(rank): byte for byte, rank in enumerate(gpt2_byte_ranks())}  # id -> byte

PROMPT = "the cab"
NEW = 5


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 2-step gpt2_hf run (256 byte tokens, 16 positions), its safetensors export, and a
    byte-level tokenizer.json of 256 tokens (the run saves none of its own)."""
    base = tmp_path_factory.mktemp("generate")
    config = shrink(load("gpt2_hf"))
    config.update(strategy="fsdp=4,model=2")
    result = job.run(config, base / "run")
    exported = job_export.export(
        result.trainer, base / "export", "safetensors", weight_map=result.weight_map
    )
    byte_level = tokenizers.Tokenizer(tokenizers.models.BPE())
    byte_level.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=256, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    byte_level.train_from_iterator(["the cab"], trainer)
    tokenizer = base / "tokenizer.json"
    byte_level.save(str(tokenizer))
    hf = base / "hf"  # a Hugging Face GPT-2 folder: config.json, weights, tokenizer
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(Path(exported).read_bytes())
    sizes = config.gpt2_hf
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 256,
        "n_positions": 16, "n_embd": sizes.n_embd, "n_layer": sizes.n_layer,
        "n_head": sizes.n_head}))  # fmt: skip
    byte_level.save(str(hf / "tokenizer.json"))
    big = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(300)}))
    big.save(str(base / "big.json"))
    return {"workdir": base / "run", "weights": exported, "tokenizer": tokenizer, "hf": hf,
            "big": base / "big.json", "trainer": result.trainer, "base": base}  # fmt: skip


def _generate(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    assert generate.main(list(argv)) == 0
    out = capsys.readouterr().out.splitlines()
    return [json.loads(line) for line in out if line.startswith("{")]


def _teacher_forced(trainer: Any, ids: list[int], new: list[int]) -> tuple[list[int], np.ndarray]:
    """The argmax and the log-probability of each generated token from the trained
    model's forward pass over prompt + continuation (``Trainer.predict``)."""
    tokens = np.zeros((8, 16), np.int32)
    tokens[0, : len(ids) + len(new)] = ids + new
    (logits,) = trainer.predict([{"x": tokens}], to_numpy=True)
    steps = np.arange(len(ids) - 1, len(ids) + len(new) - 1)
    log_probs = np.asarray(jax.nn.log_softmax(logits[0, steps].astype(np.float32), axis=-1))
    return log_probs.argmax(-1).tolist(), log_probs[np.arange(len(new)), new]


def test_a_workdirs_checkpoint_continues_greedily_as_its_forward_pass(run, capsys) -> None:
    before = _files(run["workdir"])
    (row,) = _generate(
        capsys, str(run["workdir"]), "--prompt", PROMPT, "--max_new_tokens", str(NEW),
        "--tokenizer", str(run["tokenizer"]), "--json",
    )  # fmt: skip
    ids = tokenizers.Tokenizer.from_file(str(run["tokenizer"])).encode(PROMPT).ids
    argmax, log_probs = _teacher_forced(run["trainer"], ids, row["tokens"])
    assert row["tokens"] == argmax[: len(row["tokens"])] and len(row["tokens"]) == NEW
    np.testing.assert_allclose(row["log_probs"], log_probs, atol=1e-5)
    assert row["prompt"] == PROMPT and row["source"] == f"step 2 of {run['workdir']}"
    # the trained trainer's own Sampler, in this process, says the same
    trained = run["trainer"]
    in_process = Sampler(trained.model, trained.plan, print_fn=None).generate(
        [ids], max_new_tokens=NEW
    )
    assert in_process.tokens == [row["tokens"]]
    np.testing.assert_allclose(row["log_probs"], in_process.log_probs[0], atol=1e-6)
    assert _files(run["workdir"]) == before  # the checkpoint is only read


def test_a_safetensors_file_gives_the_same_continuation(run, capsys) -> None:
    argv = ["--prompt", PROMPT, "--max_new_tokens", str(NEW), "--tokenizer", str(run["tokenizer"])]
    (from_checkpoint,) = _generate(capsys, str(run["workdir"]), *argv, "--json")
    (from_file,) = _generate(
        capsys, str(run["workdir"]), "--weights", str(run["weights"]), *argv, "--json"
    )
    assert from_file["tokens"] == from_checkpoint["tokens"]
    np.testing.assert_allclose(from_file["log_probs"], from_checkpoint["log_probs"], atol=1e-6)
    # no workdir: a Hugging Face GPT-2 folder, sized by its config.json, its tokenizer.json
    (from_folder,) = _generate(
        capsys, "--weights", str(run["hf"]), "--prompt", PROMPT, "--max_new_tokens", str(NEW),
        "--json",
    )  # fmt: skip
    assert from_folder["tokens"] == from_checkpoint["tokens"]
    np.testing.assert_allclose(from_folder["log_probs"], from_checkpoint["log_probs"], atol=1e-6)
    # sampled, seeded: the same seed the same text and log-probabilities (--logprobs prints
    # them after the text); the progress line says its speed
    sampled = ["--temperature", "1.0", "--seed", "3"]
    (first,) = _generate(capsys, str(run["workdir"]), *argv, *sampled, "--json")
    assert generate.main([str(run["workdir"]), *argv, *sampled, "--logprobs"]) == 0
    text_line, logprob_line, speed_line = capsys.readouterr().out.splitlines()[-3:]
    assert text_line == PROMPT + " >>> " + first["text"] and "tokens/s" in speed_line
    printed = re.findall(r"=(-?\d+\.\d{4})(?= |$)", logprob_line.split(": ", 1)[1])
    assert printed == [f"{lp:.4f}" for lp in first["log_probs"]]
    # without --tokenizer: the run's own (GPT-2's single-byte ids), text in and out; without
    # --max_new_tokens: what the 16 positions leave the 7-byte prompt; --step best: the
    # saved step with the lowest eval/loss in metrics.csv (the run evaluated step 2 only);
    # a JSONL prompts file after the --prompt
    prompts = run["base"] / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a\nb"}) + "\n\n" + json.dumps("the") + "\n")
    own, *more = _generate(
        capsys, str(run["workdir"]), "--prompt", PROMPT, "--prompts_file", str(prompts),
        "--step", "best", "--json",
    )  # fmt: skip
    assert own["text"] == bytes(GPT2_BYTES[t] for t in own["tokens"]).decode(errors="replace")
    assert len(own["tokens"]) == 16 - len(PROMPT) and own["source"].startswith("step 2 of")
    assert [m["prompt"] for m in more] == ["a\nb", "the"]


def _files(root: Path) -> dict[Path, tuple[int, int]]:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        generate.main(list(argv))
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


def test_bad_input_is_one_line_and_exit_2(run, capsys, tmp_path: Path) -> None:
    workdir, tok = str(run["workdir"]), ["--tokenizer", str(run["tokenizer"])]
    before = _files(run["base"])
    (tmp_path / "empty").mkdir()
    assert "no checkpoint in" in _refused(capsys, str(tmp_path / "empty"), "--prompt", "a")
    assert "there is no folder" in _refused(capsys, str(tmp_path / "typo"), "--prompt", "a")
    mismatch = _refused(capsys, workdir, "--prompt", "a", "--tokenizer", str(run["big"]))
    assert "has 300 tokens and the model embeds 256" in mismatch
    too_long = _refused(capsys, workdir, "--prompt", "x" * 20, *tok)
    assert "context of 16 positions" in too_long
    assert "top_p=1.5 is outside (0, 1]" in _refused(
        capsys, workdir, "--prompt", "a", "--top_p", "1.5", *tok
    )
    assert "--weights=" in _refused(capsys, workdir, "--prompt", "a", "--weights", "nope.st")
    assert "temperature=-0.5 is negative" in _refused(
        capsys, workdir, "--prompt", "a", "--temperature", "-0.5"
    )
    assert "--step='soon': give latest, best or a step number" in _refused(
        capsys, workdir, "--prompt", "a", "--step", "soon"
    )
    assert "no checkpoint step 7" in _refused(capsys, workdir, "--prompt", "a", "--step", "7", *tok)
    assert "no prompt" in _refused(capsys, workdir)
    assert "give the WORKDIR of a run, or --weights DIR" in _refused(capsys, "--prompt", "a")
    # nan passes every range check; an end token the model cannot emit would never end a row
    assert "'nan' is not a finite number" in _refused(
        capsys, workdir, "--prompt", "a", "--temperature", "nan"
    )
    assert "--end_token=256 is not one of the model's token ids (0 to 255)" in _refused(
        capsys, workdir, "--prompt", "a", "--end_token", "256", *tok
    )
    overrun = _refused(capsys, workdir, "--prompt", "a", "--max_new_tokens", "20", *tok)
    assert overrun.startswith("nnx-spmd-train: error: generate: a prompt of 1 tokens plus")
    assert _files(run["base"]) == before  # nothing written, nothing touched


def test_a_workdir_that_cannot_say_what_to_build_is_refused(run, capsys, tmp_path) -> None:
    """A folder with checkpoints but no config.json, and --weights for a model that has no
    weight map (the shipped GPT reads only its own checkpoints): one line each, naming
    generate and the fix."""
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    no_config = _refused(capsys, str(tmp_path), "--prompt", "a")
    assert no_config.startswith("nnx-spmd-train: error: generate: ")
    assert "config.json does not exist" in no_config
    (tmp_path / "config.json").write_text(shrink(load("char")).to_json())
    no_map = _refused(capsys, str(tmp_path), "--prompt", "a", "--weights", str(run["weights"]))
    assert "config.model='gpt' has no weight map" in no_map
    assert "leave --weights out" in no_map
