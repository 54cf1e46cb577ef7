"""optim.muon: optax.contrib.muon's update, Newton-Schulz once per matrix across the mesh.

Exactness: three steps through the Trainer under DP(8), FSDP(8), FSDP(4) x TP(2), a
scanned GPT and the MoE GPT under expert parallelism equal three steps of plain
``optax.contrib.muon`` on one device (a jitted loop written here, with hand-written
dimension numbers), within 1e-5. The attention's key bias is left out: its true gradient
is 0 and AdamW (Muon's partner for biases) turns its float noise into lr-sized steps whose
sign depends on summation order (PITFALLS.md); Muon's own leaves are all compared.

Communication, from the optimizer's update compiled alone (``muon_report``): no
all-gather under FSDP (each matrix goes whole to one owner by all-to-all), and the
Newton-Schulz FLOPs per device an eighth of the replicated version's under DP(8).
"""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from optax.contrib import MuonDimensionNumbers as Dims
from test_scan_layers import TINY, scanned_from_unrolled, token_batches, unrolled

from nnx_spmd_trainer import (
    FSDP,
    DataParallel,
    ExpertParallel,
    Hybrid,
    Plan,
    TensorParallel,
    Trainer,
    optim,
)
from nnx_spmd_trainer.app.models import GPT, gpt
from nnx_spmd_trainer.optim import muon_layout, muon_report
from nnx_spmd_trainer.planner.plan_report import collectives

STEPS = 3
SETTINGS = dict(learning_rate=0.02, adam_learning_rate=3e-3, weight_decay=0.01)
NOISE_ONLY = "mha/key/bias"  # zero true gradient: AdamW steps its noise (see above)


def names_of(path):
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey):
        path = path[:-1]  # a Variable's .value
    return [getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path]


def hand_dims(params):
    """Muon's leaves, written out: attention projections keep heads in the matrix, other
    kernels are [*batch, in, out]; embeddings, biases, norms and 1-D leaves go to AdamW."""

    def rule(path, x):
        names, n = names_of(path), x.ndim
        if n < 2 or names[-1] in ("embedding", "bias", "scale"):
            return None
        if names[-2] in ("query", "key", "value"):
            return Dims(n - 3, (n - 2, n - 1))
        if names[-2] == "out":
            return Dims((n - 3, n - 2), n - 1)
        return Dims(n - 2, n - 1)

    return jax.tree_util.tree_map_with_path(rule, params)


def one_device_muon(factory, batches):
    """Plain optax.contrib.muon on one device, every step one jitted program."""
    device = jax.devices()[0]
    names = ("data", "fsdp", "model", "batch", "expert")
    mesh = jax.make_mesh((1,) * 5, names, axis_types=(jax.sharding.AxisType.Auto,) * 5,
                         devices=[device])  # fmt: skip
    tx = optax.contrib.muon(**SETTINGS, muon_weight_dimension_numbers=hand_dims)
    with jax.set_mesh(mesh), jax.default_device(device), nnx.use_eager_sharding(False):
        graphdef, params, rest = nnx.split(factory(nnx.Rngs(0)), nnx.Param, ...)
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, batch):
            def loss(p):
                return gpt.loss_fn(nnx.merge(graphdef, p, rest), batch)[0]

            updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        for batch in batches:
            params, opt_state = step(params, opt_state, batch)
    return nnx.to_pure_dict(params)


def flat(tree):
    return {"/".join(map(str, names_of(p))): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}  # fmt: skip


def assert_close(trainer, want):
    got, want = flat(nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param))), flat(want)
    assert got.keys() == want.keys()
    for key in want:
        if NOISE_ONLY not in key:
            np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-5, err_msg=key)


def moe_gpt(rngs):
    return GPT(**TINY, num_layers=2, dropout_rate=0.0, rngs=rngs, moe_experts=4, moe_every=2)


@pytest.fixture(scope="module")
def unrolled_reference():
    return one_device_muon(unrolled, token_batches(STEPS))


def trained(factory, strategy):
    trainer = Trainer(factory, optim.muon(**SETTINGS), loss_fn=gpt.loss_fn, strategy=strategy)
    trainer.fit(token_batches(STEPS), max_steps=STEPS)
    return trainer


@pytest.mark.parametrize(
    "strategy",
    [DataParallel(), FSDP(8, min_size=1), Hybrid(FSDP(4, min_size=1), TensorParallel(2))],
    ids=["dp8", "fsdp8", "fsdp4-tp2"],
)
def test_sharded_muon_trains_like_one_device_optax_muon(strategy, unrolled_reference):
    assert_close(trained(unrolled, strategy), unrolled_reference)


def test_scanned_layers_are_a_batch_of_matrices(unrolled_reference):
    # The scanned GPT's [layers, in, out] leaves against the unrolled GPT's matrices.
    trainer = trained(scanned_from_unrolled, Hybrid(FSDP(4, min_size=1), TensorParallel(2)))
    assert_close(trainer, gpt.stack_blocks(unrolled_reference))


def test_experts_under_expert_parallelism():
    want = one_device_muon(moe_gpt, token_batches(STEPS))
    assert_close(trained(moe_gpt, Hybrid(DataParallel(2), ExpertParallel(4))), want)


# -- communication, from the compiled optimizer update ---------------------------------
def deep_gpt(rngs):
    """Eight scanned layers: each stacked leaf is a batch of 8 matrices, one per device."""
    return GPT(**TINY, num_layers=8, dropout_rate=0.0, rngs=rngs, scan_layers=True)


def newton_schulz_flops(plan):
    """Five quintic iterations on every Muon matrix: (4 s^2 l + 2 s^3) each, s <= l."""
    params = nnx.state(nnx.merge(plan.graphdef, plan.abstract_state)["model"], nnx.Param)
    total = 0
    for (_, x), d in zip(
        jax.tree_util.tree_flatten_with_path(params)[0],
        jax.tree.leaves(hand_dims(params), is_leaf=lambda d: d is None or isinstance(d, Dims)),
        strict=True,
    ):
        if d is None:
            continue
        axes = [[a % x.ndim for a in ((v,) if isinstance(v, int) else v)] for v in d]
        m, n = (math.prod(x.shape[a] for a in group) for group in axes)
        batch = math.prod(x.shape[a] for a in range(x.ndim) if a not in axes[0] + axes[1])
        s, big = min(m, n), max(m, n)
        total += batch * 5 * (4 * s * s * big + 2 * s**3)
    return total


def update_program(strategy, tx):
    plan = Plan(deep_gpt, tx, strategy=strategy, loss_fn=gpt.loss_fn)
    compiled = muon_report.optimizer_update(plan)
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return plan, analysis["flops"], collectives(compiled.as_text())


def xla_default():
    return optax.contrib.muon(**SETTINGS, muon_weight_dimension_numbers=hand_dims)


def test_under_fsdp_each_matrix_moves_whole_to_one_owner_by_all_to_all():
    _, _, ours = update_program(FSDP(8, min_size=1), optim.muon(**SETTINGS))
    _, _, xla = update_program(FSDP(8, min_size=1), xla_default())
    sent = {name: sum(c["bytes"] for c in table.values()) for name, table in
            (("sharded Muon", ours), ("optax.contrib.muon left to XLA", xla))}  # fmt: skip
    print(f"optimizer collectives per step, FSDP(8), 8 scanned layers: {sent}")
    assert ours["all-gather"]["count"] == 0, ours  # no matrix gathered to the FSDP axis
    assert ours["all-to-all"]["count"] > 0
    assert xla["all-gather"]["count"] > 0  # what XLA does with the same update
    assert sent["sharded Muon"] < sent["optax.contrib.muon left to XLA"]


def test_newton_schulz_runs_once_per_matrix_across_the_mesh():
    # DP(8): XLA's default runs every matrix's iterations on every device.
    plan, ours, _ = update_program(DataParallel(), optim.muon(**SETTINGS))
    _, replicated, _ = update_program(DataParallel(), xla_default())
    iterations = newton_schulz_flops(plan)
    rest = replicated - iterations  # momentum, AdamW, the scale: the same in both
    print(f"per-device FLOPs: sharded {ours:.3g}, replicated {replicated:.3g}, "
          f"Newton-Schulz of every matrix {iterations:.3g}")  # fmt: skip
    assert rest > 0  # the replicated program holds every matrix's iterations
    assert ours - rest <= 1.5 * iterations / 8  # an eighth each (the head pads to 8)


def abstract_params(factory):
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_without_a_plan_the_update_is_optax_muon():
    # A plain jit loop (no plan's layout): the same numbers as optax's own update.
    params = abstract_params(deep_gpt)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), params)
    grads = jax.tree.map(lambda x: np.float32(0.1) * x[::-1] if x.ndim else x, params)
    assert muon_layout.current_layout() is None
    ours, theirs = optim.muon(**SETTINGS), xla_default()
    a = jax.jit(lambda g, p: ours.update(g, ours.init(p), p)[0])(grads, params)
    b = jax.jit(lambda g, p: theirs.update(g, theirs.init(p), p)[0])(grads, params)
    for key, value in flat(b).items():
        np.testing.assert_allclose(flat(a)[key], value, rtol=0, atol=1e-6, err_msg=key)


def test_the_default_split_follows_the_reference_recipe():
    params = abstract_params(moe_gpt)
    mine = flat(jax.tree.map(lambda d: d is not None, optim.matrix_dimension_numbers(params),
                             is_leaf=lambda d: d is None or isinstance(d, Dims)))  # fmt: skip
    muon_leaves = sorted(k for k, v in mine.items() if v)
    assert "token_embed/embedding" not in muon_leaves and "head/kernel" in muon_leaves
    assert "blocks/1/moe/wi" in muon_leaves  # experts: a batch of matrices
    assert not any(k.endswith(("bias", "scale")) for k in muon_leaves)


def test_the_command_line_optimizer_is_muon_after_clipping():
    from nnx_spmd_trainer.app.run_config import make_optimizer
    from nnx_spmd_trainer.configs import default

    config = default.get_config()
    config.optimizer = "muon"
    params = {"w": np.ones((4, 6), np.float32), "b": np.ones((6,), np.float32)}
    state = make_optimizer(config).init(params)

    def is_muon(s):
        return isinstance(s, optax.contrib.MuonState)

    found = [s for s in jax.tree.leaves(state, is_leaf=is_muon) if is_muon(s)]
    assert len(found) == 1  # Muon's momentum for the matrix alone, the bias AdamW's
    assert [x.shape for x in jax.tree.leaves(found[0].mu)] == [(4, 6)]
    config.optimizer = "sgd"
    with pytest.raises(ValueError, match="config.optimizer='sgd': use 'adamw' or 'muon'"):
        make_optimizer(config)
