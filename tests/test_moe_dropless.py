"""Dropless MoE (``MoE(capacity_factor=None)``): every token reaches its top-k experts.

Checked against independent computations: the dense weighted sum of each token's top-k
experts (plain jnp), the capacity path where it drops nothing, and a model trained with
plain optax on one device; under ExpertParallel(4) and Hybrid(DataParallel(2),
ExpertParallel(4)) the losses, parameters after SGD steps and the gradients are one
device's. ``jax.lax.ragged_all_to_all`` (the GPU/TPU exchange) does not run on CPU
(PITFALLS): its documented semantics are emulated here to check the offsets the block
hands it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from clu import metrics as clu_metrics
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from toy_models import RecordLosses, assert_params_match, train_reference

from nnx_spmd_trainer import DataParallel, ExpertParallel, Hybrid, Trainer
from nnx_spmd_trainer.nn import moe_dropless, tracing
from nnx_spmd_trainer.nn.moe import MoE, moe_losses, moe_metrics

EMBED, FF, EXPERTS, TOP_K = 8, 16, 4, 2
ROWS, SEQ, FEATURES, STEPS = 8, 8, 4, 3
Metrics = clu_metrics.Collection.create(
    loss=clu_metrics.Average.from_output("loss"), **moe_metrics(EXPERTS)
)


class TinyMoE(nnx.Module):
    """A projection in, one MoE block on a residual, a projection out."""

    def __init__(self, rngs: nnx.Rngs, capacity_factor: float | None = None) -> None:
        self.inp = nnx.Linear(FEATURES, EMBED, rngs=rngs)
        self.moe = MoE(EMBED, FF, EXPERTS, top_k=TOP_K, capacity_factor=capacity_factor,
                       load_balance_weight=0.1, rngs=rngs)  # fmt: skip
        self.out = nnx.Linear(EMBED, FEATURES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.inp(x)
        return self.out(h + self.moe(h))


def loss_fn(model, batch):
    mse = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    extra, aux = moe_losses(model)
    return mse + extra, aux


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(ROWS, SEQ, FEATURES)).astype(np.float32),
         "y": rng.normal(size=(ROWS, SEQ, FEATURES)).astype(np.float32)}
        for _ in range(n)
    ]  # fmt: skip


def built(capacity_factor=None):
    with nnx.use_eager_sharding(False):
        return TinyMoE(nnx.Rngs(0), capacity_factor)


def dense_top_k(block, x):
    """Every token through every expert (plain jnp), its top-k outputs weighted."""
    probs = jax.nn.softmax(x @ block.router[...], axis=-1)
    weights, ids = jax.lax.top_k(probs, block.top_k)
    weights = weights / weights.sum(-1, keepdims=True)
    hidden = nnx.gelu(jnp.einsum("bsd,edf->bsef", x, block.wi[...]))
    each = jnp.einsum("bsef,efd->bsed", hidden, block.wo[...])
    picked = jnp.take_along_axis(each, ids[..., None], 2)
    return jnp.einsum("bsk,bskd->bsd", weights, picked)


def flat(tree):
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(p).removesuffix(".value"): np.asarray(v) for p, v in leaves}


# -- the block on one device ---------------------------------------------------------------------
def test_dropless_is_the_weighted_sum_of_every_tokens_top_k_experts():
    """At a capacity that drops tokens, the dropless block still computes every token."""
    with nnx.use_eager_sharding(False):
        block = MoE(EMBED, FF, EXPERTS, top_k=TOP_K, capacity_factor=None, rngs=nnx.Rngs(0))
        dropping = MoE(EMBED, FF, EXPERTS, top_k=TOP_K, capacity_factor=0.5, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, SEQ, EMBED))

    @nnx.jit
    def run(block, dropping, x):
        y, _ = block(x), dropping(x)
        return y, moe_losses(block)[1], moe_losses(dropping)[1], dense_top_k(block, x)

    y, metrics, dropping_metrics, want = run(block, dropping, x)
    assert float(dropping_metrics["moe_dropped_tokens"]) > 0  # a capacity would drop here
    assert float(metrics["moe_dropped_tokens"]) == 0
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_rows_fewer_than_the_batch_split_stay_the_compilers():
    """A pipeline's microbatch can hold fewer rows than the batch rule's axes split (one
    row, two data devices): the block leaves those rows to the compiler, as without the
    rule, and still computes every token."""
    with nnx.use_eager_sharding(False):
        block = MoE(EMBED, FF, EXPERTS, top_k=TOP_K, capacity_factor=None, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (1, SEQ, EMBED))
    mesh = mesh_of(DataParallel(2), 2)
    with jax.set_mesh(mesh), tracing.tracing_rules((("batch", "data"),)):
        y = nnx.jit(lambda block, x: block(x))(block, x)
    np.testing.assert_allclose(y, nnx.jit(dense_top_k)(block, x), rtol=1e-5, atol=1e-6)


def test_dropless_equals_the_capacity_path_where_nothing_drops_and_gradients_flow():
    dropless, capacity = built(None), built(float(EXPERTS))  # capacity = every token
    batch = batches(1)[0]

    @nnx.jit
    def value_and_grads(model, batch):
        (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        return loss, aux, nnx.state(grads, nnx.Param)

    loss_d, aux_d, grads_d = value_and_grads(dropless, batch)
    loss_c, aux_c, grads_c = value_and_grads(capacity, batch)
    assert float(aux_c["moe_dropped_tokens"]) == 0
    np.testing.assert_allclose(loss_d, loss_c, rtol=1e-5)
    for name in ("moe_load_balance", "moe_router_z", "moe_expert_load_0"):
        np.testing.assert_allclose(aux_d[name], aux_c[name], rtol=1e-6, err_msg=name)
    got, want = flat(grads_d), flat(grads_c)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for key in ("['moe']['router']", "['moe']['wi']", "['moe']['wo']", "['inp']['kernel']"):
        assert np.abs(got[key]).max() > 1e-4, key  # the gradient reaches every part


def test_bad_capacity_factors_name_the_fix():
    with pytest.raises(ValueError, match=r"capacity_factor=0 must be positive, or None"):
        MoE(EMBED, FF, EXPERTS, capacity_factor=0, rngs=nnx.Rngs(0))
    with nnx.use_eager_sharding(False):
        block = MoE(EMBED, FF, EXPERTS, capacity_factor=None, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="dropless block .* has no capacity"):
        block.capacity(SEQ)


# -- under expert layouts --------------------------------------------------------------------------
LAYOUTS = {
    "ep4": (ExpertParallel(4), 4),
    "dp2-ep4": (Hybrid(DataParallel(2), ExpertParallel(4)), 8),
}


@pytest.fixture(scope="module")
def reference():
    """Plain optax on one device: each step's loss, the final parameters, and the
    gradients at the start."""
    params, losses = train_reference(TinyMoE, optax.sgd(0.5), batches(STEPS), loss_fn=loss_fn)
    model = built()
    grads = nnx.jit(lambda m, b: nnx.grad(lambda m: loss_fn(m, b)[0])(m))(model, batches(1)[0])
    return params, losses, flat(nnx.state(grads, nnx.Param))


def mesh_of(strategy, devices):
    names = tuple(name for name, _ in strategy.mesh_axes())
    sizes = tuple(size for _, size in strategy.mesh_axes())
    return jax.make_mesh(sizes, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names),
                         devices=jax.devices()[:devices])  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dropless_under_expert_layouts_trains_as_one_device(layout, reference):
    strategy, devices = LAYOUTS[layout]
    ref_params, ref_losses, ref_grads = reference
    recorder = RecordLosses()
    trainer = Trainer(TinyMoE, optax.sgd(0.5), strategy=strategy, loss_fn=loss_fn, metrics=Metrics,
                      callbacks=[recorder], log_every_n_steps=1, track_norms=False,
                      devices=jax.devices()[:devices])  # fmt: skip
    trainer.fit(batches(STEPS), max_steps=STEPS)
    np.testing.assert_allclose(recorder.losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_params_match(trainer, ref_params, rtol=1e-5)
    assert trainer.model.moe.wi.get_value().sharding.spec[0] == "expert"
    # The trainer's own step routes each device's own rows: it traces the block with the
    # rows split over every batch axis (the data axis too), so a device's block holds the
    # choices of ROWS / devices rows, not of the rows of its whole expert group.
    hlo = trainer.plan.lower(batches(1)[0]).compile().as_text()
    own = f"f32[1,{ROWS // devices * SEQ * TOP_K},{EMBED}]"
    moved = [line for line in hlo.splitlines() if " all-to-all(" in line]
    assert sum(line.count(own) for line in moved) == 4 * 4, moved

    # The gradients themselves, at the initial parameters, under the layout's mesh and rules.
    mesh = mesh_of(strategy, devices)
    model, batch = built(), batches(1)[0]
    with jax.set_mesh(mesh), strategy.trace_context(mesh):
        rows = NamedSharding(mesh, P(strategy.batch_axes()))
        batch = jax.device_put(batch, rows)
        grad = nnx.jit(lambda m, b: nnx.grad(lambda m: loss_fn(m, b)[0])(m))
        hlo = grad.lower(model, batch).compile().as_text()
        grads = flat(nnx.state(grad(model, batch), nnx.Param))
    for key, want in ref_grads.items():
        np.testing.assert_allclose(grads[key], want, rtol=1e-5, atol=1e-6, err_msg=key)
    # On CPU the rows travel padded: to each of the 4 expert devices a block of every local
    # choice (A rows, embed), there and back, forward and backward (XLA splits each
    # all-to-all into its 4 blocks); the expert counts travel in one more, s32. A is the
    # choices of the rows one expert device holds: a data axis stays the compiler's, which
    # gathers its rows into the block (docs/topics/moe.md).
    block = f"f32[1,{ROWS // 4 * SEQ * TOP_K},{EMBED}]"
    moved = [line for line in hlo.splitlines() if " all-to-all(" in line]
    assert sum(line.count(block) for line in moved) == 4 * 4, moved
    assert "ragged-all-to-all" not in hlo


# -- the GPU/TPU exchange, its documented semantics emulated ---------------------------------------
def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):  # fmt: skip
    """``jax.lax.ragged_all_to_all`` as its docstring specifies it, from all-gathers: slice
    ``i`` of every source goes to device ``i // (K / n)`` at the source's ``output_offsets[i]``."""
    del recv_sizes  # implied by the senders' sizes
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    operands, starts, sizes, targets = (
        jax.lax.all_gather(a, axis_name)
        for a in (operand, input_offsets, send_sizes, output_offsets)
    )
    per_device = starts.shape[1] // n
    at = jnp.arange(output.shape[0])
    result = output
    for source in range(n):
        for j in range(per_device):
            i = me * per_device + j
            start, size, target = starts[source, i], sizes[source, i], targets[source, i]
            inside = (at >= target) & (at < target + size)
            taken = operands[source][jnp.clip(at - target + start, 0, operand.shape[0] - 1)]
            result = jnp.where(inside.reshape(-1, *[1] * (output.ndim - 1)), taken, result)
    return result


def test_the_ragged_exchange_hands_the_collective_offsets_that_compute_one_device(monkeypatch):
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    strategy, devices = LAYOUTS["dp2-ep4"]
    mesh = mesh_of(strategy, devices)
    with nnx.use_eager_sharding(False):
        block = MoE(EMBED, FF, EXPERTS, top_k=TOP_K, capacity_factor=None, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (ROWS, SEQ, EMBED))
    probs = jax.nn.softmax(x @ block.router[...], axis=-1)
    weights, ids = jax.lax.top_k(probs, TOP_K)  # the router's weights, not renormalised
    wi, wo = block.wi[...], block.wo[...]

    def loss(x, wi, wo, **options):
        return jnp.sum(moe_dropless.dropless_experts(x, weights, ids, wi, wo, **options) ** 2)

    def dense(x, wi, wo):  # every token through every expert, its top-k kept (plain jnp)
        each = jnp.einsum("bsef,efd->bsed", nnx.gelu(jnp.einsum("bsd,edf->bsef", x, wi)), wo)
        picked = jnp.take_along_axis(each, ids[..., None], 2)
        return jnp.sum(jnp.einsum("bsk,bskd->bsd", weights, picked) ** 2)

    want = jax.jit(jax.value_and_grad(dense, argnums=(0, 1, 2)))(x, wi, wo)
    # With a "batch" rule in force the shard_map is manual over the data axis too.
    rows_rule = nnx.logical_axis_rules([("batch", ("data", "expert"))])
    with jax.set_mesh(mesh), rows_rule, strategy.trace_context(mesh):
        got = jax.jit(jax.value_and_grad(
            lambda x, wi, wo: loss(x, wi, wo, expert_axes=("expert",),
                                   exchange="ragged_all_to_all"), argnums=(0, 1, 2)
        ))(x, wi, wo)  # fmt: skip
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_each_backend_names_its_exchange():
    assert moe_dropless.exchange_for("cpu") == "all_to_all"
    for platform in ("gpu", "tpu"):
        assert moe_dropless.exchange_for(platform) == "ragged_all_to_all"
