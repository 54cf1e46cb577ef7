"""What a config builds: the strategy, the optimizer, the model, its loss and data."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import ml_collections
import optax
from clu import metrics as clu_metrics

from nnx_spmd_trainer import moe as moe_lib
from nnx_spmd_trainer import remat as remat_lib
from nnx_spmd_trainer.app import datasets, models
from nnx_spmd_trainer.app.models import gpt2_hf
from nnx_spmd_trainer.attention import FORMS
from nnx_spmd_trainer.configs import _base
from nnx_spmd_trainer.strategies import (
    FSDP,
    AxisStrategy,
    DataParallel,
    ExpertParallel,
    Hybrid,
    PipelineParallel,
    SequenceParallel,
    Strategy,
    TensorParallel,
)
from nnx_spmd_trainer.weights import WeightMap

#: Metrics computed inside the compiled step; every example loss returns ``accuracy`` in aux.
Metrics = clu_metrics.Collection.create(
    loss=clu_metrics.Average.from_output("loss"),
    accuracy=clu_metrics.Average.from_output("accuracy"),
)


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
}
#: Float keys: the least value, whether it may equal it, what it means.
FLOAT_RANGES: dict[str, tuple[float, bool, str]] = {
    "learning_rate": (0.0, True, "the peak learning rate"),
    "end_lr_fraction": (0.0, True, "the final learning rate as a fraction of the peak"),
    "weight_decay": (0.0, True, "AdamW's decoupled weight decay"),
    "grad_clip_norm": (0.0, False, "the global gradient norm clipped to"),
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


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """AdamW with global-norm clipping; warmup then cosine decay, injected so it is visible.

    ``optax.inject_hyperparams`` keeps the current learning rate in the
    optimizer state (``hyperparams["learning_rate"]``) for LearningRateMonitor.
    """
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
    """A model factory, its loss, and the data it learns; and, for a model whose
    pretrained weights exist as files, how the model is made from one
    (``weight_map``, for ``config.init_from``; ``None``: the task has none); the metrics
    its loss reports (``Metrics``, plus a MoE model's ``moe.moe_metrics``)."""

    model: Callable[[Any], Any]
    loss_fn: Callable[..., Any]
    splits: datasets.Splits
    weight_map: WeightMap | None = None
    metrics: type[clu_metrics.Collection] = Metrics


#: Builds a task from the config and this process's ``(index, count)`` shard of the data.
TaskBuilder = Callable[[ml_collections.ConfigDict, tuple[int, int]], Task]

#: The tasks ``config.model`` can name, filled by ``@register``; each reads its ``config.<name>``.
TASKS: dict[str, TaskBuilder] = {}


def register(name: str) -> Callable[[TaskBuilder], TaskBuilder]:
    """Decorator: adds a task builder to ``TASKS`` under ``name``.

    >>> @register("example")
    ... def example_task(config, shard): ...
    >>> "example" in TASKS
    True
    >>> del TASKS["example"]
    """

    def add(builder: TaskBuilder) -> TaskBuilder:
        if name in TASKS:
            raise ValueError(f"A task named {name!r} is already registered.")
        TASKS[name] = builder
        return builder

    return add


def build_task(config: ml_collections.ConfigDict, *, shard: tuple[int, int] = (0, 1)) -> Task:
    """The model, loss and data that ``config.model`` names (a key of ``TASKS``).

    ``shard`` is ``(index, count)`` (``strategy.data_shard(mesh)``): this
    process reads every ``count``-th example and ``config.batch_size // count``
    rows of each global batch.
    """
    name = config.model
    if name not in TASKS:
        raise ConfigError(f"config.model={name!r} is not one of {', '.join(map(repr, TASKS))}.")
    if name not in config:
        raise ConfigError(
            f"config.model={name!r} needs a config.{name} block with its sizes; "
            f"start from a config in configs/ whose model is {name!r}."
        )
    return TASKS[name](config, shard)


def _rows(config: ml_collections.ConfigDict, shard: tuple[int, int]) -> int:
    """This process's rows of each global batch."""
    if config.batch_size % shard[1]:
        raise ConfigError(
            f"config.batch_size={config.batch_size} cannot be split into {shard[1]} equal "
            f"per-process parts (the processes feed {shard[1]} distinct row sets); use a "
            f"multiple of {shard[1]}."
        )
    return config.batch_size // shard[1]


def _text_options(
    config: ml_collections.ConfigDict, shard: tuple[int, int], seq_len: int
) -> datasets.SplitOptions:
    """The job's keys for a text task's batches (``char_lm_splits``, ``byte_lm_splits``)."""
    return datasets.SplitOptions(
        seq_len=seq_len,
        batch_size=_rows(config, shard),
        seed=config.seed,
        eval_fraction=config.eval_fraction,
        max_eval_batches=config.max_eval_batches or None,
        shard=shard,
    )


@register("gpt")
def gpt_task(config: ml_collections.ConfigDict, shard: tuple[int, int]) -> Task:
    """A character-level GPT learning the pydoc topics text (``config.gpt``)."""
    sizes = config.gpt
    tokenizer, splits = datasets.char_lm_splits(**_text_options(config, shard, sizes.seq_len))
    kwargs = {k: sizes[k] for k in ("seq_len", "embed_dim", "num_heads", "ff_dim", "num_layers")}
    vocab_size = sizes.get("vocab_size") or tokenizer.vocab_size  # larger: unused rows
    if vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"config.gpt.vocab_size={vocab_size} is smaller than the text's "
            f"{tokenizer.vocab_size} characters; use 0 (the text's) or more."
        )
    dtype = compute_dtype(config)
    scan_layers, remat = gpt_layers(config)
    chunk_size = sizes.get("chunked_loss", 0)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 0:
        raise ConfigError(
            f"config.gpt.chunked_loss={chunk_size!r}: must be an integer >= 0 (sequence "
            "positions per chunk of the loss; 0: the plain loss over the full logits); "
            "pass e.g. --config.gpt.chunked_loss=128."
        )
    moe = gpt_moe(config)
    loss_fn: Callable[..., Any] = models.gpt.loss_fn
    if chunk_size:
        loss_fn = functools.partial(models.gpt.chunked_loss_fn, chunk_size=chunk_size)
    return Task(
        lambda rngs: models.GPT(
            vocab_size=vocab_size,
            dropout_rate=sizes.dropout_rate,
            rngs=rngs,
            dtype=dtype,
            scan_layers=scan_layers,
            remat=remat,
            **kwargs,
            **moe,
        ),
        loss_fn,
        splits,
        metrics=Metrics if not moe else moe_metrics_for(moe["moe_experts"]),
    )


def gpt_layers(config: ml_collections.ConfigDict) -> tuple[bool, str]:
    """``(config.gpt.scan_layers, config.gpt.remat)``, checked; off where a config lacks them.

    >>> gpt_layers(ml_collections.ConfigDict({"gpt": {"scan_layers": True, "remat": "full"}}))
    (True, 'full')
    """
    sizes = config.gpt
    scan_layers = sizes.get("scan_layers", False)
    if not isinstance(scan_layers, bool):
        raise ConfigError(
            f"config.gpt.scan_layers={scan_layers!r}: pass --config.gpt.scan_layers=True "
            "(stacked blocks run by nnx.scan) or False (one block after another)."
        )
    spec = str(config.get("strategy", ""))
    members = (p.replace(":", "=").partition("=")[0].strip().lower() for p in spec.split(","))
    if not scan_layers and any(m in STAGE_NAMES for m in members):
        raise ConfigError(
            f"config.strategy={spec!r} pipelines the GPT's stacked layers; pass "
            "--config.gpt.scan_layers=True (and config.gpt.num_layers divisible by the stages)."
        )
    policy = sizes.get("remat", "none")
    try:
        remat_lib.checkpoint_policy(policy)  # unknown names, offloading on the CPU
    except ValueError as error:
        raise ConfigError(f"config.gpt.remat={policy!r}: {error}") from None
    return scan_layers, policy


def moe_metrics_for(num_experts: int) -> type[clu_metrics.Collection]:
    """``Metrics`` with a MoE model's (``moe.moe_metrics``): load balance, dropped
    tokens, each expert's load."""
    return clu_metrics.Collection.create(
        loss=clu_metrics.Average.from_output("loss"),
        accuracy=clu_metrics.Average.from_output("accuracy"),
        **moe_lib.moe_metrics(num_experts),
    )


def gpt_moe(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The GPT's mixture-of-experts keywords from ``config.gpt.moe_*``, checked; none
    where ``moe_experts`` is 0 or absent (every block dense).

    >>> gpt_moe(ml_collections.ConfigDict({"gpt": {"moe_experts": 4, "moe_top_k": 2}}))
    {'moe_experts': 4, 'moe_top_k': 2, 'moe_every': 1}
    """
    sizes = config.gpt
    experts = sizes.get("moe_experts", 0)
    if not experts:
        return {}
    top_k, every = sizes.get("moe_top_k", 2), sizes.get("moe_every", 1)
    if not isinstance(experts, int) or experts < 2 or not 1 <= top_k <= experts or every < 1:
        raise ConfigError(
            f"config.gpt.moe_experts={experts!r}, moe_top_k={top_k!r}, moe_every={every!r}: "
            "need experts >= 2, 1 <= top_k <= experts and every >= 1 (every n-th block a "
            "MoE block), e.g. --config.gpt.moe_experts=4 --config.gpt.moe_top_k=2."
        )
    if sizes.get("scan_layers", False):
        raise ConfigError(
            "config.gpt.moe_experts with config.gpt.scan_layers=True: MoE blocks are not "
            "stacked yet; pass --config.gpt.scan_layers=False."
        )
    return {"moe_experts": experts, "moe_top_k": top_k, "moe_every": every}


@register("gpt2_hf")
def gpt2_hf_task(config: ml_collections.ConfigDict, shard: tuple[int, int]) -> Task:
    """Hugging Face's GPT-2 (``models.gpt2_hf.GPT2``) on the pydoc text as GPT-2's
    single-byte tokens (``config.gpt2_hf``); its ``weight_map`` reads HF's GPT-2 files,
    so ``config.init_from`` fine-tunes a published checkpoint."""
    sizes = config.gpt2_hf
    if compute_dtype(config) != jnp.float32:
        raise ConfigError(
            f"config.compute_dtype={config.compute_dtype!r}: the gpt2_hf model computes in "
            "float32 only; pass --config.compute_dtype=float32."
        )
    gpt2_config = gpt2_hf.GPT2Config(
        vocab_size=sizes.vocab_size,
        n_positions=sizes.n_positions,
        n_embd=sizes.n_embd,
        n_layer=sizes.n_layer,
        n_head=sizes.n_head,
        dropout=sizes.dropout,
        pad_vocab_to=sizes.pad_vocab_to,
    )
    if sizes.vocab_size < 256:
        raise ConfigError(
            f"config.gpt2_hf.vocab_size={sizes.vocab_size} is smaller than the 256 byte "
            "tokens the text is spelled in; use 256 or more (GPT-2's is 50257)."
        )
    if sizes.seq_len > sizes.n_positions:
        raise ConfigError(
            f"config.gpt2_hf.seq_len={sizes.seq_len} is longer than the model's "
            f"config.gpt2_hf.n_positions={sizes.n_positions}; use at most that."
        )
    if sizes.n_embd % sizes.n_head:
        raise ConfigError(
            f"config.gpt2_hf.n_embd={sizes.n_embd} is not a multiple of "
            f"config.gpt2_hf.n_head={sizes.n_head}."
        )
    scan_layers = sizes.get("scan_layers", False)
    if not isinstance(scan_layers, bool):
        raise ConfigError(
            f"config.gpt2_hf.scan_layers={scan_layers!r}: pass True (stacked blocks run by "
            "nnx.scan) or False (one block after another)."
        )
    _, splits = datasets.byte_lm_splits(**_text_options(config, shard, sizes.seq_len))
    return Task(
        lambda rngs: gpt2_hf.GPT2(gpt2_config, rngs, scan_layers=scan_layers),
        gpt2_hf.loss_fn,
        splits,
        weight_map=gpt2_hf.gpt2_weight_map(gpt2_config, scan_layers=scan_layers),
    )


@register("mlp")
def mlp_task(config: ml_collections.ConfigDict, shard: tuple[int, int]) -> Task:
    """An MLP learning a synthetic teacher network's labels (``config.mlp``)."""
    sizes = config.mlp
    splits = datasets.classification_splits(
        num_features=sizes.num_features,
        num_classes=sizes.num_classes,
        batch_size=_rows(config, shard),
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


@register("cnn")
def cnn_task(config: ml_collections.ConfigDict, shard: tuple[int, int]) -> Task:
    """A small CNN telling the orientation of a bar in synthetic images (``config.cnn``)."""
    sizes = config.cnn
    splits = datasets.image_splits(
        image_size=sizes.image_size,
        num_classes=sizes.num_classes,
        batch_size=_rows(config, shard),
        seed=config.seed,
        shard=shard,
    )
    return Task(
        lambda rngs: models.CNN(1, sizes.channels, sizes.num_classes, rngs=rngs),
        models.mlp.loss_fn,
        splits,
    )
