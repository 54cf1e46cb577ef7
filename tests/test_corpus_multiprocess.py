"""Corpora read by real processes, through the CLI as a user runs it: with
``--num_processes=2`` each process reads about half of a corpus's bytes, and a
mixture job stopped mid-stage as 2 processes resumes as 1 process, bitwise.

test_corpus and test_mixture show the same inside one process (two ``DataShard``s,
a replayed mixture); here the processes, their Gloo collectives and the checkpoint
between them are real. Each process prints what it read at the end of a run
(``job.corpus_reads_line``, from ``Corpus.read``'s count)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import environment_for_own_devices
from test_cli_corpus import written  # noqa: F401  (the module-scoped fixture: corpora a, b)

from nnx_spmd_trainer.app.datasets.corpora import held_out_range
from nnx_spmd_trainer.data.corpus import Corpus

pytestmark = [pytest.mark.serial, pytest.mark.slow]  # processes joining under Gloo's deadline

TINY = [  # the default GPT job at test sizes (test_cli_corpus.small), no eval on the way
    "--config.batch_size=32", "--config.max_eval_batches=1", "--config.eval_every_n_steps=0",
    "--config.gpt.seq_len=16", "--config.gpt.embed_dim=32", "--config.gpt.num_heads=8",
    "--config.gpt.ff_dim=64", "--config.gpt.num_layers=1",
]  # fmt: skip
READ = re.compile(r"^\[(\d)\] data: process (\d) of 2 read (\d+) bytes of corpus tokens \((.*)\)$")


def cli(workdir: Path, processes: int, steps: int, *flags: str) -> str:
    """``nnx-spmd-train`` as ``processes`` processes of 8 devices in all; its stdout."""
    command = [
        sys.executable, "-m", "nnx_spmd_trainer", f"--workdir={workdir}",
        f"--num_processes={processes}", f"--config.max_steps={steps}", *TINY, *flags,
    ]  # fmt: skip
    proc = subprocess.run(
        command, env=environment_for_own_devices(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout


def reads(stdout: str) -> dict[int, dict[str, int]]:
    """Each process's line of what it read: ``{process: {corpus folder: bytes}}``."""
    found: dict[int, dict[str, int]] = {}
    for line in stdout.splitlines():
        if match := READ.match(line):
            assert match[1] == match[2]  # the launcher's prefix is the process that says it
            parts = (part.rsplit(": ", 1) for part in match[4].split(", "))
            found[int(match[2])] = {folder: int(n.split(" of its ")[0]) for folder, n in parts}
    return found


def test_each_of_two_processes_reads_about_half_of_a_corpus(written, tmp_path):  # noqa: F811
    """One packed corpus (b: 208 paragraphs, 36,502 tokens) read for about an epoch by 2
    processes: Grain shards its documents, so each process reads only its own. A process
    that read every row and kept its half would read about all of it (share 1.0)."""
    corpus = Corpus(written / "b")
    trained = corpus.span(held_out_range(corpus, 0.1)[0] - 1)[1]  # 33,941 tokens
    steps = trained // (64 * 16) - 1  # 32 steps of 64 rows x 16 tokens: 0.97 of an epoch
    out = cli(
        tmp_path / "run", 2, steps, f"--config.data.corpus={written / 'b'}",
        "--config.batch_size=64", "--config.log_every_n_steps=8",
        "--config.checkpoint_every_n_steps=0",
    )  # fmt: skip
    read = reads(out)
    assert sorted(read) == [0, 1], out[-3000:]
    total = corpus.n_tokens * corpus.dtype.itemsize  # 73,004 bytes of tokens
    shares = [read[p][str(written / "b")] / total for p in (0, 1)]
    # measured: 0.509 and 0.501 (37,188 and 36,554 bytes). More than the 0.449 its rows
    # hold (32 steps x 32 rows x 16 tokens): the held-out documents every process reads
    # for its evaluation (~1,000 tokens), the first batch the job checks, and the
    # packer's documents read but not yet in a full row. Not counted: the unigram
    # baseline's sample, the first 4M tokens of each corpus sliced from the memory map
    # directly (all of this small one, in each process).
    assert shares == pytest.approx([0.5, 0.5], abs=0.04), shares


def test_a_mixture_stopped_mid_stage_as_two_processes_resumes_as_one_bitwise(
    written,  # noqa: F811
    tmp_path,
):
    """Corpora a and b mixed 3:1, then 1:3 from step 2. The reference runs 6 steps as one
    process; the other stops after 3 steps (through the switch: a stage the stopped run would
    never reach is refused, test_mixture) as 2 processes of 4 devices each, and resumes in
    the same workdir as 1 process of 8 devices, in the second stage."""
    mixture = [
        f"--config.data.corpus=a={written / 'a'},b={written / 'b'}",
        "--config.data.weights=a=3,b=1",
        "--config.data.stages=2:a=1,b=3",
        "--config.log_every_n_steps=1",
        "--config.checkpoint_every_n_steps=1",
        "--config.warmup_steps=0",  # a schedule that max_steps leaves alone
        "--config.end_lr_fraction=1.0",
    ]
    reference = tmp_path / "whole"
    cli(reference, 1, 6, *mixture)
    stopped = tmp_path / "stopped"
    two = cli(stopped, 2, 3, *mixture)
    resumed = cli(stopped, 1, 6, *mixture)
    assert f"resuming from checkpoint step 3 in {stopped / 'checkpoints'}" in resumed, resumed
    whole, again = losses(reference), losses(stopped)
    assert sorted(whole, key=int) == ["1", "2", "3", "4", "5", "6"]
    # The losses: steps 1-3 from 2 processes (Gloo's collectives between them) against 1,
    # across the stage switch at step 2 (b's weight 0.25 -> 0.75: other rows), and steps
    # 4-6 from the 2 processes' checkpoint and mixture position. The job logs no
    # fingerprint of its rows; the losses agreeing to 1e-5 are the evidence that the rows
    # fed are the same.
    assert sorted(again, key=int) == sorted(whole, key=int)
    # Measured with the switch at step 4 (before 0.2): losses equal bit for bit or within
    # 5e-7 (the mean over 2 processes' Gloo reduction against one process's rounds apart).
    # Rows out of place, or the stage switch at another step, would move a loss by 1e-2 or
    # more.
    for step, loss in whole.items():
        assert float(again[step]) == pytest.approx(float(loss), abs=1e-5), (step, again, whole)
    # each process read its own rows of both corpora: measured 2,630 bytes of a and 472
    # of b in each (its 8 rows a step, the held-out windows, the first batch checked)
    read = reads(two)
    assert sorted(read) == [0, 1] and all(len(r) == 2 for r in read.values()), two[-3000:]


def losses(workdir: Path) -> dict[str, str]:
    """``metrics.csv``'s train/loss by step, as written (text: compared bit for bit)."""
    rows = (workdir / "metrics.csv").read_text().splitlines()
    keys = rows[0].split(",")
    values = [dict(zip(keys, row.split(","), strict=True)) for row in rows[1:]]
    return {r["step"]: r["train/loss"] for r in values if r["train/loss"]}
