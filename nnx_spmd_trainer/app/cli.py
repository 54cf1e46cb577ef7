"""``nnx-spmd-train``: train an example model from an ml_collections config.

    nnx-spmd-train                                    # the default: GPT on pydoc topics
    nnx-spmd-train --config=configs/tp.py --config.max_steps=20 --workdir=/tmp/tp
    python -m nnx_spmd_trainer --config=mlp          # an embedded config, by name

``--config`` takes a config file path, or the name of a config shipped in
``nnx_spmd_trainer.configs``; ``--config.key=value`` overrides any key, and a
key the config does not have is an error. Logs and TensorBoard events go
under ``--workdir`` (default ``runs/<config name>``).

A configuration error (an unknown key, a value of the wrong type or out of
range, a layout that does not fit the devices or the model, a batch the mesh
cannot split, an unwritable ``--workdir``, an occupied ``--export``) is found
before anything is written: one line on stderr naming the key and the fix,
``nnx-spmd-train: error: config.max_steps=-1: must be ...``, and exit status 2.

Without an accelerator, ``config.num_devices`` CPU devices are simulated
(``--xla_force_host_platform_device_count``) unless ``XLA_FLAGS`` already sets a count.

``--num_processes=N`` runs the job as N processes on this machine
(``distributed.Launch``: JAX's distributed runtime on 127.0.0.1, the devices
split between them, each output line prefixed with its process index); on a
cluster, start one process per host and JAX's cluster detection joins them,
or name ``--coordinator_address``, ``--num_processes`` and ``--process_id``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import importlib.metadata
import importlib.resources
import importlib.util
import itertools
import logging as std_logging
import os
import pkgutil
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import grain
import jax  # importing is fine: the backend starts (and reads XLA_FLAGS) on first use
import ml_collections
import numpy as np
from absl import app, flags, logging
from jax.experimental import multihost_utils
from ml_collections import config_flags
from tqdm.auto import tqdm

# callbacks/ is mapped onto nnx_spmd_trainer.callbacks at install time; mypy reads the tree.
from nnx_spmd_trainer import Callback, History, Trainer, callbacks, data, distributed  # type: ignore[attr-defined]
from nnx_spmd_trainer.app import datasets, tasks
from nnx_spmd_trainer.auto import Auto
from nnx_spmd_trainer.export import check_export_path, export_params
from nnx_spmd_trainer.run_lock import DirectoryInUse, RunLock
from nnx_spmd_trainer.sharding import ShardingError
from nnx_spmd_trainer.strategies import DataParallel, Strategy

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
#: The shipped configs, wherever the install put them (package-dir mapping of configs/).
CONFIGS_DIR = Path(str(importlib.resources.files("nnx_spmd_trainer.configs")))


# -- devices ---------------------------------------------------------------------------
def _has_accelerator() -> bool:
    """Whether JAX may pick a non-CPU backend, decided without starting one."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return any(p.strip() not in ("", "cpu") for p in platforms.split(","))
    if importlib.util.find_spec("libtpu") is not None:
        return True
    if importlib.metadata.entry_points(group="jax_plugins"):
        return True
    try:
        import jax_plugins  # namespace package of the CUDA/ROCm plugins
    except ImportError:
        return False
    return any(True for _ in pkgutil.iter_modules(jax_plugins.__path__))


def simulate_host_devices(num_devices: int) -> None:
    """Asks XLA for ``num_devices`` CPU devices, unless XLA_FLAGS already sets a count.

    Must run before JAX starts its backend (importing jax is fine); does
    nothing when an accelerator may be present.
    """
    flags_now = os.environ.get("XLA_FLAGS", "")
    if HOST_DEVICES_FLAG in flags_now or _has_accelerator():
        return
    os.environ["XLA_FLAGS"] = f"{flags_now} {HOST_DEVICES_FLAG}={num_devices}".strip()


# -- the run ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RunResult:
    """What ``run`` returns: the history, the final held-out loss and the baseline it must beat."""

    history: History
    eval_loss: float
    baseline: float
    baseline_name: str
    trainer: Trainer | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def beats_baseline(self) -> bool:
        return self.eval_loss < self.baseline


class BaselineReport(Callback):
    """Prints each held-out loss next to the baseline it must beat (process 0)."""

    def __init__(self, baseline: float, baseline_name: str) -> None:
        self.baseline = baseline
        self.baseline_name = baseline_name

    def on_test_end(self, logs: dict[str, float]) -> None:
        if "eval/loss" in logs and jax.process_index() == 0:
            _say(
                f"step {self.trainer.step}: eval loss {logs['eval/loss']:.4f} "
                f"({self.baseline_name} {self.baseline:.4f})"
            )


def make_callbacks(config: ml_collections.ConfigDict, workdir: Path) -> list[Callback]:
    """Metrics every ``log_every_n_steps``, lr, NaN guard, checkpoints, TensorBoard, progress,
    CSV."""
    return [
        callbacks.MetricsLogger(config.log_every_n_steps),
        callbacks.LearningRateMonitor(),
        callbacks.TerminateOnNaN(check_every_n_steps=config.log_every_n_steps),
        callbacks.OrbaxCheckpoint(
            workdir / "checkpoints",
            save_every_n_steps=config.checkpoint_every_n_steps or None,
            restore="latest" if config.resume else None,
            report=_say,
        ),
        callbacks.TensorBoard(workdir / "tb"),
        callbacks.ProgressBar(plain=True),  # a line per log point in CI logs too
        callbacks.CSVLogger(workdir / "metrics.csv", append=config.resume),
    ]


def set_old_checkpoints_aside(workdir: Path) -> None:
    """``--config.resume=False`` starts over: earlier checkpoints are moved, never deleted."""
    checkpoints = workdir / "checkpoints"
    if jax.process_index() != 0 or not checkpoints.is_dir() or not any(checkpoints.iterdir()):
        return
    aside = workdir / f"checkpoints.before-{time.strftime('%Y%m%d-%H%M%S')}"
    checkpoints.rename(aside)
    _say(f"resume=False: starting over; the earlier checkpoints are now in {aside}")


def check_writable(path: str | os.PathLike[str], flag: str) -> Path:
    """The absolute ``path``; a ``ConfigError`` naming ``flag`` unless it is, or can be
    created as, a directory this process may write to. Writes nothing."""
    path = Path(path).absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # the nearest ancestor that exists: where mkdir would write
    if not existing.is_dir():
        where = "it" if existing == path else str(existing)
        raise tasks.ConfigError(
            f"{flag}={path} is not writable: {where} is a file, not a directory; "
            f"pass a {flag} you can write to."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" (its parent {existing} is not)"
        raise tasks.ConfigError(
            f"{flag}={path} is not writable{where}: {_why_not_writable(existing)}; "
            f"pass a {flag} you can write to."
        )
    return path


def _why_not_writable(path: Path) -> str:
    """Why ``os.access`` refused: a read-only mount (which stops root too), or permissions."""
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return "read-only file system" if read_only else "permission denied"


#: What a run writes inside its workdir besides new files: each must stay writable.
WRITTEN_IN_WORKDIR = (
    "config.json",
    "metrics.csv",
    RunLock.FILE,
    "tb",
    "checkpoints",
    f"checkpoints/{RunLock.FILE}",
)


def check_workdir_writable(workdir: Path) -> None:
    """A ``ConfigError`` unless the run can write everywhere in ``workdir`` it would: the
    workdir itself and what an earlier run left there (checkpoints shared read-only, a
    full quota remounted read-only). Writes nothing."""
    check_writable(workdir, "--workdir")
    for name in WRITTEN_IN_WORKDIR:
        path = workdir.absolute() / name
        needed = os.W_OK | os.X_OK if path.is_dir() else os.W_OK
        if path.exists() and not os.access(path, needed):
            raise tasks.ConfigError(
                f"--workdir={workdir.absolute()}: {path} is not writable "
                f"({_why_not_writable(path)}) and this run would write there; make it "
                "writable or pass another --workdir (--dry_run, and evaluating its "
                "checkpoints with OrbaxCheckpoint(...).restore_into, only read it)."
            )


@contextlib.contextmanager
def blamed_on(key: str, *errors: type[BaseException]) -> Iterator[None]:
    """Re-raises ``errors`` (default ``ValueError``, ``TypeError``) raised inside as a
    ``ConfigError`` whose message starts with ``key``; a ``ConfigError`` names its own key."""
    caught = errors or (ValueError, TypeError)
    try:
        yield
    except tasks.ConfigError:
        raise
    except caught as error:
        raise tasks.ConfigError(f"{key}: {error}") from error


@contextlib.contextmanager
def refused_or_noted(notes: list[str] | None, *errors: type[Exception]) -> Iterator[None]:
    """``errors`` raised inside propagate (they refuse the run), or, with ``notes`` (a dry
    run, which writes nothing and need not be refused), are kept there as messages."""
    try:
        yield
    except errors as error:
        if notes is None:
            raise
        notes.append(str(error))


def _first_batch(data: Any) -> Any:
    """The first batch of ``data`` without consuming it (``None``: none, or a one-pass
    iterator); a Grain ``MapDataset`` or a sequence is indexed, starting no workers."""
    if isinstance(data, grain.MapDataset | Sequence):
        try:
            return data[0]
        except IndexError:
            return None
    iterator = iter(data)
    return None if iterator is data else next(iterator, None)


@contextlib.contextmanager
def _workdir_lock(workdir: Path) -> Iterator[None]:
    """Process 0 holds the workdir's ``RunLock`` for the run: a second run there is refused."""
    if jax.process_index() != 0:
        yield
        return
    try:
        lock = RunLock(workdir).acquire()
    except DirectoryInUse as error:
        raise tasks.ConfigError(f"--workdir={workdir}: {error}") from None
    with lock:
        yield


def run(
    config: ml_collections.ConfigDict, workdir: str | os.PathLike[str], *, dry_run: bool = False
) -> RunResult:
    """Trains the model ``config`` describes and evaluates it: ``main`` without the flags.

    JAX must already see enough devices for ``config.strategy`` (see
    ``simulate_host_devices``). Writes ``config.json``, ``metrics.csv``, ``tb/``
    and ``checkpoints/`` under ``workdir``, and nothing before the whole run is
    built and checked: a config that cannot run (a value out of range, a
    layout that does not fit, a batch the mesh cannot split, an unwritable
    ``workdir``, or one that holds a file or checkpoints it cannot write) raises a
    ``tasks.ConfigError`` naming the key, and a resume from checkpoints of another
    model raises ``CheckpointOfAnotherModel``, with nothing written.
    With ``dry_run`` it prints the plan of the train step (``Plan.report``) and
    returns there: nothing trained, nothing written; what would refuse the run in
    ``workdir`` (it writes nothing, so it works in a read-only one) follows the plan
    as a note.
    """
    tasks.check_config(config)
    workdir = Path(workdir)
    notes: list[str] | None = [] if dry_run else None
    with refused_or_noted(notes, tasks.ConfigError):
        check_workdir_writable(workdir)
    with blamed_on(f"config.strategy={config.strategy!r}"):
        # "fsdp=-1,model=2" (the default job) fits itself to the devices there are.
        spec, why = tasks.fit_to_devices(config.strategy, jax.device_count())
        strategy: Strategy | Auto
        if spec == "auto":  # chosen below, holding each process to DataParallel's rows
            strategy = Auto(memory_budget_bytes=config.memory_budget_bytes or None, report=_say)
            shard = DataParallel().data_shard(DataParallel().make_mesh())
        else:
            strategy = tasks.parse_strategy(spec)
            # Which rows this process reads is a question of the layout: the strategy says.
            shard = strategy.data_shard(strategy.make_mesh())
    with blamed_on(f"config.{config.model}"):
        task = tasks.build_task(config, shard=shard)
    splits = task.splits
    with blamed_on("--workdir", OSError):
        run_callbacks = make_callbacks(config, workdir)
    try:  # the state is built lazily: this traces the model, allocates nothing
        trainer = Trainer(
            task.model,
            tasks.make_optimizer(config),
            strategy=strategy,
            loss_fn=task.loss_fn,
            metrics=tasks.Metrics,
            callbacks=[*run_callbacks, BaselineReport(splits.baseline, splits.baseline_name)],
            seed=config.seed,
            grad_accum_steps=config.grad_accum_steps,
            max_steps_in_flight=config.max_steps_in_flight,
            config=config,
        )
    except ShardingError as error:  # a parameter the layout cannot split
        raise tasks.ConfigError(
            f"config.strategy={spec!r} (or config.{config.model}): {error}"
        ) from error
    except (ValueError, TypeError) as error:
        raise tasks.ConfigError(f"config.{config.model}: {error}") from error
    if isinstance(strategy, Auto):  # planned and timed on the first batches, as fit would
        with blamed_on(
            f"config.strategy='auto' (config.memory_budget_bytes={strategy.memory_budget_bytes})"
        ):
            strategy = trainer.choose_layout(
                itertools.islice(iter(splits.train), strategy.steps)
            ).strategy
    accumulation = f" with config.grad_accum_steps={config.grad_accum_steps}"
    batch_key = (
        f"config.batch_size={config.batch_size}"
        f"{accumulation if config.grad_accum_steps > 1 else ''}"
    )
    with blamed_on(batch_key):
        batch = _first_batch(splits.train)
    # The layout's answer for the batch: a sequence SequenceParallel cannot split is the
    # sequence length's fault (or the layout's), not the batch size's.
    seq_len = config.get(config.model, {}).get("seq_len")
    with blamed_on(
        f"config.strategy={spec!r}"
        + (f" with config.{config.model}.seq_len={seq_len}" if seq_len else "")
    ):
        shardings = trainer.placement.shardings(batch) if batch is not None else None
    with blamed_on(batch_key):
        if batch is not None:  # as fit will place it
            data.check_batch(
                batch,
                shardings,
                divisor=config.grad_accum_steps,
                data_shards=trainer.placement.data_shard.count,
            )
    if config.resume:  # the checkpoints to resume must be of this model
        with refused_or_noted(notes, callbacks.checkpoint_checks.CheckpointOfAnotherModel):
            for callback in run_callbacks:
                if isinstance(callback, callbacks.OrbaxCheckpoint):
                    callback.check_model()
        if jax.process_count() > 1:
            # Every process has looked before any creates the directory: they all saw the
            # same files, so all opened the same Orbax managers (whose barriers count).
            multihost_utils.sync_global_devices("checkpoints checked against the model")
    if notes is not None:  # a dry run
        first = batch if batch is not None else next(iter(splits.train))
        _say(str(plan_of(trainer, first)))
        for note in notes:
            _say(f"note: the run itself would be refused: {note}")
        return RunResult(trainer.history, float("nan"), splits.baseline, splits.baseline_name, None)
    started = (
        f"{config.model} on {trainer.mesh.size} {jax.devices()[0].platform} devices, "
        f"mesh {dict(trainer.mesh.shape)} ({strategy!r}, from strategy {config.strategy!r}"
        f"{': ' + why if why else ''}), {config.max_steps} steps of "
        f"{config.batch_size} examples; {splits.baseline_name} {splits.baseline:.4f}; "
        f"workdir {workdir}"
    )
    # Checked: from here on the run writes, and no other run may write here too.
    with _workdir_lock(workdir):
        return _train(config, workdir, trainer, splits, started)


def _train(
    config: ml_collections.ConfigDict,
    workdir: Path,
    trainer: Trainer,
    splits: datasets.Splits,
    started: str,
) -> RunResult:
    """The writing part of ``run``, with everything checked: trains, evaluates, reports."""
    if jax.process_index() == 0:
        with blamed_on(f"--workdir={workdir} is not writable", OSError):
            workdir.mkdir(parents=True, exist_ok=True)
            (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
    if not config.resume:
        set_old_checkpoints_aside(workdir)
        if jax.process_count() > 1:  # the others look for checkpoints only after the move
            multihost_utils.sync_global_devices("old checkpoints set aside")
    _say(started)
    history = trainer.fit(
        iter(splits.train),  # one iterator: a second fit would continue the stream
        eval_data=splits.eval,
        max_steps=config.max_steps,
        eval_every_n_steps=config.eval_every_n_steps or None,
    )
    eval_losses = history.history.get("eval/loss", [float("nan")])
    result = RunResult(history, eval_losses[-1], splits.baseline, splits.baseline_name, trainer)
    if trainer.progress.preempted:
        _say(_preempted_line(trainer))
        return result
    verdict = "beats" if result.beats_baseline else "does NOT beat"
    accuracy = history.history.get("eval/accuracy", [float("nan")])[-1]
    _say(
        f"final after {trainer.step} steps: eval loss {result.eval_loss:.4f} (accuracy "
        f"{accuracy:.3f}); {verdict} the {splits.baseline_name} {splits.baseline:.4f} "
        f"by {splits.baseline - result.eval_loss:+.4f} nats"
    )
    if waits := history.history.get("perf/data_wait_fraction"):
        _say(f"input: the steps waited for batches {100 * float(np.mean(waits)):.1f}% of the time")
    _say(goodput_line(trainer.report.perf.goodput()))
    return result


def _preempted_line(trainer: Trainer) -> str:
    """What a SIGTERM left behind: the step saved, or (before any step) the checkpoints as
    they were."""
    checkpoint = next(c for c in trainer.callbacks if isinstance(c, callbacks.OrbaxCheckpoint))
    if checkpoint.stopped_before_a_step:
        return (
            f"stopped by SIGTERM before any step (at step {trainer.step}): nothing trained, "
            "nothing saved; run the same command to continue"
        )
    return f"stopped by SIGTERM after step {trainer.step}, saved; run the same command to continue"


def plan_of(trainer: Trainer, batch: Any) -> Any:
    """The plan report of ``trainer``'s train step on global batches shaped like ``batch``
    (this process's rows, times the row sets the processes feed)."""
    rows = trainer.placement.data_shard.count
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((np.shape(x)[0] * rows, *np.shape(x)[1:]), x.dtype),
        jax.tree.map(np.asarray, batch),
    )
    return trainer.plan.report(shapes, train_step=trainer.train_step)


def goodput_line(goodput: dict[str, float]) -> str:
    """One line: where the wall time of ``fit`` went, in seconds and shares."""
    wall = goodput["goodput/wall_s"]
    parts = [
        (key.removeprefix("goodput/").removesuffix("_s"), value)
        for key, value in goodput.items()
        if key != "goodput/wall_s"
    ]
    shares = ", ".join(f"{name} {100 * value / wall:.1f}%" for name, value in parts if wall > 0)
    return f"time: {wall:.1f} s of fit = {shares}"


def _say(line: str) -> None:
    """A line of the run's report, from process 0 only."""
    if jax.process_index() == 0:
        tqdm.write(line, file=sys.stdout)  # does not tear a progress bar on a terminal


# -- command line -------------------------------------------------------------------------
def _embedded(value: str) -> str:
    """A config path, or the embedded file when it names a shipped config missing from the cwd."""
    path, colon, rest = value.partition(":")  # config_flags passes "file.py:arg" on to get_config
    name = Path(path).name.removesuffix(".py")
    embedded = CONFIGS_DIR / f"{name}.py"
    if Path(path).is_file():  # a file of the user's wins; a folder of that name does not
        return value
    if embedded.exists() and not name.startswith("_"):
        return f"{embedded}{colon}{rest}"
    _fail(f"--config={value} is neither a config file nor a shipped config ({_shipped()}).")


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """Resolves ``--config`` (a path, or ``tp`` / ``configs/tp.py`` from any cwd) and makes
    it explicit: ``--config=<embedded default.py>`` is inserted when absent, so every
    override is checked against the config at parse time."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            argv[i] = "--config=" + _embedded(arg.removeprefix("--config="))
            return argv
        if arg == "--config" and i + 1 < len(argv):
            argv[i + 1] = _embedded(argv[i + 1])
            return argv
    return [*argv[:1], f"--config={CONFIGS_DIR / 'default.py'}", *argv[1:]]


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parser; a flag it refuses (an unknown flag or config key, a value of the wrong
    type) is one line on stderr and exit status 2, as every configuration error."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:  # e.g. "flag --config.max_steps=abc: invalid literal ..."
        _fail(f"{str(error).removeprefix('flag ')} (see --help for the keys and their values)")
    except (AttributeError, KeyError) as error:  # ml_collections raises these, not flags.Error
        detail: object = error
        while isinstance(detail, BaseException) and detail.args:
            detail = detail.args[0]
        key, _, hint = str(detail).partition("\n")
        overrides = [a.split("=", 1)[0] for a in argv if a.startswith("--config.")]
        name = key.strip("'\"")
        flag = next((o for o in overrides if o.endswith(f".{name}")), ", ".join(overrides))
        files = [a.removeprefix("--config=") for a in argv if a.startswith("--config=")]
        _fail(
            f"{flag}: the config has no key {key}; an override must name a key defined in "
            f"{', '.join(files)} (see --help).{' ' + hint if hint else ''}"
        )


def _shipped() -> str:
    return ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.py") if not p.stem.startswith("_")))


def _fail(message: str, status: int = 2) -> NoReturn:
    """An error the user can act on: one line on stderr, exit status 2 (a configuration
    error, as argparse does) unless ``status`` says otherwise."""
    line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    sys.stderr.write(f"nnx-spmd-train: error: {line}\n")
    sys.exit(status)


class _OrbaxLog(std_logging.Filter):
    """Orbax logs a failed save with a traceback from each of its threads, though the
    failure reaches the run as one ``CheckpointWriteError``: its lines keep no traceback,
    and after Ctrl-C (which fails the save in flight on purpose) none is kept."""

    interrupted = False

    def filter(self, record: std_logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return not self.interrupted


ORBAX_LOG = _OrbaxLog()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C: Python's own ``KeyboardInterrupt``, with Orbax's logs quiet from here."""
    del signum, frame
    ORBAX_LOG.interrupted = True
    raise KeyboardInterrupt


def _config_keys(config_file: str) -> list[str]:
    """``key = default`` for every key of the config in ``config_file``."""
    spec = importlib.util.spec_from_file_location("_config_for_help", config_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def flat(prefix: str, node: Any) -> list[str]:
        if isinstance(node, dict):
            return [line for key, value in node.items() for line in flat(f"{prefix}{key}.", value)]
        return [f"  --config.{prefix[:-1]}={node!r}"]

    return flat("", module.get_config().to_dict())


def usage(argv: Sequence[str]) -> str:
    """``--help``: the flags, the shipped configs and the keys of the chosen config."""
    config_file = next(a.removeprefix("--config=") for a in argv if a.startswith("--config="))
    config_file = config_file.partition(":")[0]
    return "\n".join(
        [
            "usage: nnx-spmd-train [--config=NAME|FILE] [--config.KEY=VALUE ...] "
            "[--workdir=DIR] [--export=DIR] [--num_processes=N]",
            "",
            "Trains the model a config describes on every device (8 simulated CPU devices",
            "when there is no accelerator); running it again resumes from --workdir.",
            "",
            f"  --config=NAME|FILE  a shipped config ({_shipped()}) or a config file;",
            "                      default: default (a small GPT on pydoc text)",
            "  --workdir=DIR       logs, TensorBoard events and checkpoints "
            "(default: runs/<config name>)",
            "  --export=DIR        write the trained parameters as a plain Orbax checkpoint",
            "  --num_processes=N   run as N processes of one JAX job on this machine",
            "                      (on a cluster: one per host, with --coordinator_address",
            "                      and --process_id, or JAX's cluster detection)",
            "  --helpfull          every flag, the libraries' too",
            "",
            f"Keys of {Path(config_file).name}, with their values (override any with "
            "--config.KEY=VALUE):",
            *_config_keys(config_file),
        ]
    )


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
                check_export_path(flags.FLAGS.export)
            except FileExistsError:
                raise tasks.ConfigError(
                    f"--export={Path(flags.FLAGS.export).absolute()} exists and is not an "
                    "empty directory: refusing to overwrite it; remove it or pass another "
                    "--export."
                ) from None
            check_writable(flags.FLAGS.export, "--export")
    except tasks.ConfigError as error:
        _fail(str(error))
    # This process's share of the devices: a SLURM task learns the count from SLURM.
    processes = distributed.expected_processes(
        flags.FLAGS.num_processes if flags.FLAGS.coordinator_address else None
    )
    simulate_host_devices(max(1, config.num_devices // processes))
    distributed.initialize(
        flags.FLAGS.coordinator_address,
        flags.FLAGS.num_processes if flags.FLAGS.coordinator_address else None,
        flags.FLAGS.process_id,
    )
    try:
        with distributed.lost_peers_named():  # a collective failed: was a process lost?
            result = run(config, workdir, dry_run=flags.FLAGS.dry_run)
    except (tasks.ConfigError, ShardingError) as error:  # the config, not the code
        _fail(str(error))
    except callbacks.checkpoint_checks.CheckpointOfAnotherModel as error:  # workdir vs config
        record = Path(workdir).absolute() / "config.json"  # left as it was: see run()
        _fail(
            f"{error} The config they were trained with is in {record}; "
            "--config.resume=False starts over (they are moved aside, not deleted)."
        )
    except callbacks.checkpoint_save.CheckpointWriteError as error:  # names step, path, cause
        _fail(str(error), status=1)
    if flags.FLAGS.dry_run:
        return 0
    if flags.FLAGS.export and not (result.trainer and result.trainer.progress.preempted):
        assert result.trainer is not None
        path = export_params(result.trainer.model, flags.FLAGS.export)
        if jax.process_index() == 0:
            _say(
                f"parameters exported to {path}; load them with plain Orbax: "
                f"orbax.checkpoint.PyTreeCheckpointer().restore({str(path)!r})"
            )
    return 0


def local_launch(argv: Sequence[str]) -> distributed.Launch | None:
    """``--num_processes=N`` with no coordinator: N processes of this command, here."""
    values = dict(a.removeprefix("--").split("=", 1) for a in argv[1:] if "=" in a)
    processes = int(values.get("num_processes", "1"))
    if processes == 1 or "coordinator_address" in values or distributed.PROCESS_ID in os.environ:
        return None
    rest = [a for a in argv[1:] if not a.startswith("--num_processes=")]
    try:
        return distributed.Launch([sys.executable, "-m", "nnx_spmd_trainer", *rest], processes)
    except ValueError as error:
        _fail(str(error))


def main(argv: Sequence[str] | None = None) -> None:
    """The console entry point: parses flags (absl) and runs; exits non-zero on failure.

    Call it once per process (absl parses flags once).
    """
    argv = normalize_argv(sys.argv if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(usage(argv))
        sys.exit(0)
    if (launch := local_launch(argv)) is not None:
        sys.exit(launch.run())
    # From here a SIGTERM is a preemption notice, whenever it comes (imports, restore,
    # compilation): fit acts on it at its first check (callbacks/preemption.py).
    callbacks.preemption.listen_early()
    config_flags.DEFINE_config_file(
        "config",
        default=None,  # normalize_argv always names one
        help_string="Config file, or the name of an embedded config (default, dp, fsdp, tp, "
        "hybrid, mlp, cnn). Override keys with --config.key=value.",
        lock_config=True,
        sys_argv=argv,
    )
    flags.DEFINE_string("workdir", None, "Output directory (default: runs/<config name>).")
    flags.DEFINE_string(
        "export", None, "Write the trained parameters here as a plain Orbax checkpoint."
    )
    flags.DEFINE_integer("num_processes", 1, "Processes of the job (alone: launched here).")
    flags.DEFINE_bool(
        "dry_run", False, "Print the plan of the train step (memory, collectives) and exit."
    )
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host).")
    flags.DEFINE_integer("process_id", None, "This process's index (with coordinator_address).")
    signal.signal(signal.SIGINT, _interrupt)
    try:
        app.run(_main, argv=argv, flags_parser=_parse_flags)
    except KeyboardInterrupt:  # the checkpoint in flight was dropped; the committed ones stay
        sys.stderr.write(
            "nnx-spmd-train: interrupted; the checkpoints committed so far are kept: "
            "run the same command to resume\n"
        )
        _exit_at_once(130)  # 128 + SIGINT, as a shell reports it


def _exit_at_once(status: int) -> NoReturn:
    """Ends the process after Ctrl-C: the exit handlers run (JAX's, the logs'), but not
    Python's wait for the threads left or its final garbage collection.

    Ctrl-C inside an Orbax save interrupts Orbax's event loop on the main thread, which
    Orbax then closes with coroutines still suspended in it, and may leave a thread of
    the save waiting for a signal that never comes. At exit, Python would wait for that
    thread (the process hung until killed), and collecting those coroutines runs their
    cleanup on the closed loop ("RuntimeError: Event loop is closed" and "Task was
    destroyed" after the exit line). Nothing of value is left running:
    ``OrbaxCheckpoint.on_exception`` already waited for the save that was in flight, and
    the interrupted one was never committed.
    """
    gc.disable()  # no collection of the interrupted save's coroutines from here on
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()  # what sys.exit would run, minus the thread joins
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
