"""``nnx-spmd-train``: train an example model from an ml_collections config.

    nnx-spmd-train                                    # the default: GPT on pydoc topics
    nnx-spmd-train --config=configs/tp.py --config.max_steps=20 --workdir=/tmp/tp
    nnx-spmd-train corpus texts/ --out corpora/mine   # tokenize files into a corpus
    nnx-spmd-train --config.data.corpus=corpora/mine  # ... and train on it
    nnx-spmd-train evaluate runs/default              # a workdir's checkpoint evaluated
    nnx-spmd-train generate runs/default --prompt Hi  # ... continuing prompts
    nnx-spmd-train lm_eval runs/default --tasks T     # ... scored on lm-eval tasks
    python -m nnx_spmd_trainer --config=mlp          # an embedded config, by name

``--config`` takes a config file path, or the name of a config shipped in
``nnx_spmd_trainer.configs``; ``--config.key=value`` overrides any key, and a
key the config does not have is an error. Logs and TensorBoard events go
under ``--workdir`` (default ``runs/<config name>``).

A configuration error (an unknown key, a value of the wrong type or out of
range, a layout that does not fit the devices or the model, a batch the mesh
cannot split, an unwritable ``--workdir``, an occupied ``--export``, an
``--export_format=safetensors`` for a task without a weight map, a resume whose
learning-rate schedule differs from its checkpoints' without
``--config.replan_schedule=True``) is found before anything is written: one line
on stderr naming the key and the fix,
``nnx-spmd-train: error: config.max_steps=-1: must be ...``, and exit status 2.

Without an accelerator, ``config.num_devices`` CPU devices are simulated
(``--xla_force_host_platform_device_count``) unless ``XLA_FLAGS`` already sets a count.

``--num_processes=N`` runs the job as N processes on this machine
(``distributed.Launch``: JAX's distributed runtime on 127.0.0.1, the devices
split between them, each output line prefixed with its process index); on a
cluster, start one process per host and JAX's cluster detection joins them,
or name ``--coordinator_address``, ``--num_processes`` and ``--process_id``.

This module is the entry point (``main``): the flags defined, the processes launched
or joined, the run started and its errors turned into exit statuses. The rest is by
job beside it: ``command_line`` (argv, ``--help``), ``corpus`` and ``evaluate`` (the two
other commands), ``host_devices``, ``interrupts``
(Ctrl-C), ``workdir`` (checks, lock), ``job`` (``run``, ``RunResult``), ``post_training_job``
(``--config=dpo`` and ``grpo``: ``config.post_training`` set),
``job_callbacks`` and ``console`` (the lines a run prints).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import jax  # importing is fine: the backend starts (and reads XLA_FLAGS) on first use
from absl import app, flags, logging
from ml_collections import config_flags

# callbacks/ is mapped onto nnx_spmd_trainer.callbacks at install time; mypy reads the tree.
from nnx_spmd_trainer import ShardingError, callbacks, distributed, weights  # type: ignore[attr-defined]
from nnx_spmd_trainer.app import (
    corpus,
    evaluate,
    generate,
    harness,
    post_training_job,
    target_plan,
    tasks,
)
from nnx_spmd_trainer.app.command_line import (
    fail,
    launch_args,
    normalize_argv,
    parse_flags,
    usage,
)
from nnx_spmd_trainer.app.console import say
from nnx_spmd_trainer.app.host_devices import simulate_host_devices
from nnx_spmd_trainer.app.interrupts import ORBAX_LOG, exit_at_once, interrupt
from nnx_spmd_trainer.app.job import run
from nnx_spmd_trainer.app.job_checks import schedule_change_on_resume
from nnx_spmd_trainer.app.job_export import EXPORT_FORMATS, export
from nnx_spmd_trainer.app.workdir import check_writable


def _main(argv: Sequence[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    if not flags.FLAGS["verbosity"].present:  # absl's INFO default floods the run's output
        logging.set_verbosity(logging.WARNING)
        logging.get_absl_logger().addFilter(ORBAX_LOG)
    config = flags.FLAGS.config
    config_path = config_flags.get_config_filename(flags.FLAGS["config"])
    workdir = flags.FLAGS.workdir or os.path.join("runs", Path(config_path).stem)
    try:  # the values first: num_devices decides the devices to simulate
        tasks.check_config(config)
        if flags.FLAGS.export:  # refuse an occupied or unwritable path before training
            try:
                weights.check_export_path(flags.FLAGS.export)
            except FileExistsError:
                raise tasks.ConfigError(
                    f"--export={Path(flags.FLAGS.export).absolute()} exists and is not an "
                    "empty directory: refusing to overwrite it; remove it or pass another "
                    "--export."
                ) from None
            check_writable(flags.FLAGS.export, "--export")
        elif flags.FLAGS["export_format"].present or flags.FLAGS.export_ema:
            given = (
                "--export_ema"
                if flags.FLAGS.export_ema
                else f"--export_format={flags.FLAGS.export_format}"
            )
            raise tasks.ConfigError(
                f"{given} without --export=DIR: say where to write the parameters."
            )
        if flags.FLAGS.export_ema and not config.get("ema_decay"):
            raise tasks.ConfigError(
                "--export_ema: this run keeps no average of the weights; give "
                "--config.ema_decay=0.999 (say), or export the trained weights without it."
            )
    except tasks.ConfigError as error:
        fail(str(error))
    # This process's share of the devices: a SLURM task learns the count from SLURM.
    processes = distributed.expected_processes(
        flags.FLAGS.num_processes if flags.FLAGS.coordinator_address else None
    )
    simulate_host_devices(max(1, config.num_devices // processes))
    joined = distributed.initialize(
        flags.FLAGS.coordinator_address,
        flags.FLAGS.num_processes if flags.FLAGS.coordinator_address else None,
        flags.FLAGS.process_id,
    )
    if joined and not os.environ.get("PYTHONFAULTHANDLER"):
        # JAX aborts a process whose coordinator (process 0) was killed, after one fatal
        # line that says so; Python's dump of every thread (absl turns it on) would bury
        # that line under a hundred. PYTHONFAULTHANDLER=1 keeps the dump.
        faulthandler.disable()
    try:  # after the devices are set: the schedule is computed with JAX
        # the CLI's own schedule, planned from max_steps: a resume may not re-plan it unsaid
        replanned = None if flags.FLAGS.dry_run else schedule_change_on_resume(config, workdir)
    except tasks.ConfigError as error:
        fail(str(error))
    if replanned:
        say(replanned)
    if config.get("target"):  # chips that are not here: the TPU compiler's plan, no run
        try:
            return target_plan.dry_run(config, dry_run=flags.FLAGS.dry_run)
        except (tasks.ConfigError, ShardingError) as error:
            fail(str(error))
    try:
        with distributed.lost_peers_named():  # a collective failed: was a process lost?
            # --config=dpo / grpo: the post-training trainers (app/post_training_job.py)
            runner = post_training_job.run if post_training_job.kind(config) else run
            result = runner(
                config,
                workdir,
                dry_run=flags.FLAGS.dry_run,
                export_format=flags.FLAGS.export_format,
            )
    except (tasks.ConfigError, ShardingError) as error:  # the config, not the code
        fail(str(error))
    except callbacks.CheckpointOfAnotherModel as error:  # workdir vs config
        record = Path(workdir).absolute() / "config.json"  # left as it was: see run()
        fail(
            f"{error} The config they were trained with is in {record}; "
            "--config.resume=False starts over (they are moved aside, not deleted)."
        )
    except callbacks.CheckpointWriteError as error:  # names step, path, cause
        fail(str(error), status=1)
    except callbacks.DamagedCheckpoint as error:  # names step and path (config.init_from's)
        fail(str(error))
    if flags.FLAGS.dry_run:
        return 0
    if flags.FLAGS.export and not (result.trainer and result.trainer.progress.preempted):
        assert result.trainer is not None
        try:
            path = export(
                result.trainer, flags.FLAGS.export, flags.FLAGS.export_format,
                weight_map=result.weight_map, ema=flags.FLAGS.export_ema, workdir=workdir,
            )  # fmt: skip
        except OSError as error:  # a full disk, a read-only directory: no partial file left
            fail(
                f"--export={flags.FLAGS.export}: the parameters could not be written: "
                f"{error}. The run's checkpoints in {workdir} hold them: free space or choose "
                "another --export directory and run the same command again (it resumes from "
                "them and trains nothing more).",
                status=1,
            )
        what = "the average of the parameters (EMA)" if flags.FLAGS.export_ema else "parameters"
        if jax.process_index() == 0 and flags.FLAGS.export_format == "peft":
            say(
                f"LoRA adapters exported to {path} as a PEFT adapter (adapter_config.json, "
                "adapter_model.safetensors): peft.PeftModel.from_pretrained(base, path)"
            )
        elif jax.process_index() == 0 and flags.FLAGS.export_format in ("safetensors", "merged"):
            say(
                f"{what} exported to {path} under the task's weight map's names (the "
                "model's own parameter paths where it has none); "
                f"load them with safetensors.numpy.load_file({str(path)!r})"
            )
        elif jax.process_index() == 0:
            say(
                f"{what} exported to {path}; load them with plain Orbax: "
                f"orbax.checkpoint.PyTreeCheckpointer().restore({str(path)!r})"
            )
    return 0


def local_launch(argv: Sequence[str]) -> distributed.Launch | None:
    """``--num_processes=N`` (or ``--num_processes N``) with no coordinator: N processes of
    this command, here, each given the rest of ``argv``."""
    args = launch_args(argv)
    if (
        args.num_processes == 1
        or args.coordinator_address is not None
        or distributed.PROCESS_ID in os.environ
    ):
        return None
    command = [sys.executable, "-m", "nnx_spmd_trainer", *args.rest[1:]]
    try:
        return distributed.Launch(command, args.num_processes)
    except ValueError as error:
        fail(str(error))


def main(
    argv: Sequence[str] | None = None, *, sigterm_noticed: Callable[[], bool] = lambda: False
) -> None:
    """The console entry point: parses flags (absl) and runs; exits non-zero on failure.

    Call it once per process (absl parses flags once). ``sigterm_noticed()``: whether a
    SIGTERM came before this was called (``nnx_spmd_train.main``, during the imports);
    a training run then stops before its first step, as it would for one that came later.
    """
    argv = list(sys.argv if argv is None else argv)
    if argv[1:2] == ["corpus"]:  # nnx-spmd-train corpus IN... --out DIR: app/corpus.py
        _default_sigterm(sigterm_noticed)  # no training here: a SIGTERM ends it as before
        sys.exit(corpus.main(argv[2:]))
    if argv[1:2] == ["evaluate"]:  # nnx-spmd-train evaluate WORKDIR: app/evaluate.py
        _default_sigterm(sigterm_noticed)
        sys.exit(evaluate.main(argv[2:]))
    if argv[1:2] == ["generate"]:  # nnx-spmd-train generate WORKDIR: app/generate.py
        _default_sigterm(sigterm_noticed)
        sys.exit(generate.main(argv[2:]))
    if argv[1:2] == ["lm_eval"]:  # nnx-spmd-train lm_eval WORKDIR --tasks ...: app/harness.py
        _default_sigterm(sigterm_noticed)
        sys.exit(harness.main(argv[2:]))
    argv = normalize_argv(argv)
    if "--help" in argv or "-h" in argv:
        print(usage(argv))
        sys.exit(0)
    if (launch := local_launch(argv)) is not None:
        _default_sigterm(sigterm_noticed)
        sys.exit(launch.run())
    # From here a SIGTERM is a preemption notice, whenever it comes (imports, restore,
    # compilation): fit acts on it at its first check (callbacks/preemption.py).
    callbacks.preemption.listen_early(sigterm_noticed)
    config_flags.DEFINE_config_file(
        "config",
        default=None,  # normalize_argv always names one
        help_string="Config file, or the name of an embedded config (default, char, dp, fsdp, tp, "
        "hybrid, mlp, cnn, dpo, grpo). Override keys with --config.key=value.",
        lock_config=True,
        sys_argv=argv,
    )
    flags.DEFINE_string("workdir", None, "Output directory (default: runs/<config name>).")
    flags.DEFINE_string(
        "export",
        None,
        "Write the trained parameters here (a plain Orbax checkpoint; see --export_format).",
    )
    flags.DEFINE_enum(
        "export_format",
        "orbax",
        list(EXPORT_FORMATS),
        "With --export: a plain Orbax checkpoint (orbax), or DIR/model.safetensors under "
        "the task's weight map's names (safetensors; gpt2_hf: Hugging Face's GPT-2); with "
        "--config.lora.rank: the adapters as a PEFT adapter directory (peft), or merged into "
        "the base as DIR/model.safetensors (merged).",
    )
    flags.DEFINE_bool(
        "export_ema",
        False,
        "With --export and --config.ema_decay: export the average of the weights (EMA) in "
        "place of the trained ones.",
    )
    flags.DEFINE_integer("num_processes", 1, "Processes of the job (alone: launched here).")
    flags.DEFINE_bool(
        "dry_run", False, "Print the plan of the train step (memory, collectives) and exit."
    )
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host).")
    flags.DEFINE_integer("process_id", None, "This process's index (with coordinator_address).")
    signal.signal(signal.SIGINT, interrupt)
    try:
        app.run(_main, argv=argv, flags_parser=parse_flags)
    except KeyboardInterrupt:  # the checkpoint in flight was dropped; the committed ones stay
        sys.stderr.write(
            "nnx-spmd-train: interrupted; the checkpoints committed so far are kept: "
            "run the same command to resume\n"
        )
        exit_at_once(130)  # 128 + SIGINT, as a shell reports it


def _default_sigterm(noticed: Callable[[], bool]) -> None:
    """SIGTERM's default action back (death, 143), and taken now if one came already."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if noticed():
        os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    main()
