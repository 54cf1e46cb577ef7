"""``--config.data.chat=FILE.jsonl``: chat data through the CLI's GPT job, and its bad
inputs refused in one line before anything is written."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import environment_for_own_devices

pytest.importorskip("transformers")

from nnx_spmd_trainer.app import job, tasks  # noqa: E402
from nnx_spmd_trainer.app.datasets import from_config, text  # noqa: E402

NUMBERS = ["one", "two", "three", "four", "five", "six"]


def conversation(i: int) -> dict:
    a, b = NUMBERS[i % 6], NUMBERS[(i // 6) % 6]
    return {
        "messages": [
            *([{"role": "system", "content": "answer briefly"}] if i % 3 == 0 else []),
            {"role": "user", "content": f"what is {a} and {b}"},
            {"role": "assistant", "content": f"{a} and {b} make {a}{b}"},
        ]
    }


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(48)))
    return path


def small(path: Path, **data) -> object:
    config = importlib.import_module("nnx_spmd_trainer.configs.default").get_config()
    config.update(max_steps=2, batch_size=8, max_eval_batches=1, eval_every_n_steps=0)
    config.gpt.update(seq_len=64, embed_dim=32, num_heads=4, ff_dim=64, num_layers=1)
    config.data.update({"chat": str(path), "vocab_size": 300, "chat_template": "chatml", **data})
    return config


def refused(config, workdir: Path, match: str) -> str:
    with pytest.raises(tasks.ConfigError, match=match) as caught:
        job.run(config, workdir)
    assert not workdir.exists()
    return str(caught.value)


def test_chat_rows_carry_loss_weights_and_the_data_line(chat_file, tmp_path, capsys):
    config = small(chat_file)
    options = text.SplitOptions(seq_len=64, batch_size=8, seed=0, eval_fraction=0.2)
    vocab, splits = from_config.text_splits(config, options, 64)
    batch = next(iter(splits.train))
    assert batch["loss_weights"].shape == batch["targets"].shape == (8, 64)
    assert batch["loss_weights"].dtype == np.float32
    assert (batch["loss_weights"][batch["segment_ids"] == 0] == 0).all()
    assert 0 < batch["loss_weights"].mean() < 1  # the assistant's tokens only
    eval_batch = next(iter(splits.eval))
    assert set(eval_batch) == set(batch)
    (line,) = splits.summary
    assert line.startswith(f"chat: 48 of 48 conversations from {chat_file} (0 cut")
    assert "; 39 trained on, 9 held out" in line
    job.run(config, tmp_path / "run", dry_run=True)
    assert f"chat: 48 of 48 conversations from {chat_file}" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


def test_two_steps_on_chat_data(chat_file, tmp_path):
    result = job.run(small(chat_file), tmp_path / "run")
    assert result.history.steps["train/loss"][-1] == 2 and math.isfinite(result.eval_loss)


def test_a_row_without_messages_is_refused_with_its_line(chat_file, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(chat_file.read_text() + '{"prompt": "hi"}\n')
    message = refused(small(bad), tmp_path / "run", "has no 'messages' list")
    assert message.startswith(f"config.data.chat={str(bad)!r}: {bad}:49 has no 'messages'")


def test_an_unknown_role_is_refused_with_its_line(chat_file, tmp_path):
    bad = tmp_path / "bad.jsonl"
    row = {"messages": [{"role": "bot", "content": "hi"}]}
    bad.write_text(json.dumps(row) + "\n" + chat_file.read_text())
    refused(small(bad), tmp_path / "run", rf"{bad}:1: unknown role 'bot'; this template reads")


def test_a_tokenizer_without_a_template_and_no_default_is_refused(chat_file, tmp_path):
    message = refused(small(chat_file, chat_template=""), tmp_path / "run", "no chat template")
    assert "--config.data.chat_template=chatml" in message


@pytest.mark.serial
def test_the_cli_says_a_bad_chat_file_in_one_line_and_exits_2(tmp_path):
    bad = tmp_path / "chat.jsonl"
    bad.write_text('{"text": "hi"}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "nnx_spmd_trainer", f"--config.data.chat={bad}",
         "--config.data.chat_template=chatml", f"--workdir={tmp_path / 'run'}"],
        env=environment_for_own_devices(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert line.startswith(f"nnx-spmd-train: error: config.data.chat={str(bad)!r}: {bad}:1 has")
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
