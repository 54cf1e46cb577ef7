"""PipelineParallel: the scanned GPT's layers split over stages, the batch streamed through
them (stack.gpipe), trained through Trainer.fit exactly as one device with plain optax;
the stack's bytes per device fall as 1/S; the step moves activations, not weights; the
errors name their fix.

The reference is test_scan_layers's: the unrolled GPT trained with plain optax on one
device, its initial state given to the scanned model (``gpt.stack_blocks``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_scan_layers import (
    assert_trees_close,
    built,
    holding,
    scanned,
    token_batches,
    unrolled,
)
from test_seeds import TransformerBlock as SeedBlock
from test_seeds import regression_batches, regression_loss
from test_sequence_parallel import simulated
from toy_models import RecordLosses, train_reference

from nnx_spmd_trainer import (
    FSDP,
    DataParallel,
    Hybrid,
    PipelineParallel,
    Plan,
    TensorParallel,
    Trainer,
    path_str,
    stack,
)
from nnx_spmd_trainer.app.models import gpt
from nnx_spmd_trainer.planner import plan_report

LAYERS, STEPS = 8, 2
TX = optax.sgd(0.5)  # SGD: Adam would amplify the key bias's float-noise gradient (PITFALLS)


def batches():
    """16 rows a step: 8 microbatches still split over a data axis of 2."""
    pairs = zip(token_batches(STEPS, seed=0), token_batches(STEPS, seed=1), strict=True)
    return [{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in pairs]


@functools.cache
def initial_state(num_layers):
    """The unrolled GPT's initial state (what the reference starts from), blocks stacked."""
    state = nnx.to_pure_dict(nnx.state(built(unrolled, num_layers=num_layers)))
    return gpt.stack_blocks(state)


@pytest.fixture(scope="module", autouse=True)
def _built_once():
    """Builds ``initial_state`` outside any trace: trainers first ask for it in theirs."""
    initial_state(LAYERS)


def pipelined_gpt(rngs, num_layers=LAYERS, **options):
    """The scanned GPT holding the unrolled GPT's initial state (built once, not per trainer)."""
    del rngs
    model = scanned(nnx.Rngs(1), num_layers=num_layers, **options)
    return holding(model, initial_state(num_layers), stack=False)


@pytest.fixture(scope="module")
def reference():
    factory = lambda rngs: unrolled(rngs, num_layers=LAYERS)  # noqa: E731
    params, losses = train_reference(factory, TX, batches(), loss_fn=gpt.loss_fn)
    return gpt.stack_blocks(nnx.to_pure_dict(params)), losses


def twice_the_stages(strategy, devices, name):
    """Microbatches = 2 x stages: one more compile each, so in the slow lane."""
    return pytest.param(strategy, devices, id=name, marks=pytest.mark.slow)


@pytest.mark.parametrize(
    ("strategy", "devices"),
    [
        pytest.param(PipelineParallel(4), 4, id="pp4-m4"),
        twice_the_stages(PipelineParallel(4, microbatches=8), 4, "pp4-m8"),
        pytest.param(PipelineParallel(8), 8, id="pp8-m8"),
        twice_the_stages(PipelineParallel(8, microbatches=16), 8, "pp8-m16"),
        pytest.param(Hybrid(DataParallel(2), PipelineParallel(4)), 8, id="dp2-pp4-m4"),
        twice_the_stages(
            Hybrid(DataParallel(2), PipelineParallel(4, microbatches=8)), 8, "dp2-pp4-m8"
        ),
        pytest.param(
            Hybrid(FSDP(2, min_size=16), PipelineParallel(2), TensorParallel(2)), 8,
            id="fsdp2-pp2-tp2-m2",
        ),
        twice_the_stages(
            Hybrid(FSDP(2, min_size=16), PipelineParallel(2, microbatches=4), TensorParallel(2)),
            8, "fsdp2-pp2-tp2-m4",
        ),
    ],
)  # fmt: skip
def test_pipelined_gpt_trains_as_one_device(strategy, devices, reference):
    recorder = RecordLosses()
    trainer = Trainer(
        pipelined_gpt,
        TX,
        strategy=strategy,
        loss_fn=gpt.loss_fn,
        callbacks=[recorder],
        devices=jax.devices()[:devices],
    )
    kernel = trainer.state["model"]["blocks"]["linear1"]["kernel"].get_value()
    assert kernel.sharding.spec[0] == "stage"  # the layers split over the stages
    trainer.fit(batches(), max_steps=STEPS)
    want_params, want_losses = reference
    np.testing.assert_allclose(recorder.losses, want_losses, rtol=1e-5, atol=1e-5)
    got = jax.device_get(nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))
    assert_trees_close(got, want_params, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_grad_accumulation_remat_and_the_chunked_loss_compose(reference):
    """Two accumulated microbatches of 8 rows, each cut into 4 pipeline microbatches, every
    block checkpointed, the loss's logits never whole: still one device's training."""
    recorder = RecordLosses()
    trainer = Trainer(
        lambda rngs: pipelined_gpt(rngs, remat="dots_with_no_batch_dims_saveable"),
        TX,
        strategy=Hybrid(DataParallel(2), PipelineParallel(4)),
        loss_fn=functools.partial(gpt.chunked_loss_fn, chunk_size=4),
        grad_accum_steps=2,
        callbacks=[recorder],
    )
    trainer.fit(batches(), max_steps=STEPS)
    want_params, want_losses = reference
    np.testing.assert_allclose(recorder.losses, want_losses, rtol=1e-5, atol=1e-5)
    got = jax.device_get(nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))
    assert_trees_close(got, want_params, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("strategy", "processes", "shards"),
    [
        # Stages over both processes: both feed the same (all) rows.
        (PipelineParallel(8), 2, [(0, 1), (0, 1)]),
        # Rows over processes, stages within each: each feeds its rows.
        (Hybrid(DataParallel(2), PipelineParallel(4)), 2, [(0, 2), (1, 2)]),
        # Processes along the stage axis share rows.
        (Hybrid(DataParallel(2), PipelineParallel(4)), 4, [(0, 2), (0, 2), (1, 2), (1, 2)]),
    ],
)
def test_processes_holding_stages_of_the_same_rows_feed_the_same_rows(strategy, processes, shards):
    assert simulated(strategy, processes) == shards


# -- a user's own stack, the documented way --------------------------------------------
class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.linear(x))


class Deep(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.blocks = stack.stacked(Block, 4, rngs)
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(stack.run(self.blocks, x))


def test_a_users_stacked_model_pipelines_as_one_device():
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    data = [{"x": normal(8, 8), "y": normal(8, 4)} for _ in range(STEPS)]
    want_params, want_losses = train_reference(Deep, TX, data, loss_fn=regression_loss)
    recorder = RecordLosses()
    trainer = Trainer(
        Deep,
        TX,
        strategy=Hybrid(DataParallel(2), PipelineParallel(4, microbatches=4)),
        loss_fn=regression_loss,
        callbacks=[recorder],
    )
    trainer.fit(data, max_steps=STEPS)
    np.testing.assert_allclose(recorder.losses, want_losses, rtol=1e-5, atol=1e-6)
    got = jax.device_get(nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))
    assert_trees_close(got, nnx.to_pure_dict(want_params), rtol=1e-4, atol=1e-5)


class SeedLayers(nnx.Module):
    """The JAX scaling slides' GPT-2 ``TransformerBlock`` (``test_seeds``, as written), 4 of
    them: unrolled for the one-device reference, a stack (``stack.stacked``) to pipeline."""

    def __init__(self, rngs: nnx.Rngs, *, stacked: bool = False) -> None:
        def block(rngs: nnx.Rngs) -> SeedBlock:
            return SeedBlock(16, 2, 32, 0.0, rngs)  # the slides' signature; no dropout

        self.blocks = (
            stack.stacked(block, 4, rngs) if stacked else nnx.List([block(rngs) for _ in range(4)])
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        if isinstance(self.blocks, SeedBlock):
            return stack.run(self.blocks, x)
        for block in self.blocks:
            x = block(x)
        return x


def seed_stack(rngs):
    """The stacked seed blocks holding the unrolled ones' initial state."""
    source = gpt.stack_blocks(nnx.to_pure_dict(nnx.state(SeedLayers(rngs))))
    return holding(SeedLayers(nnx.Rngs(1), stacked=True), source, stack=False)


@pytest.mark.slow
def test_a_seed_document_model_made_scanned_pipelines_as_one_device():
    data = regression_batches(STEPS, (8, 8, 16))
    want_params, want_losses = train_reference(SeedLayers, TX, data, loss_fn=regression_loss)
    recorder = RecordLosses()
    trainer = Trainer(
        seed_stack,
        TX,
        strategy=Hybrid(DataParallel(2), PipelineParallel(4)),
        loss_fn=regression_loss,
        callbacks=[recorder],
    )
    trainer.fit(data, max_steps=STEPS)
    np.testing.assert_allclose(recorder.losses, want_losses, rtol=1e-5, atol=1e-5)
    got = jax.device_get(nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))
    want = gpt.stack_blocks(nnx.to_pure_dict(want_params))
    assert_trees_close(got, want, rtol=1e-4, atol=1e-4)


# -- memory and communication --------------------------------------------------------------
def test_stack_bytes_per_device_fall_as_one_over_stages():
    """The plan's per-device bytes of the stacked leaves (parameters and Adam's moments)
    are 1/S of the whole; on 8 stages they are what each device of the built state holds."""

    def planned(stages):
        plan = Plan(
            pipelined_gpt,
            optax.adam(1e-3),
            strategy=PipelineParallel(stages),
            loss_fn=gpt.loss_fn,
            devices=jax.devices()[:stages],
        )
        rows = plan_report.leaf_rows(plan.state_targets())
        stacked = {r["path"]: r["bytes_per_device"] for r in rows if "/blocks/" in r["path"]}
        return plan, {path: n for path, n in stacked.items() if "rngs" not in path}

    whole = sum(planned(1)[1].values())
    for stages in (2, 4):
        assert sum(planned(stages)[1].values()) * stages == whole
    plan, per_device = planned(8)
    assert sum(per_device.values()) * 8 == whole
    flat = jax.tree_util.tree_flatten_with_path(plan.materialize())[0]
    held = {path_str(p): {s.data.nbytes for s in x.addressable_shards} for p, x in flat}
    assert {path: held[path] for path in per_device} == {p: {n} for p, n in per_device.items()}


def test_the_step_permutes_activations_gathers_no_stacked_weight_and_is_reported():
    plan = Plan(
        pipelined_gpt,
        TX,
        strategy=Hybrid(DataParallel(2), PipelineParallel(4)),
        loss_fn=gpt.loss_fn,
    )
    report = plan.report(batches()[0])
    found = report.collectives
    assert found["collective-permute"]["count"] > 0
    # No all-gather at all: the stacked weights stay on their stage, and the activations
    # move by collective-permute (the last stage's output reaches the head by all-reduce).
    assert found["all-gather"]["count"] == 0, found
    stacked = sum(
        row["bytes_per_device"]
        for row in report.leaves
        if "/blocks/" in row["path"] and "rngs" not in row["path"]
    )
    assert (
        "pipeline: 4 stages x 2 of 8 layers, 4 microbatches, bubble (S-1)/(M+S-1) = 42.9%; "
        f"stacked state {stacked} bytes per device"
    ) in str(report)


# -- errors that name their fix ------------------------------------------------------------
def test_fewer_microbatches_than_stages_is_refused():
    with pytest.raises(ValueError, match=r"2 microbatches for 4 stages.*microbatches >= 4"):
        PipelineParallel(4, microbatches=2)
    with pytest.raises(ValueError, match=r"microbatches >= 8"):
        PipelineParallel(microbatches=2).microbatches_for(8)  # stages=-1: known on the mesh


def test_layers_not_divisible_by_stages_is_refused():
    with pytest.raises(ValueError, match=r"6 layers.*4 stages.*stages dividing 6"):
        Plan(
            lambda rngs: scanned(rngs, num_layers=6),
            TX,
            strategy=PipelineParallel(4),
            loss_fn=gpt.loss_fn,
            devices=jax.devices()[:4],
        )


def test_a_batch_not_divisible_into_microbatches_is_refused():
    mesh = jax.make_mesh((2,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
    with nnx.use_eager_sharding(False):
        model = Deep(nnx.Rngs(0))
    with (
        stack.pipelined(stack.GPipeSchedule(2, 4, "stage", mesh)),
        pytest.raises(
            ValueError, match=r"6 rows does not split into 4 microbatches.*divisible by 4"
        ),
    ):
        jax.eval_shape(model, jnp.zeros((6, 8)))


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda rngs: unrolled(rngs, num_layers=2), r"ran no stacked blocks.*stack\.run"),
        (lambda rngs: scanned(rngs, dropout_rate=0.1), r"write state.*dropout1 \(Dropout\)"),
    ],
    ids=["no-stack", "dropout"],
)
def test_a_model_that_cannot_be_pipelined_is_refused_when_traced(factory, message):
    plan = Plan(
        factory,
        TX,
        strategy=PipelineParallel(2),
        loss_fn=gpt.loss_fn,
        devices=jax.devices()[:2],
    )
    with pytest.raises(ValueError, match=message):
        plan.lower(token_batches(1)[0])


def test_the_stage_axis_splits_only_the_stack():
    plan = Plan(
        pipelined_gpt, TX, strategy=Hybrid(FSDP(4, min_size=16), PipelineParallel(2)),
        loss_fn=gpt.loss_fn,
    )  # fmt: skip
    specs = {
        path_str(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(plan.shardings)[0]
    }
    assert specs["model/blocks/linear1/kernel"] == P("stage", None, "fsdp")
    assert specs["model/blocks/layer_norm1/scale"] == P("stage", "fsdp")  # refined per layer
    assert "stage" not in str(specs["model/head/kernel"])
    assert "stage" not in str(specs["model/token_embed/embedding"])
