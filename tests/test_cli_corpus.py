"""The CLI on real tokens: the corpus command, config.data (tokenizer, corpora, mixture,
packing), bits per byte, and every bad input refused before anything trains, with
nothing written to the workdir."""

from __future__ import annotations

import importlib
import itertools
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest
from conftest import environment_for_own_devices

from nnx_spmd_trainer import Callback
from nnx_spmd_trainer.app import corpus as corpus_command
from nnx_spmd_trainer.app import job, tasks
from nnx_spmd_trainer.app.datasets import corpora, documents, from_config, text
from nnx_spmd_trainer.app.job_callbacks import make_callbacks
from nnx_spmd_trainer.data.corpus import TOKENS_FILE, Corpus
from nnx_spmd_trainer.data.packing import ContiguousRows
from nnx_spmd_trainer.data.tokenizer import load_tokenizer

KEYS = ["inputs", "positions", "segment_ids", "target_segment_ids", "targets"]


def load(name):
    return importlib.import_module(f"nnx_spmd_trainer.configs.{name}").get_config()


def small(config, **data):
    """The default job at test sizes; ``data``: config.data keys."""
    config.update(max_steps=2, batch_size=16, max_eval_batches=1, eval_every_n_steps=0)
    config.gpt.update(seq_len=16, embed_dim=32, num_heads=8, ff_dim=64, num_layers=1)
    config.data.update(data)
    return config


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Two corpora written by the corpus command: ``a`` (topics as files, a BPE of 300 ids
    trained by the command) and ``b`` (a JSONL of paragraphs, tokenized with a's)."""
    root = tmp_path_factory.mktemp("corpora")
    texts = root / "texts"
    texts.mkdir()
    for key in sorted(topics)[:30]:
        (texts / f"{key}.txt").write_text(topics[key], encoding="utf-8")
    lines = [p for k in sorted(topics)[30:40] for p in topics[k].split("\n\n") if p.strip()]
    jsonl = root / "b.jsonl"
    jsonl.write_text("".join(json.dumps({"text": p}) + "\n" for p in lines), encoding="utf-8")
    args = ["--vocab_size=300", "--no_progress"]
    assert corpus_command.main([str(texts), "--out", str(root / "a"), *args]) == 0
    b = ["--tokenizer", str(root / "a"), "--no_progress"]
    assert corpus_command.main([str(jsonl), "--out", str(root / "b"), *b]) == 0
    return root


def refused(config, workdir, match):
    """``job.run`` refuses ``config`` with a ConfigError matching ``match``, and the workdir
    was never created."""
    with pytest.raises(tasks.ConfigError, match=match) as caught:
        job.run(config, workdir)
    assert not Path(workdir).exists()
    return str(caught.value)


# -- the corpus command and config.data ---------------------------------------------------
def test_the_corpus_command_writes_both_kinds_of_input(written):
    a, b = Corpus(written / "a"), Corpus(written / "b")
    assert len(a) == 30 and a.vocab_size == 300
    assert load_tokenizer(written / "a").sha256 == load_tokenizer(written / "b").sha256
    assert len(b) > 30  # one document per JSONL line
    tokenizer = a.tokenizer()
    first = sorted(topics)[0]
    assert tokenizer.decode(a[0]) == topics[first]  # the end-of-document id decodes to nothing
    assert a[0][-1] == tokenizer.eos_id


def test_a_mixture_of_corpora_with_stages_and_the_dry_run_lines(written):
    config = small(
        load("default"),
        corpus=f"a={written / 'a'},b={written / 'b'}",
        weights="a=3,b=1",
        stages="1:a=0,b=1",
    )
    vocab, splits = from_config.text_splits(config, _options(config), 16)
    assert vocab == 300
    batches = iter(splits.train)
    first, second = next(batches), next(batches)
    assert sorted(first) == KEYS and first["inputs"].shape == (16, 16)
    b = Corpus(written / "b")
    b_rows = ContiguousRows(b, 16, (0, corpora.held_out_range(b, 0.1)[0]))
    from_b = {tuple(b_rows[i]["inputs"]) for i in range(len(b_rows))}
    assert all(tuple(row) in from_b for row in second["inputs"])  # step 1: b's weight alone
    assert not all(tuple(row) in from_b for row in first["inputs"])  # step 0: mostly a
    assert (splits.train.source_ids(1) == 1).all()
    lines = "\n".join(splits.summary)
    assert "corpus a (" in lines and "30 documents" in lines
    assert "mixture from step 0: a 0.750, b 0.250" in lines
    assert "mixture from step 1: a 0.000, b 1.000" in lines
    assert "epochs of each corpus in 2 steps: a " in lines
    assert splits.bytes_per_target and 1 < splits.bytes_per_target < 5  # 44 merges


@pytest.mark.slow
def test_one_corpus_dry_run_then_two_steps(written, tmp_path, capsys):
    config = small(load("default"), corpus=str(written / "b"))  # paragraphs: short documents
    job.run(config, tmp_path / "run", dry_run=True)
    dry = capsys.readouterr().out
    assert not (tmp_path / "run").exists()  # a dry run writes nothing
    b = Corpus(written / "b")
    assert f"data: corpus b ({written / 'b'}): {len(b)} documents, {b.n_tokens} tokens" in dry
    trained = b.span(corpora.held_out_range(b, 0.1)[0] - 1)[1]  # tokens before the held out
    epochs = 2 * 16 * 16 / trained
    assert f"data: packed; 2 steps of 16 rows x 16 tokens read corpus b ~{epochs:.2f} times" in dry
    assert dry.index("data: corpus b") < dry.index("plan: ")
    result = job.run(config, tmp_path / "run")
    assert result.history.steps["train/loss"][-1] == 2 and math.isfinite(result.eval_loss)
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("held-out bits per byte")]
    _, splits = from_config.text_splits(config, _options(config), 16)
    assert f"{splits.bits_per_byte(result.eval_loss):.4f}" in line
    assert load_tokenizer(tmp_path / "run").sha256 == b.tokenizer().sha256  # saved with the run
    batches = list(itertools.islice(iter(splits.train), 8))
    assert any(batch["segment_ids"].max() > 1 for batch in batches)  # documents packed
    for batch in batches:  # a packed row's targets never leave their document
        np.testing.assert_array_equal(batch["target_segment_ids"], batch["segment_ids"])


def _options(config):
    return text.SplitOptions(
        seq_len=config.gpt.seq_len, batch_size=config.batch_size, seed=0,
        eval_fraction=config.eval_fraction, max_eval_batches=config.max_eval_batches or None,
    )  # fmt: skip


# -- bits per byte --------------------------------------------------------------------------
def test_bits_per_byte_of_the_default_and_the_character_job():
    tokenizer = documents.pydoc_tokenizer(1024)
    splits = documents.bpe_lm_splits(tokenizer, seq_len=64, batch_size=8, seed=0, max_steps=10)
    train, held_out = documents.split_documents(documents.pydoc_documents(), 0.1)
    trained = sum(map(len, documents.tokenize(tokenizer, train)))
    assert splits.summary == (
        f"data: {len(train)} documents, {trained} tokens trained on (a tokenizer of 1024 ids), "
        f"{len(held_out)} held out; packed; 10 steps of 8 rows x 64 tokens read them "
        f"~{10 * 8 * 64 / trained:.2f} times (epochs)",
    )
    assert "".join(held_out) == text.load_text()[-len("".join(held_out)) :]  # the char job's
    # independent: a byte-level token's bytes are the characters of its vocabulary string
    vocab = {i: t for t, i in tokenizer.backend.get_vocab().items()}
    length = np.array([0 if vocab[i].startswith("<|") else len(vocab[i]) for i in range(1024)])
    ids = documents.tokenize(tokenizer, held_out)
    windows = [(d, start) for d, doc in enumerate(ids) for start in range(0, len(doc) - 64, 64)]
    windows = windows[: len(windows) // 8 * 8]  # whole batches of 8
    total = sum(length[ids[d][start + 1 : start + 65]].sum() for d, start in windows)
    targets = len(windows) * 64
    assert splits.bytes_per_target == pytest.approx(total / targets, rel=2e-3)
    assert splits.bits_per_byte(splits.baseline) == pytest.approx(
        splits.baseline / math.log(2) / splits.bytes_per_target
    )
    _, chars = text.char_lm_splits(seq_len=64, batch_size=8, seed=0)
    evaluated = text.split_tokens(np.arange(len(text.load_text())))[1][1:]
    held_text = text.load_text()[evaluated[0] : evaluated[-1] + 1]
    usable = len(chars.eval) * 8 * 64
    assert chars.bytes_per_target == pytest.approx(len(held_text[:usable].encode()) / usable)
    assert "bits per byte" in chars.bits_per_byte_line(1.0)


def test_the_run_tokenizer_is_reused_on_resume(tmp_path):
    config = small(load("default"), vocab_size=300)
    assert from_config.run_tokenizer_config(config, tmp_path) is config  # nothing saved yet
    documents.pydoc_tokenizer(300).save(tmp_path)
    again = from_config.run_tokenizer_config(config, tmp_path)
    assert again.data.tokenizer == str(tmp_path / "tokenizer.json")
    config.resume = False
    assert from_config.run_tokenizer_config(config, tmp_path) is config


# -- bad input, refused before anything trains ------------------------------------------------
def test_a_corpus_of_another_vocabulary(written, tmp_path):
    assert Corpus(written / "a").header["max_id"] >= 264
    config = small(load("default"), corpus=str(written / "a"))
    config.gpt.vocab_size = 264
    message = refused(config, tmp_path / "run", "the corpus was tokenized for another model")
    assert "model's vocabulary is 264" in message and "holds ids up to" in message


def test_a_corpus_of_another_tokenizer_than_the_one_named(written, tmp_path):
    other = tmp_path / "other"
    documents.pydoc_tokenizer(300).save(other)  # as many ids, other merges
    config = small(load("default"), corpus=str(written / "a"), tokenizer=str(other))
    message = refused(config, tmp_path / "run", "was tokenized with another tokenizer")
    assert message.startswith("config.data.corpus (a): ")


def test_a_truncated_corpus(written, tmp_path):
    damaged = tmp_path / "cut"
    shutil.copytree(written / "a", damaged)
    size = (damaged / TOKENS_FILE).stat().st_size
    with (damaged / TOKENS_FILE).open("r+b") as file:
        file.truncate(size - 10)
    config = small(load("default"), corpus=str(damaged))
    message = refused(config, tmp_path / "run", "is truncated")
    assert f"{damaged / TOKENS_FILE}" in message and f"byte offset {size - 10}" in message


def test_a_damaged_corpus_with_verify(written, tmp_path):
    damaged = tmp_path / "flipped"
    shutil.copytree(written / "a", damaged)
    with (damaged / TOKENS_FILE).open("r+b") as file:
        file.seek(100)
        byte = file.read(1)
        file.seek(100)
        file.write(bytes([byte[0] ^ 0xFF]))
    config = small(load("default"), corpus=str(damaged), verify=True)
    message = refused(config, tmp_path / "run", "is damaged")
    assert f"{damaged / TOKENS_FILE}" in message and "byte offset 0" in message


@pytest.mark.parametrize(
    "weights, match",
    [
        ("a=1,c=1", "do not match the sources"),
        ("a=-1,b=1", "non-negative"),
        ("a=0,b=0", "all zero"),
        ("a=x", "is not name=weight"),
    ],
)
def test_mixture_weights_that_do_not_fit(written, tmp_path, weights, match):
    config = small(load("default"), corpus=f"a={written / 'a'},b={written / 'b'}", weights=weights)
    message = refused(config, tmp_path / "run", match)
    assert message.startswith("config.data.")


def test_a_mixture_stage_the_run_never_reaches_is_refused(written, tmp_path):
    corpus = f"a={written / 'a'},b={written / 'b'}"
    config = small(load("default"), corpus=corpus, weights="a=3,b=1", stages="2:a=1,b=3")
    message = refused(config, tmp_path / "run", "stage from step 2 .* never starts")
    assert "max_steps=2" in message and "\n" not in message
    proc = subprocess.run(
        [sys.executable, "-m", "nnx_spmd_trainer", f"--workdir={tmp_path / 'run'}",
         "--config.max_steps=2", f"--config.data.corpus={corpus}",
         "--config.data.weights=a=3,b=1", "--config.data.stages=2:a=1,b=3"],
        env=environment_for_own_devices(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("nnx-spmd-train: error: config.data.weights='a=3,b=1', stages=")
    assert "stage from step 2" in line and not (tmp_path / "run").exists()


def test_a_tokenizer_file_that_does_not_load(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": ')
    config = small(load("default"), tokenizer=str(bad))
    message = refused(config, tmp_path / "run", "does not load")
    assert message.startswith(f"config.data.tokenizer={str(bad)!r}")


def test_a_row_longer_than_the_models_positions(written, tmp_path):
    config = small(load("default"), corpus=str(written / "a"), seq_len=32)
    refused(config, tmp_path / "run", r"config.data.seq_len=32 is longer than the model's")


def test_the_cli_says_a_bad_input_in_one_line_and_exits_2(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("not json")
    proc = subprocess.run(
        [sys.executable, "-m", "nnx_spmd_trainer", f"--config.data.tokenizer={bad}",
         f"--workdir={tmp_path / 'run'}"],
        env=environment_for_own_devices(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert line.startswith("nnx-spmd-train: error: config.data.tokenizer=")
    assert "does not load" in line
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_the_corpus_command_refuses_a_missing_input(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        corpus_command.main([str(tmp_path / "nope"), "--out", str(tmp_path / "c")])
    assert exit_.value.code == 2
    assert "nope does not exist" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_a_mixture_job_stopped_mid_stage_resumes_bitwise(written, tmp_path):
    def losses(workdir):
        rows = (tmp_path / workdir / "metrics.csv").read_text().splitlines()
        keys = rows[0].split(",")
        values = [dict(zip(keys, row.split(","), strict=True)) for row in rows[1:]]
        return {r["step"]: r["train/loss"] for r in values if r["train/loss"]}

    def config(steps):
        mixed = small(
            load("default"),
            corpus=f"a={written / 'a'},b={written / 'b'}",
            weights="a=3,b=1",
            stages="2:a=1,b=3",  # the switch at step 2, between the stop and the end
        )
        mixed.update(max_steps=steps, log_every_n_steps=1, checkpoint_every_n_steps=1)
        mixed.update(warmup_steps=0, end_lr_fraction=1.0)  # a schedule max_steps leaves alone
        return mixed

    class StopAfterStep1(Callback):  # as a stop would; max_steps=1 would refuse the stage
        def on_train_batch_end(self, step, logs):
            if step == 1:
                self.trainer.request_stop()

    def with_a_stop(config, workdir):
        return [*make_callbacks(config, workdir), StopAfterStep1()]

    job.run(config(4), tmp_path / "whole")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(job, "make_callbacks", with_a_stop)
        job.run(config(4), tmp_path / "stopped")  # stopped after step 1, in the first stage
    assert set(losses("stopped")) == {"1"}
    job.run(config(4), tmp_path / "stopped")  # resumed: steps 2..4
    whole, resumed = losses("whole"), losses("stopped")
    assert set(whole) == {"1", "2", "3", "4"}
    assert resumed == whole  # the losses as written, bit for bit


def test_nnx_spmd_train_corpus_is_the_corpus_command(tmp_path, capsys):
    from nnx_spmd_trainer.app import cli

    (tmp_path / "one.txt").write_text("hello world, " * 50)
    (tmp_path / "two.txt").write_text("goodbye world. " * 50)
    out = tmp_path / "corpus"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["nnx-spmd-train", "corpus", str(tmp_path / "one.txt"), str(tmp_path / "two.txt"),
                  "--out", str(out), "--vocab_size=280", "--no_progress"])  # fmt: skip
    assert exit_.value.code == 0
    assert f"--config.data.corpus={out}" in capsys.readouterr().out
    assert len(Corpus(out)) == 2 and 257 < Corpus(out).vocab_size <= 280  # merges run out


def test_a_binary_file_among_the_texts_is_skipped_named_and_counted(tmp_path, capsys):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, key in enumerate(sorted(topics)[:3]):
        (texts / f"{i}.txt").write_text(topics[key], encoding="utf-8")
    (texts / "notes.txt.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)))
    out = tmp_path / "c"
    assert corpus_command.main([str(texts), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0] == (
        f"corpus: skipped 1 file that is not UTF-8 text: {texts / 'notes.txt.gz'} "
        "(byte 0x8b at offset 1)"
    )
    # the default vocabulary is the default job's, and the silent BPE training is announced
    assert corpus_command.DEFAULT_VOCAB_SIZE == load("default").data.vocab_size == 1024
    assert lines[1].startswith("corpus: training a byte-level BPE of 1024 ids on 3 files (")
    assert lines[2].startswith("corpus: BPE trained in ")
    assert f"corpus {out}: 3 documents (1 files skipped: not UTF-8 text)" in lines[-1]
    assert "3/3" in captured.err and "100%" in captured.err  # the bar has a total
    assert len(Corpus(out)) == 3


def test_a_bad_input_met_while_writing_is_named_and_nothing_is_left(written, tmp_path, capsys):
    """With --tokenizer the write starts at once; a JSON line without the field fails it
    after a chunk is written: the file is named and the corpus it began is removed."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n' * 1100 + '{"body": "no text"}\n')
    out = tmp_path / "c"
    with pytest.raises(SystemExit) as exit_:
        corpus_command.main(
            [str(bad), "--out", str(out), "--tokenizer", str(written / "a"), "--no_progress"]
        )
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"nnx-spmd-train: error: corpus: {bad} at byte 18700: no field 'text' to tokenize."
    )
    assert not out.exists()


@pytest.mark.parametrize("what", ["an empty folder", "only binary files"])
def test_no_text_to_tokenize_is_refused_and_nothing_is_written(tmp_path, capsys, what):
    inputs = tmp_path / "in"
    inputs.mkdir()
    if what == "only binary files":
        (inputs / "a.bin").write_bytes(b"\xff\xfe\x00")
    out = tmp_path / "c"
    with pytest.raises(SystemExit) as exit_:
        corpus_command.main([str(inputs), "--out", str(out), "--no_progress"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert "nothing to tokenize" in line and str(inputs) in line
    assert "--config.data.corpus" not in captured.out
    assert not out.exists()
