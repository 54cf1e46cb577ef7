"""What a config builds: the task (the model, its loss and data), from the registry of
tasks; the strategy, dtype and optimizer come from ``run_config`` (re-exported here)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import ml_collections
from clu import metrics as clu_metrics

from nnx_spmd_trainer import moe as moe_lib
from nnx_spmd_trainer import remat as remat_lib
from nnx_spmd_trainer.app import datasets, models
from nnx_spmd_trainer.app.models import gpt2_hf
from nnx_spmd_trainer.app.run_config import OPTIONAL as OPTIONAL  # re-exported: tasks.X
from nnx_spmd_trainer.app.run_config import STAGE_NAMES as STAGE_NAMES
from nnx_spmd_trainer.app.run_config import ConfigError as ConfigError
from nnx_spmd_trainer.app.run_config import check_config as check_config
from nnx_spmd_trainer.app.run_config import compute_dtype as compute_dtype
from nnx_spmd_trainer.app.run_config import fit_to_devices as fit_to_devices
from nnx_spmd_trainer.app.run_config import make_optimizer as make_optimizer
from nnx_spmd_trainer.app.run_config import parse_strategy as parse_strategy
from nnx_spmd_trainer.app.run_config import schedule as schedule
from nnx_spmd_trainer.app.run_config import spanning_hosts as spanning_hosts
from nnx_spmd_trainer.weights import WeightMap

#: Metrics computed inside the compiled step; every example loss returns ``accuracy`` in aux.
Metrics = clu_metrics.Collection.create(
    loss=clu_metrics.Average.from_output("loss"),
    accuracy=clu_metrics.Average.from_output("accuracy"),
)


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


#: ``config.gpt.chunked_loss=-1`` (the default) chunks the loss, ``AUTO_CHUNK`` positions a
#: chunk, from this vocabulary x positions on: a row's float32 logits of 16 MiB, which
#: with their gradient and the softmax's temporaries make the plain step's largest
#: buffers (benchmarks/results/posttrain_memory.md measures both losses).
CHUNKED_FROM = 2**22
AUTO_CHUNK = 128


@register("gpt")
def gpt_task(config: ml_collections.ConfigDict, shard: tuple[int, int]) -> Task:
    """A GPT learning text (``config.gpt``): BPE tokens of the pydoc topics or of corpora,
    packed, or characters (``config.data``: ``datasets.from_config.text_splits``)."""
    sizes = config.gpt
    options = _text_options(config, shard, sizes.seq_len)
    text_vocab, splits = datasets.from_config.text_splits(config, options, sizes.seq_len)
    kwargs = {k: sizes[k] for k in ("seq_len", "embed_dim", "num_heads", "ff_dim", "num_layers")}
    vocab_size = sizes.get("vocab_size") or -(-text_vocab // 8) * 8  # larger: unused rows
    if vocab_size < text_vocab:
        raise ConfigError(
            f"config.gpt.vocab_size={vocab_size} is smaller than the text's {text_vocab} "
            "token ids; use 0 (the text's, padded to a multiple of 8) or more."
        )
    dtype = compute_dtype(config)
    scan_layers, remat = gpt_layers(config)
    chunk_size = sizes.get("chunked_loss", 0)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < -1:
        raise ConfigError(
            f"config.gpt.chunked_loss={chunk_size!r}: must be an integer >= -1 (sequence "
            "positions per chunk of the loss; 0: the plain loss over the full logits; -1: "
            f"chunks of {AUTO_CHUNK} where vocabulary x positions >= {CHUNKED_FROM:,}); "
            "pass e.g. --config.gpt.chunked_loss=128."
        )
    if chunk_size == -1:  # auto: chunked where a row's logits outweigh the model's work
        chunk_size = AUTO_CHUNK if vocab_size * sizes.seq_len >= CHUNKED_FROM else 0
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

    ``moe_capacity_factor`` 0 is dropless (``MoE(capacity_factor=None)``).

    >>> gpt_moe(ml_collections.ConfigDict({"gpt": {"moe_experts": 4, "moe_top_k": 2}}))
    {'moe_experts': 4, 'moe_top_k': 2, 'moe_every': 1, 'moe_capacity_factor': 1.25}
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
    capacity = sizes.get("moe_capacity_factor", 1.25)
    if isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or not capacity >= 0:
        raise ConfigError(
            f"config.gpt.moe_capacity_factor={capacity!r}: must be a number >= 0 (each "
            "expert takes that many times its even share of tokens, the rest dropped; 0: "
            "dropless, every token routed), e.g. --config.gpt.moe_capacity_factor=1.25."
        )
    return {
        "moe_experts": experts, "moe_top_k": top_k, "moe_every": every,
        "moe_capacity_factor": float(capacity) or None,
    }  # fmt: skip


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
