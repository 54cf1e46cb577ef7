"""The plan report's figures equal what the run then holds and compiles."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from toy_models import Net, classification_loss, make_batches

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, Plan, TensorParallel, Trainer
from nnx_spmd_trainer.app.models import GPT, gpt
from nnx_spmd_trainer.planner import target_report
from nnx_spmd_trainer.planner.plan_report import collectives

LAYOUTS = {
    "dp": lambda: DataParallel(),
    "fsdp": lambda: FSDP(min_size=64),
    "fsdp4_tp2": lambda: Hybrid(FSDP(4, min_size=64), TensorParallel(2)),
    "dp4_tp2": lambda: Hybrid(DataParallel(4), TensorParallel(2)),
}
VOCAB, SEQ = 16, 8


def tiny_gpt(rngs):
    return GPT(
        vocab_size=VOCAB, seq_len=SEQ, embed_dim=32, num_heads=8, ff_dim=64, num_layers=1,
        dropout_rate=0.0, rngs=rngs,
    )  # fmt: skip


def gpt_batch():
    window = np.random.default_rng(0).integers(0, VOCAB, size=(16, SEQ + 1), dtype=np.int32)
    return {"inputs": window[:, :-1], "targets": window[:, 1:]}


MODELS = {
    "mlp": (Net, classification_loss, lambda: make_batches(1)[0]),
    "gpt": (tiny_gpt, gpt.loss_fn, gpt_batch),
}


def shapes_of(batch):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)


def opcode(line: str) -> str:
    """The opcode of one HLO instruction line: ``%x = <result type> <opcode>(...)``."""
    _, equals, rhs = line.partition(" = ")
    if not equals:
        return ""
    depth = 0
    for at, char in enumerate(rhs):  # the result type ends at the first space outside ( )
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == " " and depth == 0:
            return rhs[at + 1 :].split("(", 1)[0]
    return ""


def counted_in_hlo(text: str, op: str) -> int:
    """The test's own count of ``op`` in HLO text (an async start counts once)."""
    return sum(opcode(line) in (op, f"{op}-start") for line in text.splitlines())


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_plan_equals_the_arrays_and_the_step_of_the_run(model, layout):
    factory, loss, make_batch = MODELS[model]
    batch = make_batch()
    plan = Plan(factory, optax.adam(1e-3), strategy=LAYOUTS[layout](), loss_fn=loss)
    report = plan.report(shapes_of(batch))
    assert json.loads(json.dumps(report.to_dict()))["mesh"] == dict(plan.mesh.shape)
    assert "plan:" in str(report) and "collectives:" in str(report)

    trainer = Trainer(plan)
    trainer.fit([batch], max_steps=1)
    # state bytes per device: the arrays the run created, per kind
    for kind, root in (("parameters", "model"), ("optimizer", "optimizer")):
        held = sum(
            x.addressable_shards[0].data.nbytes
            for x in jax.tree.leaves(trainer.state[root])
            if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
        )
        planned = sum(
            row["bytes_per_device"]
            for row in report.leaves
            if row["kind"] == kind and "key" not in row["dtype"]
        )
        assert planned == held, kind
    # memory: that of the step the trainer runs, lowered on its live arrays
    placed = trainer.placement.place(batch)
    ran, new = trainer._loop.cached_step("train", placed)
    assert not new  # the jitted step the trainer ran, from the plan's cache
    compiled = ran.lower(trainer.run.objects().arrays(), trainer.metric_log.train, placed).compile()
    analysis = compiled.memory_analysis()
    assert report.memory["arguments"] == analysis.argument_size_in_bytes
    assert report.memory["outputs"] == analysis.output_size_in_bytes
    assert report.memory["temporaries"] == analysis.temp_size_in_bytes
    # collectives: counted here from the HLO text of that step
    text = compiled.as_text()
    for op in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"):
        assert report.collectives[op]["count"] == counted_in_hlo(text, op), op
    if layout != "dp":
        assert (
            report.collectives["all-gather"]["count"] + report.collectives["all-reduce"]["count"]
            > 0
        )


def test_a_model_too_big_for_a_budget_fits_under_fsdp_and_the_report_says_what_to_try():
    batch = shapes_of(make_batches(1, din=256, classes=16)[0])

    def report(strategy, budget):
        plan = Plan(
            lambda rngs: Net(rngs, din=256, hidden=512, dout=16),
            optax.adam(1e-3),
            strategy=strategy,
            loss_fn=classification_loss,
        )
        return plan.report(batch, memory_budget_bytes=budget)

    dp_peak = report(DataParallel(), None).memory["peak"]
    budget = dp_peak // 2
    dp, fsdp = report(DataParallel(), budget), report(FSDP(min_size=64), budget)
    assert dp.fits is False and dp.verdict.startswith("does not fit")
    assert any("FSDP" in tip for tip in dp.suggestions)
    assert fsdp.fits is True and fsdp.verdict.startswith("fits")
    assert fsdp.memory["peak"] < budget < dp.memory["peak"]
    assert "does not fit" in str(dp) and "try: FSDP" in str(dp)


def scanned_layers_grad(layers: int, unroll: bool) -> str:
    """The compiled HLO of the gradient of ``layers`` stacked 64 x 64 weights applied by a
    ``lax.scan``, their rows split over 8 devices (FSDP's layout): each layer's weight is
    gathered whole for the forward pass and again for the backward one."""
    mesh = jax.make_mesh((8,), ("fsdp",))
    w = jax.device_put(jnp.ones((layers, 64, 64)), NamedSharding(mesh, P(None, "fsdp", None)))
    x = jax.device_put(jnp.ones((16, 64)), NamedSharding(mesh, P("fsdp", None)))

    def loss(w, x):
        h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w, unroll=unroll)
        return h.sum()

    return jax.jit(jax.grad(loss)).lower(w, x).compile().as_text()


def test_collectives_in_a_scanned_loop_count_once_per_layer():
    layer = 64 * 64 * 4  # one f32 weight, whole
    for layers in (3, 6):
        found = collectives(scanned_layers_grad(layers, unroll=False))
        # XLA's text holds the loop's body once; the program runs it once per layer.
        assert found["all-gather"] == {"count": 2 * layers, "bytes": 2 * layers * layer}
        assert found["all-reduce"]["bytes"] == layers * layer  # each layer's gradient
    # The same program unrolled by JAX (no loop at all) reduces the same gradient bytes
    # (XLA merges them into fewer all-reduces there).
    unrolled = collectives(scanned_layers_grad(6, unroll=True))
    assert unrolled["all-reduce"]["bytes"] == 6 * layer
    links = target_report.split_by_link(scanned_layers_grad(6, unroll=False))
    assert links["ici"]["count"] == sum(c["count"] for c in found.values())
    assert links["ici"]["bytes"] == sum(c["bytes"] for c in found.values())
