"""ExpertParallel and the MoE block: a MoE GPT trained under expert layouts computes the
one-device result (losses, parameters, the load-balance loss and dropped tokens), the
experts are split 1/E per device, and the step moves tokens with all-to-alls.

The reference is the same model trained with plain optax on one device
(``toy_models.train_reference``); SGD, as in test_scan_layers: Adam would amplify the
float noise of the attention key bias's zero gradient (PITFALLS).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from clu import metrics as clu_metrics
from flax import nnx
from jax.sharding import PartitionSpec as P
from mp_runs import MOE_LOGGED
from test_scan_layers import SEQ, TINY, token_batches
from test_sequence_parallel_checkpoints import host
from test_sequence_parallel_cli import TINY_GPT, cli
from toy_models import RecordLosses, assert_params_match, train_reference

from nnx_spmd_trainer import (
    FSDP,
    Callback,
    DataParallel,
    ExpertParallel,
    Hybrid,
    Plan,
    TensorParallel,
    Trainer,
    auto,
)
from nnx_spmd_trainer.app import tasks
from nnx_spmd_trainer.app.models import GPT, gpt
from nnx_spmd_trainer.callbacks import LambdaCallback, OrbaxCheckpoint
from nnx_spmd_trainer.configs import default
from nnx_spmd_trainer.nn.moe import MoE, moe_losses, moe_metrics
from nnx_spmd_trainer.planner.plan_report import collectives, leaf_rows
from nnx_spmd_trainer.strategies.expert import expert_candidates, num_experts

EXPERTS, STEPS = 4, 3
Metrics = clu_metrics.Collection.create(
    loss=clu_metrics.Average.from_output("loss"), **moe_metrics(EXPERTS)
)
COMPARED = MOE_LOGGED  # the MoE metrics compared with one device


def moe_gpt(rngs):
    """Two blocks, the second a MoE block of 4 experts, top-2 (capacity 5 of 8 tokens)."""
    return GPT(**TINY, num_layers=2, dropout_rate=0.0, rngs=rngs, moe_experts=EXPERTS, moe_every=2)


class RecordMoE(Callback):
    """Every step's MoE metrics (logged every step)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, step: int, logs: dict) -> None:
        self.steps.append({k: float(logs[f"train/{k}"]) for k in COMPARED})


def recording(seen):
    """``gpt.loss_fn`` that records each call's MoE metrics on the host."""

    def loss_fn(model, batch):
        loss, aux = gpt.loss_fn(model, batch)
        jax.debug.callback(lambda **m: seen.append({k: float(v) for k, v in m.items()}),
                           **{k: aux[k] for k in COMPARED})  # fmt: skip
        return loss, aux

    return loss_fn


@pytest.fixture(scope="module")
def reference():
    """Plain optax on one device: losses, final parameters and each step's MoE metrics."""
    seen: list[dict[str, float]] = []
    params, losses = train_reference(
        moe_gpt, optax.sgd(0.5), token_batches(STEPS), loss_fn=recording(seen)
    )
    return params, losses, seen


def trainer_for(strategy, callbacks, devices=None):
    return Trainer(
        moe_gpt,
        optax.sgd(0.5),
        strategy=strategy,
        loss_fn=gpt.loss_fn,
        metrics=Metrics,
        callbacks=callbacks,
        log_every_n_steps=1,
        track_norms=False,
        devices=devices,
    )


def fit(strategy, devices=None):
    recorder, moe = RecordLosses(), RecordMoE()
    trainer = trainer_for(strategy, [recorder, moe], devices)
    trainer.fit(token_batches(STEPS), max_steps=STEPS)
    return trainer, recorder.losses, moe.steps


def assert_matches(reference, trainer, losses, moe_steps):
    ref_params, ref_losses, ref_steps = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_params_match(trainer, ref_params)
    assert sum(s["moe_dropped_tokens"] for s in ref_steps) > 0  # capacity did drop tokens
    for got, want in zip(moe_steps, ref_steps, strict=True):
        assert got["moe_dropped_tokens"] == want["moe_dropped_tokens"]
        assert got["moe_dropped_fraction"] == pytest.approx(want["moe_dropped_fraction"])
        assert got["moe_load_balance"] == pytest.approx(want["moe_load_balance"], rel=1e-5)


def expert_block(trainer):
    return trainer.model.blocks[1].moe


def experts_weight(trainer):
    return trainer.model.blocks[1].moe.wi.get_value()


# -- the same maths under every expert layout -------------------------------------------------
@pytest.mark.slow
def test_expert_parallel_4_equals_one_device_and_splits_the_experts(reference):
    strategy, four = ExpertParallel(4), jax.devices()[:4]
    trainer, losses, moe_steps = fit(strategy, devices=four)
    assert_matches(reference, trainer, losses, moe_steps)
    # The plan of the same layout (its step compiled again: the compilation cache's).
    plan = Plan(moe_gpt, optax.sgd(0.5), strategy=strategy, loss_fn=gpt.loss_fn,
                metrics=Metrics, devices=four)  # fmt: skip
    batch = token_batches(1)[0]
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    text = plan.lower(shapes).compile().as_text()

    # Per-device expert bytes: 1/4 of the experts, planned = held.
    wi = experts_weight(trainer)
    assert wi.sharding.spec == P("expert")
    held = wi.addressable_shards[0].data.nbytes
    assert held * EXPERTS == wi.nbytes
    planned = {row["path"]: row["bytes_per_device"] for row in leaf_rows(plan.state_targets())}
    assert planned["model/blocks/1/moe/wi"] == held
    # The step sends tokens to their experts' devices and back: all-to-alls (what
    # Plan.report counts), each moving (rows/4, experts/4, capacity, embed) blocks of the
    # dispatched tokens: there and back in the forward pass, and in the backward pass.
    assert collectives(text)["all-to-all"]["count"] == 4
    tokens = f"f32[{8 // 4},{EXPERTS // 4},{expert_block(trainer).capacity(SEQ)},16]"
    moved = [line for line in text.splitlines() if " all-to-all(" in line]
    assert len(moved) == 4 and all(tokens in line for line in moved), moved


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [
        Hybrid(ExpertParallel(2), FSDP(2, min_size=16), TensorParallel(2)),
    ],
    ids=["ep2-fsdp2-tp2"],  # Hybrid(DataParallel(2), ExpertParallel(4)): the checkpoint test
)
def test_hybrid_expert_layouts_equal_one_device(strategy, reference):
    trainer, losses, moe_steps = fit(strategy)
    assert_matches(reference, trainer, losses, moe_steps)
    axis_size = dict(trainer.mesh.shape)["expert"]
    wi = experts_weight(trainer)
    assert wi.sharding.spec[0] == "expert"
    assert wi.addressable_shards[0].data.shape[0] == EXPERTS // axis_size


# -- the block itself ----------------------------------------------------------------------------
def test_moe_without_drops_is_the_weighted_sum_of_its_top_k_experts():
    with nnx.use_eager_sharding(False):
        block = MoE(8, 16, num_experts=4, top_k=2, capacity_factor=4.0, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, SEQ, 8))

    @nnx.jit  # eager, op by op, is slow on a busy CPU
    def outputs(block, x):
        y = block(x)
        _, metrics = moe_losses(block)
        probs = jax.nn.softmax(x @ block.router[...], axis=-1)
        weights, ids = jax.lax.top_k(probs, 2)
        weights = weights / weights.sum(-1, keepdims=True)
        hidden = nnx.gelu(jnp.einsum("bsd,edf->bsef", x, block.wi[...]))
        each = jnp.einsum("bsef,efd->bsed", hidden, block.wo[...])
        picked = jnp.take_along_axis(each, ids[..., None], 2)
        return y, metrics["moe_dropped_tokens"], jnp.einsum("bsk,bskd->bsd", weights, picked)

    y, dropped, want = outputs(block, x)
    assert float(dropped) == 0
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


# -- checkpoints -------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_run_saved_under_expert_parallel_resumes_under_fsdp_exactly(tmp_path, reference):
    """Saved at step 2 under Hybrid(DataParallel(2), ExpertParallel(4)) (which computes the
    one-device run: checked here), resumed under FSDP(8), where no axis splits the experts:
    the restored state is the saved one bit for bit, the resumed step the uninterrupted
    run's; FSDP(8)'s last checkpoint comes back into the expert layout bit for bit."""
    batches, save_at = token_batches(STEPS), STEPS - 1
    whole, moe = RecordLosses(), RecordMoE()
    saving = OrbaxCheckpoint(tmp_path, save_every_n_steps=save_at)
    writer = trainer_for(Hybrid(DataParallel(2), ExpertParallel(4)), [saving, whole, moe])
    writer.fit(batches[:save_at], max_steps=save_at)
    saved = jax.device_get(writer.state)
    writer.fit(batches[save_at:], max_steps=STEPS)  # the run that never stopped
    assert_matches(reference, writer, whole.losses, moe.steps)
    assert experts_weight(writer).sharding.spec == P("expert")

    restored: list = []
    after = RecordLosses()
    checkpoint = OrbaxCheckpoint(tmp_path / "moved", restore=tmp_path / str(save_at))
    moved = trainer_for(
        FSDP(8, min_size=16),
        [
            checkpoint,
            LambdaCallback(
                on_train_begin=lambda logs: restored.append(jax.device_get(moved.state))
            ),
            after,
        ],
    )
    with pytest.warns(UserWarning, match=f"first {save_at} batches are read and discarded"):
        moved.fit(batches, max_steps=STEPS)
    assert checkpoint.restored_step == save_at
    assert "expert" not in jax.tree.leaves(experts_weight(moved).sharding.spec)
    (state,) = restored
    for (path, want), got in zip(
        jax.tree_util.tree_flatten_with_path(saved)[0], jax.tree.leaves(state), strict=True
    ):
        np.testing.assert_array_equal(host(got), host(want), err_msg=jax.tree_util.keystr(path))
    np.testing.assert_allclose(after.losses, whole.losses[save_at:], rtol=1e-6, atol=1e-6)
    assert_params_match(moved, nnx.state(writer.model, nnx.Param), rtol=1e-5)

    # And back: FSDP(8)'s last checkpoint restored into the expert layout, bit for bit.
    back: list = []
    returned = trainer_for(
        Hybrid(DataParallel(2), ExpertParallel(4)),
        [
            OrbaxCheckpoint(tmp_path / "moved"),
            LambdaCallback(on_train_begin=lambda logs: back.append(jax.device_get(returned.state))),
        ],
    )
    returned.fit(batches, max_steps=STEPS)  # restored at STEPS: nothing left to train
    assert experts_weight(returned).sharding.spec == P("expert")
    (state,) = back
    final = jax.device_get(moved.state)
    for (path, want), got in zip(
        jax.tree_util.tree_flatten_with_path(final)[0], jax.tree.leaves(state), strict=True
    ):
        np.testing.assert_array_equal(host(got), host(want), err_msg=jax.tree_util.keystr(path))


# -- the CLI -------------------------------------------------------------------------------------
def test_the_strategy_string_and_the_gpt_config_name_the_expert_layout():
    assert tasks.parse_strategy("data=2,expert=4") == Hybrid(DataParallel(2), ExpertParallel(4))
    assert tasks.parse_strategy("ep=2,fsdp=2,tp=2") == Hybrid(
        ExpertParallel(2), FSDP(2), TensorParallel(2)
    )
    config = default.get_config()
    assert tasks.gpt_moe(config) == {}  # the shipped default: dense blocks
    config.gpt.update(moe_experts=4, moe_every=2)
    assert tasks.gpt_moe(config) == {
        "moe_experts": 4, "moe_top_k": 2, "moe_every": 2, "moe_capacity_factor": 1.25
    }  # fmt: skip
    config.gpt.moe_capacity_factor = 0.0  # dropless: every MoE block routes every token
    keywords = tasks.gpt_moe(config)
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(
            lambda: GPT(**TINY, num_layers=2, dropout_rate=0.0, rngs=nnx.Rngs(0), **keywords)
        )
    assert [b.moe.capacity_factor for b in model.blocks if hasattr(b, "moe")] == [None]
    config.gpt.moe_capacity_factor = -1.0
    with pytest.raises(tasks.ConfigError, match=r"moe_capacity_factor=-1.0: must be a number >= 0"):
        tasks.gpt_moe(config)
    config.gpt.moe_capacity_factor = 1.25
    config.gpt.moe_top_k = 5
    with pytest.raises(tasks.ConfigError, match=r"moe_top_k=5.*1 <= top_k <= experts"):
        tasks.gpt_moe(config)
    config.gpt.update(moe_top_k=2, scan_layers=True)
    with pytest.raises(tasks.ConfigError, match=r"scan_layers=False"):
        tasks.gpt_moe(config)


@pytest.mark.slow
def test_the_default_job_trains_a_moe_gpt_with_its_experts_split(tmp_path):
    proc = cli(
        "--config.strategy=data=2,expert=4", "--config.gpt.moe_experts=4",
        "--config.gpt.moe_every=2", "--config.gpt.num_layers=2", *TINY_GPT[:-1],
        "--config.gpt.moe_capacity_factor=0", "--workdir=out", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mesh {'data': 2, 'expert': 4} (Hybrid(DataParallel(2), ExpertParallel(4))" in (
        proc.stdout
    )
    assert "final after 2 steps: eval loss" in proc.stdout
    assert "moe_dropped_fraction" in proc.stdout, proc.stdout[-2000:]  # the MoE metrics logged
    # Dropless (capacity factor 0): no token of any step is dropped.
    assert re.findall(r"train/moe_dropped_tokens=(\S+)", proc.stdout) == ["0", "0"], proc.stdout


# -- auto ---------------------------------------------------------------------------------------
def test_auto_adds_the_expert_layouts_for_a_model_with_experts(monkeypatch):
    assert num_experts(moe_gpt) == EXPERTS
    assert num_experts(lambda rngs: GPT(**TINY, num_layers=1, dropout_rate=0.0, rngs=rngs)) == 0
    planned = []

    def plan_nothing(strategies, **kwargs):
        planned.append(list(strategies))
        return [], [], None

    monkeypatch.setattr(auto, "_plan_candidates", plan_nothing)
    with pytest.raises(auto.NoLayoutFits):
        auto.choose(moe_gpt, optax.sgd(0.5), token_batches(1), loss_fn=gpt.loss_fn)
    (strategies,) = planned
    assert strategies == auto.candidates(8) + expert_candidates(8, EXPERTS)
    assert Hybrid(DataParallel(2), ExpertParallel(4)) in strategies
