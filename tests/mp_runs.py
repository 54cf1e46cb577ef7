"""The runs test_multiprocess compares: each made by the test process itself (1 process,
8 devices) and by ``mp_worker.py`` (2 processes, 4 devices each) alike.

``train``: one strategy trained on the same global batches, each process feeding
its rows. ``train_grain``: a Grain run checkpointed in one process count and
resumed in another. ``train_a_slice_per_process``: the natural mistake under a
model axis that spans the processes, each process feeding its own slice.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from pathlib import Path

import grain
import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from toy_models import Net, RecordLosses, classification_loss, make_batches, train_reference

from nnx_spmd_trainer import (
    FSDP,
    Auto,
    Callback,
    DataParallel,
    ExpertParallel,
    Hybrid,
    PipelineParallel,
    SequenceParallel,
    Strategy,
    TensorParallel,
    Trainer,
    distributed,
)
from nnx_spmd_trainer.app.datasets.base import index_batches
from nnx_spmd_trainer.app.models import gpt
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint

STRATEGIES = {
    "dp": lambda: DataParallel(),
    "fsdp": lambda: FSDP(min_size=1),
    "fsdp_x_tp": lambda: Hybrid(FSDP(4, min_size=1), TensorParallel(2)),
    "tp8": lambda: TensorParallel(),  # the model axis spans both processes
}
STEPS = 4


def local_rows(batch: dict, index: int, count: int) -> dict:
    """This process's block of a global batch (``make_array_from_process_local_data`` order)."""
    rows = len(batch["x"]) // count
    return {k: v[index * rows : (index + 1) * rows] for k, v in batch.items()}


def train(name: str) -> dict[str, np.ndarray]:
    recorder = RecordLosses()
    trainer = Trainer(
        Net,
        optax.adam(1e-2),
        strategy=STRATEGIES[name](),
        loss_fn=classification_loss,
        callbacks=[recorder],
    )
    shard = trainer.placement.data_shard
    trainer.fit([local_rows(b, *shard) for b in make_batches(STEPS)], max_steps=STEPS)
    flat = gathered(nnx.state(trainer.model, nnx.Param), f"{name}/params/")
    return {**flat, f"{name}/losses": np.asarray(recorder.losses), f"{name}/shard": np.array(shard)}


def train_a_slice_per_process(report: Path) -> None:
    """``tp8``, each process feeding "its" half of every global batch, though ``data_shard``
    says both feed the whole batch; writes what happened to ``report`` + the process index
    (the error, and the steps that ran), then raises the error again."""
    trainer = Trainer(
        Net, optax.adam(1e-2), strategy=STRATEGIES["tp8"](), loss_fn=classification_loss
    )
    assert tuple(trainer.placement.data_shard) == (0, 1)  # the whole batch, on both
    mine = [local_rows(b, jax.process_index(), 2) for b in make_batches(STEPS)]
    try:
        trainer.fit(mine, max_steps=STEPS)
    except Exception as error:
        text = f"{type(error).__name__}: {error}\nsteps run: {trainer.step}\n"
        Path(f"{report}.{jax.process_index()}").write_text(text)
        multihost_utils.sync_global_devices("reported")  # both wrote before either exits
        raise


def gathered(tree: object, prefix: str) -> dict[str, np.ndarray]:
    """``{prefix + leaf path: the whole array}``, gathered from every process."""
    tree = multihost_utils.process_allgather(tree, tiled=True)
    return {
        prefix + "/".join(map(str, path)): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


GLOBAL_BATCH, EXAMPLES = 16, 96
rng = np.random.default_rng(7)
X = rng.normal(size=(EXAMPLES, 16)).astype(np.float32)
Y = rng.integers(0, 8, EXAMPLES).astype(np.int32)


class RecordBatches(Callback):
    """Each step's loss and its global batch's rows (sorted: the order inside a global batch
    depends on how many processes feed it; the rows do not)."""

    needs_batch = True  # handed each step's placed batch (step_batch)

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.rows: list[np.ndarray] = []

    def on_train_batch_end(self, step: int, logs: dict) -> None:
        x = multihost_utils.process_allgather(self.step_batch["x"], tiled=True)
        self.rows.append(np.sort(np.asarray(x), axis=0))
        self.losses.append(self.step_record.loss_value())


def rows_counted_pipeline(index: int, count: int) -> grain.IterDataset:
    """``index_batches``' rows, batched after ``to_iter_dataset``: its position counts rows."""
    rows = grain.MapDataset.range(EXAMPLES).shuffle(seed=0).repeat()[index::count]
    gathered = rows.to_iter_dataset().batch(GLOBAL_BATCH // count)
    return gathered.map(lambda i: {"x": X[i], "y": Y[i]})


#: ``strategy="auto"`` between two layouts, timed briefly: what a resumed run must keep.
AUTO = Auto(
    candidates=[DataParallel(), Hybrid(FSDP(4, min_size=1), TensorParallel(2))], steps=1, rounds=1
)


def train_grain(
    checkpoints: Path,
    max_steps: int,
    *,
    rows_counted: bool = False,
    strategy: Strategy | Auto | None = None,
) -> dict[str, np.ndarray]:
    """Trains to ``max_steps`` on a per-process Grain pipeline, saving every 3 steps and
    resuming from ``checkpoints`` if it holds any; what happened, as host arrays.
    ``rows_counted``: a pipeline whose position counts rows, not batches.
    ``strategy``: default ``DataParallel()``; with ``AUTO`` the choice is returned too."""
    recorder = RecordBatches()
    checkpoint = OrbaxCheckpoint(checkpoints, save_every_n_steps=3)
    trainer = Trainer(
        Net,
        optax.adam(1e-2),
        strategy=strategy or DataParallel(),
        loss_fn=classification_loss,
        callbacks=[checkpoint, recorder],
    )
    # Auto's candidates split rows over the processes as DataParallel does (as the CLI).
    index, count = DataParallel().data_shard(DataParallel().make_mesh())
    pipeline = (
        rows_counted_pipeline(index, count)
        if rows_counted
        else index_batches(
            EXAMPLES,
            GLOBAL_BATCH // count,
            lambda i: {"x": X[i], "y": Y[i]},
            seed=0,
            repeat=True,
            shard=(index, count),
        )
    )
    trainer.fit(iter(pipeline), max_steps=max_steps)
    params = multihost_utils.process_allgather(nnx.state(trainer.model, nnx.Param), tiled=True)
    choice = trainer.layout_choice
    return {
        "strategy": np.array(repr(choice.strategy if choice else trainer.plan.strategy)),
        "resumed_layout": np.array(bool(choice and choice.resumed)),
        "restored_step": np.array(
            -1 if checkpoint.restored_step is None else checkpoint.restored_step
        ),
        "losses": np.asarray(recorder.losses),
        "rows": np.asarray(recorder.rows),
        **{
            "params/" + "/".join(map(str, path)): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        },
    }


# Issue 20's four layouts, and the sequence split inside each process.
SEQUENCE_STRATEGIES = {
    "seq8": lambda: SequenceParallel(8),  # the sequence over both processes
    "fsdp2_x_seq4": lambda: Hybrid(FSDP(2, min_size=1), SequenceParallel(4)),  # rows over processes
    "seq4_x_tp2": lambda: Hybrid(SequenceParallel(4), TensorParallel(2)),  # sequence over them
    "dp2_x_seq2_x_tp2": lambda: Hybrid(DataParallel(2), SequenceParallel(2), TensorParallel(2)),
    "dp_x_seq2": lambda: Hybrid(DataParallel(), SequenceParallel(2)),  # rows over processes
    # Ring attention (issue 31): keys and values passed round the ring, across the processes
    "seq8_ring": lambda: SequenceParallel(8, attention="ring"),
    "fsdp2_x_seq4_ring": lambda: Hybrid(FSDP(2, min_size=1), SequenceParallel(4, attention="ring")),
    "dp2_x_seq2_x_tp2_ring": lambda: Hybrid(
        DataParallel(2), SequenceParallel(2, attention="ring"), TensorParallel(2)
    ),
}
GPT_ROWS, GPT_SEQ, GPT_VOCAB = 8, 16, 16


def tiny_gpt(rngs: nnx.Rngs) -> nnx.Module:
    from nnx_spmd_trainer.app.models import GPT

    return GPT(
        vocab_size=GPT_VOCAB, seq_len=GPT_SEQ, embed_dim=16, num_heads=4, ff_dim=32,
        num_layers=1, dropout_rate=0.0, rngs=rngs,
    )  # fmt: skip


def token_batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(5)
    windows = [rng.integers(0, GPT_VOCAB, (GPT_ROWS, GPT_SEQ + 1), np.int32) for _ in range(n)]
    return [{"inputs": w[:, :-1], "targets": w[:, 1:]} for w in windows]


# Pipelines whose stages span the two processes (the stage axis first: process 0 holds
# stages 0-1, process 1 stages 2-3), each with a data axis inside the process.
PIPELINE_STRATEGIES = {
    "stage4_x_dp2": lambda: Hybrid(PipelineParallel(4), DataParallel(2)),
    "stage4m8_x_dp2": lambda: Hybrid(PipelineParallel(4, microbatches=8), DataParallel(2)),
}
PIPELINE_LAYERS = 4


def tiny_gpt_layers(rngs: nnx.Rngs, scan_layers: bool = False) -> nnx.Module:
    from nnx_spmd_trainer.app.models import GPT

    return GPT(
        vocab_size=GPT_VOCAB, seq_len=GPT_SEQ, embed_dim=16, num_heads=4, ff_dim=32,
        num_layers=PIPELINE_LAYERS, dropout_rate=0.0, rngs=rngs, scan_layers=scan_layers,
    )  # fmt: skip


def pipelined_tiny_gpt(rngs: nnx.Rngs) -> nnx.Module:
    """The scanned GPT holding ``tiny_gpt_layers``' initial state (one-device reference)."""
    from nnx_spmd_trainer.app.models import gpt

    source = gpt.stack_blocks(nnx.to_pure_dict(nnx.state(tiny_gpt_layers(rngs))))
    model = tiny_gpt_layers(nnx.Rngs(1), scan_layers=True)
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, source)
    nnx.update(model, state)
    return model


# Issue 32: the experts within each process (rows over the processes), and over both.
EXPERT_STRATEGIES = {
    "dp2_x_ep4": lambda: Hybrid(DataParallel(2), ExpertParallel(4)),
    # all-to-alls across them: said so, since the mesh keeps experts inside a host otherwise
    "ep4_x_dp2": lambda: Hybrid(ExpertParallel(4), DataParallel(2), across_hosts={"expert": 2}),
}


MOE_LOGGED = ("moe_load_balance", "moe_dropped_tokens", "moe_dropped_fraction")


def moe_gpt_metrics() -> type:
    """The loss and the MoE block's metrics (``moe.moe_metrics``) of ``tiny_moe_gpt``."""
    from clu import metrics as clu_metrics

    from nnx_spmd_trainer.nn.moe import moe_metrics

    return clu_metrics.Collection.create(
        loss=clu_metrics.Average.from_output("loss"), **moe_metrics(4)
    )


class RecordLogged(Callback):
    """Every step's logged ``train/NAME`` for ``names`` (log every step)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.values: dict[str, list[float]] = {name: [] for name in names}

    def on_train_batch_end(self, step: int, logs: dict) -> None:
        for name, seen in self.values.items():
            seen.append(float(logs[f"train/{name}"]))


def tiny_moe_gpt(rngs: nnx.Rngs) -> nnx.Module:
    from nnx_spmd_trainer.app.models import GPT

    return GPT(
        vocab_size=GPT_VOCAB, seq_len=GPT_SEQ, embed_dim=16, num_heads=4, ff_dim=32,
        num_layers=1, dropout_rate=0.0, rngs=rngs, moe_experts=4,
    )  # fmt: skip


def train_gpt_sequence(
    name: str, *, pipeline: bool = False, expert: bool = False
) -> dict[str, np.ndarray]:
    """The tiny GPT under ``SEQUENCE_STRATEGIES[name]`` (``pipeline``: the scanned one under
    ``PIPELINE_STRATEGIES[name]``) through ``Trainer.fit``, each process feeding the rows
    its ``data_shard`` names (whole sequences): losses and parameters."""
    from nnx_spmd_trainer.app.models import gpt

    recorder, moe_log = RecordLosses(), RecordLogged(MOE_LOGGED)
    strategies = PIPELINE_STRATEGIES if pipeline else SEQUENCE_STRATEGIES
    model = pipelined_tiny_gpt if pipeline else tiny_gpt
    settings: dict = {}
    if expert:  # the MoE GPT under EXPERT_STRATEGIES[name], its MoE metrics every step
        strategies, model = EXPERT_STRATEGIES, tiny_moe_gpt
        settings = {"metrics": moe_gpt_metrics(), "log_every_n_steps": 1, "track_norms": False}
    trainer = Trainer(
        model,
        optax.sgd(0.5),
        strategy=strategies[name](),
        loss_fn=gpt.loss_fn,
        callbacks=[recorder, moe_log] if expert else [recorder],
        **settings,
    )
    index, count = trainer.placement.data_shard
    rows = GPT_ROWS // count
    mine = [
        {k: v[index * rows : (index + 1) * rows] for k, v in batch.items()}
        for batch in token_batches(STEPS)
    ]
    trainer.fit(mine, max_steps=STEPS)
    flat = gathered(nnx.state(trainer.model, nnx.Param), f"{name}/params/")
    shard = np.array((index, count))
    logged = {f"{name}/{k}": np.asarray(v) for k, v in moe_log.values.items()}
    return {**flat, **logged, f"{name}/losses": np.asarray(recorder.losses), f"{name}/shard": shard}


# -- the two-process GPT runs and the one device they equal ---------------------------------
WORKER = Path(__file__).parent / "mp_worker.py"


def launched(out_dir: Path, *args: str) -> dict[str, np.ndarray]:
    """What ``mp_worker.py OUT *args`` wrote, run as 2 processes of 4 devices each."""
    out = out_dir / "results.npz"
    log = io.StringIO()
    status = distributed.Launch([sys.executable, str(WORKER), str(out), *args], 2, out=log).run()
    assert status == 0, log.getvalue()[-4000:]
    return dict(np.load(out))


def one_device_gpt(
    model: Callable[[nnx.Rngs], nnx.Module], loss_fn: Callable = gpt.loss_fn
) -> tuple[dict[str, np.ndarray], list[float]]:
    """``model`` trained on ``token_batches(STEPS)`` on one device with plain optax: its
    parameters named as ``gathered`` names the processes' ones, and its losses."""
    params, losses = train_reference(model, optax.sgd(0.5), token_batches(STEPS), loss_fn=loss_fn)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {"/".join(map(str, path)): np.asarray(leaf) for path, leaf in flat}, losses
