"""What a config asks of the run before anything is built: its strategy (``parse_strategy``,
``fit_to_devices``), compute dtype, optimizer, and the checks that refuse it in one line
(``ConfigError``)."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import ml_collections
import optax

from nnx_spmd_trainer import (
    EMA,
    FSDP,
    AxisStrategy,
    DataParallel,
    ExpertParallel,
    Hybrid,
    PipelineParallel,
    SequenceParallel,
    SpikeSkip,
    Strategy,
    TensorParallel,
    optim,
)
from nnx_spmd_trainer.configs import _base
from nnx_spmd_trainer.nn import ATTENTION_FORMS as FORMS


class ConfigError(ValueError):
    """A config that cannot run (a bad strategy string, model, batch size): the CLI prints
    its message as one line and exits 2."""


#: The CLI's names of a ``PipelineParallel`` member (``pipeline`` is not one).
STAGE_NAMES = ("stage", "pp")


def parse_strategy(spec: str, sequence_attention: str = "all_gather") -> Strategy:
    """``"fsdp=4,model=2"`` -> ``Hybrid(FSDP(4), TensorParallel(2))``.

    Members are ``name[=size]`` (``name:size`` also works), in mesh order;
    names ``data``/``dp``, ``fsdp``, ``model``/``tp``, ``seq``/``sp``
    (``SequenceParallel``: the sequence split), ``stage``/``pp``
    (``PipelineParallel``: microbatches = stages), ``expert``/``ep``
    (``ExpertParallel``: a MoE model's experts split); a missing size is -1
    ("all devices left"). One member gives that strategy, several a Hybrid.
    ``sequence_attention`` (``config.sequence_attention``) is the ``seq``
    member's ``attention``: ``"all_gather"`` or ``"ring"``.

    >>> parse_strategy("data")
    DataParallel()
    >>> parse_strategy("data=2, fsdp=2, tp=2")
    Hybrid(DataParallel(2), FSDP(2), TensorParallel(2))
    >>> parse_strategy("fsdp=2,seq=4")
    Hybrid(FSDP(2), SequenceParallel(4))
    >>> parse_strategy("data=2,stage=4")
    Hybrid(DataParallel(2), PipelineParallel(4))
    >>> parse_strategy("data=2,expert=4")
    Hybrid(DataParallel(2), ExpertParallel(4))
    >>> parse_strategy("fsdp=2,seq=4", sequence_attention="ring")
    Hybrid(FSDP(2), SequenceParallel(4, attention='ring'))
    """
    if sequence_attention not in FORMS:
        raise ConfigError(
            f"config.sequence_attention={sequence_attention!r}; use one of {FORMS} (how a "
            "seq member attends over the split sequence)."
        )
    kinds: dict[str, type[AxisStrategy] | type[PipelineParallel]] = {
        "data": DataParallel,
        "dp": DataParallel,
        "fsdp": FSDP,
        "model": TensorParallel,
        "tp": TensorParallel,
        "seq": SequenceParallel,
        "sp": SequenceParallel,
        "expert": ExpertParallel,
        "ep": ExpertParallel,
        **dict.fromkeys(STAGE_NAMES, PipelineParallel),
    }
    members: list[Strategy] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, size = part.replace(":", "=").partition("=")
        kind = kinds.get(name.strip().lower())
        if kind is None:
            raise ConfigError(
                f"Unknown strategy member {name.strip()!r} in strategy {spec!r}; use "
                "data (or dp), fsdp, model (or tp), seq (or sp), stage (or pp), expert (or "
                "ep), e.g. "
                "'fsdp=4,model=2'."
            )
        try:
            member_size = int(size) if size.strip() else -1
            if kind is SequenceParallel:
                members.append(SequenceParallel(member_size, attention=sequence_attention))
            else:
                members.append(kind(member_size))
        except ValueError:
            raise ConfigError(
                f"Size {size!r} of {name.strip()!r} in strategy {spec!r} is not an integer."
            ) from None
    if not members:
        raise ConfigError(
            f"Strategy {spec!r} names no member; use e.g. 'data' or 'fsdp=4,model=2'."
        )
    return members[0] if len(members) == 1 else Hybrid(*members)


def spanning_hosts(strategy: Strategy, spec: str) -> Strategy:
    """``strategy`` as a ``Hybrid`` whose ``across_hosts`` is ``spec`` (``config.across_hosts``):
    comma-separated ``axis=hosts``, each mesh axis and the number of hosts it spans;
    ``""``: ``strategy`` as given (the mesh follows the hosts by itself).

    >>> spanning_hosts(parse_strategy("data=2,fsdp=4"), "data=2")
    Hybrid(DataParallel(2), FSDP(4), across_hosts={'data': 2})
    >>> spanning_hosts(parse_strategy("model=8"), "model:2")
    Hybrid(TensorParallel(8), across_hosts={'model': 2})
    """
    hosts: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, count = part.replace(":", "=").partition("=")
        if name.strip() in hosts:
            raise ConfigError(f"config.across_hosts={spec!r} names {name.strip()!r} twice.")
        try:
            hosts[name.strip()] = int(count)
        except ValueError:
            raise ConfigError(
                f"config.across_hosts={spec!r}: {part!r} is not axis=hosts (a mesh axis and "
                "the number of hosts it spans), e.g. --config.across_hosts=data=2."
            ) from None
    if not hosts:
        return strategy
    members = strategy.members if isinstance(strategy, Hybrid) else (strategy,)
    return Hybrid(*members, across_hosts=hosts)


def compute_dtype(config: ml_collections.ConfigDict) -> Any:
    """``config.compute_dtype`` as a JAX dtype: ``float32``, or ``bfloat16``/``float16``
    for mixed precision (parameters and optimizer state stay float32)."""
    name = config.get("compute_dtype", "float32")
    if name not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"config.compute_dtype={name!r}; use 'float32', 'bfloat16' or 'float16'.")
    return jnp.dtype(name)


#: Integer keys every config has (``_base.training_config``): the least value, what it means.
INT_RANGES: dict[str, tuple[int, str]] = {
    "max_steps": (1, "the global step to stop at"),
    "batch_size": (1, "examples per step over all devices"),
    "grad_accum_steps": (1, "microbatches per step; 1: no accumulation"),
    "max_steps_in_flight": (1, "steps the host may dispatch ahead"),
    "log_every_n_steps": (1, "steps between logged metrics"),
    "num_devices": (1, "devices to simulate on the CPU"),
    "eval_every_n_steps": (0, "0: evaluate only at the end"),
    "checkpoint_every_n_steps": (0, "0: save only at the end"),
    "max_eval_batches": (0, "0: every held-out batch"),
    "warmup_steps": (0, "steps of linear warmup"),
    "memory_budget_bytes": (0, "per device, for strategy=auto; 0: the device's own"),
    "skip_spikes_window": (2, "accepted steps the spike statistics cover"),
}
#: Float keys: the least value, whether it may equal it, what it means.
FLOAT_RANGES: dict[str, tuple[float, bool, str]] = {
    "learning_rate": (0.0, True, "the peak learning rate"),
    "end_lr_fraction": (0.0, True, "the final learning rate as a fraction of the peak"),
    "weight_decay": (0.0, True, "AdamW's decoupled weight decay"),
    "grad_clip_norm": (0.0, False, "the global gradient norm clipped to"),
    "skip_spikes_z": (0.0, True, "standard deviations above the recent mean that skip a step"),
    "ema_decay": (0.0, True, "the EMA of the weights' decay, below 1; 0: no EMA"),
    "save_every_n_seconds": (0.0, True, "0: checkpoints by steps only"),
    "peak_flops": (0.0, True, "one device's peak FLOP/s for perf/mfu; 0: the device table's"),
}
#: Keys that may be ``None`` as well (the same as 0: off).
OPTIONAL = frozenset({"eval_every_n_steps", "checkpoint_every_n_steps", "max_eval_batches"})


def check_config(config: ml_collections.ConfigDict) -> None:
    """Raises a ``ConfigError`` naming the key and the fix for the first training key out of
    range (``INT_RANGES``, ``FLOAT_RANGES``, ``compute_dtype``); reads nothing else.

    Only the values are checked: whether the batch splits over the mesh, and
    the model's own sizes, are questions for the strategy and the model.

    >>> try:
    ...     check_config(ml_collections.ConfigDict({"max_steps": -1}))
    ... except ConfigError as error:
    ...     print(str(error).partition(" (")[0])
    config.max_steps=-1: must be an integer >= 1
    """
    defaults = _base.training_config()  # values known to work: the fix to suggest
    for key, (least, meaning) in INT_RANGES.items():
        if key not in config or (key in OPTIONAL and config[key] is None):
            continue
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            fix = f"pass e.g. --config.{key}={defaults[key]}"
            if key in OPTIONAL:
                fix = f"pass --config.{key}=0 or a positive number"
            raise ConfigError(
                f"config.{key}={value!r}: must be an integer >= {least} ({meaning}); {fix}."
            )
    for key, (floor, inclusive, meaning) in FLOAT_RANGES.items():
        if key not in config:
            continue
        number = config[key]
        is_number = isinstance(number, int | float) and not isinstance(number, bool)
        in_range = (
            is_number
            and math.isfinite(number)
            and (number >= floor if inclusive else number > floor)
        )
        if not in_range:
            bound = f"{'>=' if inclusive else '>'} {floor:g}"
            raise ConfigError(
                f"config.{key}={number!r}: must be a finite number {bound} ({meaning}); "
                f"pass e.g. --config.{key}={defaults[key]}."
            )
    if "compute_dtype" in config:
        compute_dtype(config)


def averaging_and_spikes(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The ``Trainer``'s ``ema`` and ``skip_spikes`` from ``config.ema_decay`` and
    ``config.skip_spikes_z`` / ``skip_spikes_window`` (0: off), or a ``ConfigError``.

    >>> averaging_and_spikes(ml_collections.ConfigDict({"ema_decay": 0.99}))
    {'ema': EMA(decay=0.99, warmup=True), 'skip_spikes': None}
    """
    decay, z = config.get("ema_decay", 0.0), config.get("skip_spikes_z", 0.0)
    window = config.get("skip_spikes_window", 100)
    try:
        ema = EMA(decay=decay) if decay else None
    except ValueError as error:
        raise ConfigError(f"config.ema_decay={decay!r}: {error}") from None
    try:
        spikes = SpikeSkip(z=z, window=window, min_steps=min(20, window)) if z else None
    except ValueError as error:
        raise ConfigError(
            f"config.skip_spikes_z={z!r}, config.skip_spikes_window={window!r}: {error}"
        ) from None
    return {"ema": ema, "skip_spikes": spikes}


def fit_to_devices(spec: str, num_devices: int) -> tuple[str, str]:
    """A strategy spec with a ``-1`` member made to fit ``num_devices``; and why, if changed.

    Sizes given next to a ``-1`` are wishes: each shrinks to the largest size
    that divides the devices left (``model=2`` on one device becomes
    ``model=1``), and the ``-1`` member takes the rest. A spec without ``-1``
    is returned as it is (a mesh that does not fit is then an error).

    >>> fit_to_devices("fsdp=-1,model=2", 8)
    ('fsdp=4,model=2', '')
    >>> fit_to_devices("fsdp=-1,model=2", 1)
    ('fsdp=1,model=1', 'model=2 does not fit 1 device, so model=1')
    >>> fit_to_devices("auto", 8)
    ('auto', '')
    """
    if spec.strip().lower() == "auto":
        return spec, ""
    parts = [p.strip().replace(":", "=").partition("=") for p in spec.split(",") if p.strip()]
    sizes = [int(size) if size.strip() else -1 for _, _, size in parts]
    if -1 not in sizes:
        return spec, ""
    left, reasons = num_devices, []
    for i, ((name, _, _), size) in enumerate(zip(parts, sizes, strict=True)):
        if size > 0:
            fitted = math.gcd(size, left)
            if fitted != size:
                devices = f"{left} device{'s' if left > 1 else ''}"
                reasons.append(f"{name}={size} does not fit {devices}, so {name}={fitted}")
            sizes[i], left = fitted, left // fitted
    for i, size in enumerate(sizes):
        if size == -1:  # the first -1 takes the devices left, any other gets 1
            sizes[i], left = left, 1
    fitted_spec = ",".join(
        f"{name}={size}" for (name, _, _), size in zip(parts, sizes, strict=True)
    )
    return fitted_spec, "; ".join(reasons)


def schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
    """The learning rate by step: warmup, then cosine decay to ``end_lr_fraction`` of the
    peak at ``max_steps``; planned from ``config.max_steps``, so another ``max_steps`` on
    resume is another schedule (``job_checks.schedule_change_on_resume``)."""
    warmup = min(config.warmup_steps, config.max_steps // 2)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(config.max_steps, warmup + 1),
        end_value=config.learning_rate * config.end_lr_fraction,
    )


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """AdamW (or, with ``config.optimizer="muon"``, ``optim.muon`` with AdamW for the
    non-matrix leaves) after global-norm clipping; ``schedule``'s learning rate, injected
    so it is visible.

    ``optax.inject_hyperparams`` keeps the current learning rate in the
    optimizer state (``hyperparams["learning_rate"]``) for LearningRateMonitor.
    """
    lr_schedule = schedule(config)
    kind = config.get("optimizer", "adamw")
    if kind not in ("adamw", "muon"):
        raise ValueError(
            f"config.optimizer={kind!r}: use 'adamw' or 'muon' (--config.optimizer=muon)."
        )

    def adamw(learning_rate: Any) -> optax.GradientTransformation:
        if kind == "muon":  # Moonlight's RMS match: AdamW's learning rate serves both
            inner = optim.muon(
                learning_rate,
                weight_decay=config.weight_decay,
                adam_weight_decay=config.weight_decay,
                consistent_rms=0.2,
            )
        else:
            inner = optax.adamw(learning_rate, weight_decay=config.weight_decay)
        return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), inner)

    return optax.inject_hyperparams(adamw)(learning_rate=lr_schedule)
