"""``nnx-spmd-train``: train an example model from an ml_collections config.

    nnx-spmd-train                                    # the default: GPT on pydoc topics
    nnx-spmd-train --config=configs/tp.py --config.max_steps=20 --workdir=/tmp/tp
    python -m nnx_spmd_trainer --config=mlp          # an embedded config, by name

``--config`` takes a config file path, or the name of a config shipped in
``nnx_spmd_trainer.configs``; ``--config.key=value`` overrides any key, and a
key the config does not have is an error. Logs, TensorBoard events and
checkpoints go under ``--workdir`` (default ``runs/<config name>``).

Without an accelerator, ``config.num_devices`` CPU devices are simulated
(``--xla_force_host_platform_device_count``) unless ``XLA_FLAGS`` already sets a count.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import pkgutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ml_collections
from absl import app, flags
from ml_collections import config_flags

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def _configs_dir() -> Path:
    from nnx_spmd_trainer import configs  # wherever the install put the package

    return Path(configs.__file__).resolve().parent


_CONFIG = config_flags.DEFINE_config_file(
    "config",
    default=str(_configs_dir() / "default.py"),
    help_string="Config file, or the name of an embedded config (default, dp, fsdp, tp, "
    "hybrid, mlp, cnn). Override keys with --config.key=value.",
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (default: runs/<config name>).")


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


# -- what a config builds ----------------------------------------------------------------
def parse_strategy(spec: str) -> Any:
    """``"fsdp=4,model=2"`` -> ``Hybrid(FSDP(4), TensorParallel(2))``.

    Members are ``name[=size]`` (``name:size`` also works), in mesh order;
    names ``data``/``dp``, ``fsdp``, ``model``/``tp``; a missing size is -1
    ("all devices left"). One member gives that strategy, several a Hybrid.

    >>> parse_strategy("data")
    DataParallel()
    >>> parse_strategy("data=2, fsdp=2, tp=2")
    Hybrid(DataParallel(2), FSDP(2), TensorParallel(2))
    """
    from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, TensorParallel

    kinds = {"data": DataParallel, "dp": DataParallel, "fsdp": FSDP, "model": TensorParallel}
    kinds["tp"] = TensorParallel
    members = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, size = part.replace(":", "=").partition("=")
        kind = kinds.get(name.strip().lower())
        if kind is None:
            raise ValueError(
                f"Unknown strategy member {name.strip()!r} in strategy {spec!r}; use "
                "data (or dp), fsdp, model (or tp), e.g. 'fsdp=4,model=2'."
            )
        try:
            members.append(kind(int(size) if size.strip() else -1))
        except ValueError:
            raise ValueError(f"Size {size!r} of {name.strip()!r} in strategy {spec!r} is not an integer.") from None
    if not members:
        raise ValueError(f"Strategy {spec!r} names no member; use e.g. 'data' or 'fsdp=4,model=2'.")
    return members[0] if len(members) == 1 else Hybrid(*members)


def make_optimizer(config: ml_collections.ConfigDict) -> Any:
    """AdamW with global-norm clipping; warmup then cosine decay, injected so it is visible.

    ``optax.inject_hyperparams`` keeps the current learning rate in the
    optimizer state (``hyperparams["learning_rate"]``) for LearningRateMonitor.
    """
    import optax

    warmup = min(config.warmup_steps, config.max_steps // 2)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(config.max_steps, warmup + 1),
        end_value=config.learning_rate * config.end_lr_fraction,
    )

    def adamw(learning_rate: Any) -> optax.GradientTransformation:
        return optax.chain(
            optax.clip_by_global_norm(config.grad_clip_norm),
            optax.adamw(learning_rate, weight_decay=config.weight_decay),
        )

    return optax.inject_hyperparams(adamw)(learning_rate=schedule)


@dataclasses.dataclass(frozen=True)
class Task:
    """A model factory, its loss, and the data it learns."""

    model: Callable[[Any], Any]
    loss_fn: Callable[..., Any]
    splits: Any  # nnx_spmd_trainer.datasets.Splits


def build_task(config: ml_collections.ConfigDict, *, shard: tuple[int, int] = (0, 1)) -> Task:
    """The model, loss and data that ``config.model`` names ("gpt", "mlp" or "cnn")."""
    from nnx_spmd_trainer import datasets, models

    per_process = config.batch_size // shard[1]
    max_eval = config.max_eval_batches or None
    name = config.model
    if name not in ("gpt", "mlp", "cnn"):
        raise ValueError(f"config.model={name!r} is not one of 'gpt', 'mlp', 'cnn'.")
    if name not in config:
        raise ValueError(
            f"config.model={name!r} needs a config.{name} block with its sizes; "
            f"start from configs/{'default' if name == 'gpt' else name}.py."
        )
    sizes = config[name]
    if name == "gpt":
        tokenizer, splits = datasets.char_lm_splits(
            seq_len=sizes.seq_len,
            batch_size=per_process,
            seed=config.seed,
            eval_fraction=config.eval_fraction,
            max_eval_batches=max_eval,
            shard=shard,
        )
        kwargs = {k: sizes[k] for k in ("seq_len", "embed_dim", "num_heads", "ff_dim", "num_layers")}
        return Task(
            lambda rngs: models.GPT(
                vocab_size=tokenizer.vocab_size, dropout_rate=sizes.dropout_rate, rngs=rngs, **kwargs
            ),
            models.gpt.loss_fn,
            splits,
        )
    if name == "mlp":
        splits = datasets.classification_splits(
            num_features=sizes.num_features,
            num_classes=sizes.num_classes,
            batch_size=per_process,
            seed=config.seed,
            shard=shard,
        )
        return Task(
            lambda rngs: models.MLP(
                sizes.num_features,
                sizes.hidden_dim,
                sizes.num_classes,
                dropout_rate=sizes.dropout_rate,
                rngs=rngs,
            ),
            models.mlp.loss_fn,
            splits,
        )
    splits = datasets.image_splits(
        image_size=sizes.image_size,
        num_classes=sizes.num_classes,
        batch_size=per_process,
        seed=config.seed,
        shard=shard,
    )
    return Task(
        lambda rngs: models.CNN(1, sizes.channels, sizes.num_classes, rngs=rngs),
        models.mlp.loss_fn,
        splits,
    )


# -- the run ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RunResult:
    """What ``run`` returns: the history, the final held-out loss and the baseline it must beat."""

    history: Any  # nnx_spmd_trainer.History
    eval_loss: float
    baseline: float
    baseline_name: str

    @property
    def beats_baseline(self) -> bool:
        return self.eval_loss < self.baseline


def _callbacks(config: ml_collections.ConfigDict, workdir: Path, report: Any) -> list[Any]:
    from nnx_spmd_trainer import callbacks

    # --- TEMPORARY: remove once callbacks/ ships OrbaxCheckpoint ----------------------
    try:
        from nnx_spmd_trainer.callbacks import OrbaxCheckpoint
    except ImportError:
        OrbaxCheckpoint = None  # noqa: N806
    # --- end TEMPORARY -------------------------------------------------------------------
    chosen = [
        callbacks.MetricsLogger(config.log_every_n_steps),
        callbacks.LearningRateMonitor(),
        callbacks.TensorBoard(workdir / "tb"),
        callbacks.ProgressBar(),
        callbacks.CSVLogger(workdir / "metrics.csv"),
        report,
    ]
    if OrbaxCheckpoint is not None:
        every = config.checkpoint_every_n_steps or config.max_steps
        chosen.append(OrbaxCheckpoint(workdir / "ckpt", save_every_n_steps=every))
    return chosen


def run(config: ml_collections.ConfigDict, workdir: str | os.PathLike[str]) -> RunResult:
    """Trains the model ``config`` describes and evaluates it; ``main`` without the flags.

    JAX must already see enough devices for ``config.strategy`` (see
    ``simulate_host_devices``).
    """
    import jax

    from nnx_spmd_trainer import Callback, Trainer
    from nnx_spmd_trainer.callbacks.progress import format_logs

    workdir = Path(workdir)
    strategy = parse_strategy(config.strategy)
    task = build_task(config, shard=(jax.process_index(), jax.process_count()))
    splits = task.splits
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")

    class EvalReport(Callback):
        """Prints each held-out loss next to the baseline it must beat."""

        def on_test_end(self, logs: dict[str, float]) -> None:
            if "eval/loss" in logs and jax.process_index() == 0:
                _say(
                    f"step {self.trainer.step}: eval loss {logs['eval/loss']:.4f} "
                    f"({splits.baseline_name} {splits.baseline:.4f})"
                )

    from clu import metrics as clu_metrics

    metrics = clu_metrics.Collection.create(
        loss=clu_metrics.Average.from_output("loss"),
        accuracy=clu_metrics.Average.from_output("accuracy"),
    )
    trainer = Trainer(
        task.model,
        make_optimizer(config),
        strategy=strategy,
        loss_fn=task.loss_fn,
        metrics=metrics,
        callbacks=_callbacks(config, workdir, EvalReport()),
        seed=config.seed,
        grad_accum_steps=config.grad_accum_steps,
        max_steps_in_flight=config.max_steps_in_flight,
        config=config,
    )
    _say(
        f"{config.model} on {trainer.num_devices} {jax.devices()[0].platform} devices, "
        f"mesh {dict(trainer.mesh.shape)} ({strategy!r}), {config.max_steps} steps of "
        f"{config.batch_size} examples; {splits.baseline_name} {splits.baseline:.4f}; workdir {workdir}"
    )
    history = trainer.fit(
        iter(splits.train),  # one iterator: a second fit continues the stream
        eval_data=splits.eval,
        max_steps=config.max_steps,
        eval_every_n_steps=config.eval_every_n_steps or None,
    )
    eval_loss = history.history["eval/loss"][-1]
    result = RunResult(history, eval_loss, splits.baseline, splits.baseline_name)
    verdict = "beats" if result.beats_baseline else "does NOT beat"
    finals = {k: v[-1] for k, v in history.history.items() if k.startswith("eval/")}
    _say(
        f"final after {trainer.step} steps: {format_logs(finals)}; {verdict} the "
        f"{splits.baseline_name} {splits.baseline:.4f} by {splits.baseline - eval_loss:+.4f} nats"
    )
    return result


def _say(line: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stdout)  # does not tear a progress bar on a terminal


# -- command line -------------------------------------------------------------------------
def _resolve_config_arg(argv: Sequence[str]) -> list[str]:
    """``--config=tp`` or a ``configs/tp.py`` missing from the cwd -> the embedded file."""
    resolved = []
    for arg in argv:
        if arg.startswith("--config="):
            value = arg.removeprefix("--config=")
            path, colon, rest = value.partition(":")
            if not Path(path).exists():
                name = Path(path).name.removesuffix(".py")
                embedded = _configs_dir() / f"{name}.py"
                if embedded.exists() and not name.startswith("_"):
                    arg = f"--config={embedded}{colon}{rest}"
        resolved.append(arg)
    return resolved


def _main(argv: Sequence[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    config = _CONFIG.value
    config_path = config_flags.get_config_filename(flags.FLAGS["config"])
    workdir = _WORKDIR.value or os.path.join("runs", Path(config_path).stem)
    simulate_host_devices(config.num_devices)
    run(config, workdir)
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    """The console entry point: parses flags (absl) and runs; exits non-zero on failure."""
    argv = _resolve_config_arg(sys.argv if argv is None else argv)
    app.run(_main, argv=argv)


if __name__ == "__main__":
    main()
