"""GPT(scan_layers=True): the blocks stacked and run by nnx.scan, laid out and computing as
the unrolled GPT does; per-block remat composes with it, and the config reaches both.

The two forms initialise differently from one seed, so the scanned model is given the
unrolled model's initial parameters (``gpt.stack_blocks``) and checked against the
unrolled model trained with plain optax on one device (``toy_models.train_reference``).
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from toy_models import RecordLosses, train_reference

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, Plan, TensorParallel, Trainer
from nnx_spmd_trainer.app import tasks
from nnx_spmd_trainer.app.models import GPT, gpt
from nnx_spmd_trainer.configs import default
from nnx_spmd_trainer.nn import remat as remat_lib
from nnx_spmd_trainer.sharding import path_str

VOCAB, SEQ, ROWS, STEPS, LAYERS = 16, 8, 8, 3, 2
TINY = dict(vocab_size=VOCAB, seq_len=SEQ, embed_dim=16, num_heads=4, ff_dim=32)


def unrolled(rngs, dropout_rate=0.0, num_layers=LAYERS, **options):
    return GPT(**TINY, num_layers=num_layers, dropout_rate=dropout_rate, rngs=rngs, **options)


def scanned(rngs, dropout_rate=0.0, num_layers=LAYERS, **options):
    return GPT(
        **TINY,
        num_layers=num_layers,
        dropout_rate=dropout_rate,
        rngs=rngs,
        scan_layers=True,
        **options,
    )


def holding(model, source, *, stack):
    """``model`` with the state ``source`` (a pure dict), its blocks stacked if ``stack``."""
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, gpt.stack_blocks(source) if stack else source)
    nnx.update(model, state)
    return model


def scanned_from_unrolled(rngs, **options):
    """A scanned GPT holding the unrolled GPT's initial state, its blocks stacked."""
    source = nnx.to_pure_dict(nnx.state(unrolled(rngs)))
    return holding(scanned(nnx.Rngs(1), **options), source, stack=True)  # built under jit


def token_batches(n, seed=0):
    rng = np.random.default_rng(seed)
    windows = (rng.integers(0, VOCAB, size=(ROWS, SEQ + 1), dtype=np.int32) for _ in range(n))
    return [{"inputs": w[:, :-1], "targets": w[:, 1:]} for w in windows]


def built(factory, **options):
    """Built under jit: eager initialisation dispatches op by op (slow on a busy CPU)."""
    with nnx.use_eager_sharding(False):
        return nnx.jit(lambda: factory(nnx.Rngs(0), **options))()


def losses_and_grads(models, batch):
    """``[(loss, grads)]`` of each model, in one compiled program (one compile for all)."""
    value_and_grad = nnx.value_and_grad(lambda m, b: gpt.loss_fn(m, b)[0])
    results = nnx.jit(lambda ms, b: [value_and_grad(m, b) for m in ms])(models, batch)
    return [(float(loss), nnx.to_pure_dict(grads)) for loss, grads in results]


def assert_trees_close(got, want, **tolerance):
    flat_got = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(got)[0]}
    flat_want = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(want)[0]}
    assert flat_got.keys() == flat_want.keys()
    for key, value in flat_want.items():
        np.testing.assert_allclose(flat_got[key], value, err_msg=key, **tolerance)


# -- layout -----------------------------------------------------------------------------
def test_stacked_leaves_keep_the_unrolled_layout_with_the_layer_dim_whole():
    """Under FSDP x TP every stacked leaf (and its Adam moments) is laid out as
    (None, *the unrolled block's spec). min_size=16 makes FSDP's fallback consider the
    small leaves too: a stacked layer norm (4, 16) would otherwise be split on its layers."""

    def specs(factory):
        plan = Plan(
            factory,
            optax.adam(1e-3),
            strategy=Hybrid(FSDP(4, min_size=16), TensorParallel(2)),
            loss_fn=gpt.loss_fn,
        )
        flat = jax.tree_util.tree_flatten_with_path(plan.shardings)[0]
        return {path_str(p): s.spec for p, s in flat}

    flat = specs(lambda rngs: unrolled(rngs, num_layers=4))
    stacked = specs(lambda rngs: scanned(rngs, num_layers=4))
    assert {k for k in stacked if "/blocks/" not in k} == {k for k in flat if "/blocks/" not in k}
    compared = 0
    for key, spec in stacked.items():
        if "/blocks/" not in key:
            assert spec == flat[key], key
            continue
        head, tail = key.split("/blocks/")
        layer0 = flat[f"{head}/blocks/0/{tail}"]
        if tail.endswith(("rngs/key", "rngs/count")):
            assert spec == layer0 == P(), key  # dropout streams: small, replicated
            continue
        assert spec == P(None, *layer0), (key, spec, layer0)
        compared += 1
    assert compared == 16 * 3  # 16 parameters per block, in the model, Adam's mu and nu
    # The layouts are the sharded ones test_models checks, not trivially equal:
    model = "model/blocks"
    assert stacked[f"{model}/linear1/kernel"] == P(None, "fsdp", "model")
    assert stacked[f"{model}/layer_norm1/scale"] == P(None, "model")


# -- the same maths -----------------------------------------------------------------------
def test_scanned_forward_loss_and_grads_equal_the_unrolled_ones():
    batch = token_batches(1)[0]
    reference, model = built(unrolled), built(scanned_from_unrolled)
    (ref_loss, ref_grads), (loss, grads) = losses_and_grads([reference, model], batch)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_trees_close(grads, gpt.stack_blocks(ref_grads), rtol=1e-5, atol=1e-6)
    # The logits, and features + head: the whole forward pass (the chunked loss reads
    # the two apart).
    logits, ref_logits, features = nnx.jit(
        lambda m, r, x: (m(x), r(x), m.head(m.features(x)).astype(jnp.float32))
    )(model, reference, batch["inputs"])
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(features, logits)


def test_stack_blocks_and_unstack_blocks_are_inverse():
    state = nnx.to_pure_dict(nnx.state(built(unrolled), nnx.Param))
    stacked = gpt.stack_blocks(state)
    assert stacked["blocks"]["linear1"]["kernel"].shape == (LAYERS, 16, 32)
    np.testing.assert_array_equal(
        stacked["blocks"]["linear1"]["kernel"][1], state["blocks"][1]["linear1"]["kernel"]
    )
    assert_trees_close(gpt.unstack_blocks(stacked, LAYERS), state, rtol=0, atol=0)


@pytest.fixture(scope="module")
def reference():
    """The unrolled GPT trained with plain optax on one device: computed once."""
    return train_reference(unrolled, optax.sgd(0.5), token_batches(STEPS), loss_fn=gpt.loss_fn)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "remat"),
    [
        (DataParallel(), "none"),
        (FSDP(8, min_size=16), "none"),
        (Hybrid(FSDP(4, min_size=16), TensorParallel(2)), "dots_with_no_batch_dims_saveable"),
    ],
    ids=["dp8", "fsdp8", "fsdp4-tp2-remat"],
)
def test_scanned_gpt_trains_like_the_unrolled_one_on_one_device(strategy, remat, reference):
    # SGD: Adam would amplify the float noise of the key bias's zero gradient (PITFALLS).
    recorder = RecordLosses()
    trainer = Trainer(
        lambda rngs: scanned_from_unrolled(rngs, remat=remat),
        optax.sgd(0.5),
        strategy=strategy,
        loss_fn=gpt.loss_fn,
        callbacks=[recorder],
    )
    trainer.fit(token_batches(STEPS), max_steps=STEPS)
    ref_params, ref_losses = reference
    np.testing.assert_allclose(recorder.losses, ref_losses, rtol=1e-5, atol=1e-5)
    got = nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param))
    want = gpt.stack_blocks(nnx.to_pure_dict(ref_params))
    assert_trees_close(jax.device_get(got), want, rtol=1e-5, atol=1e-5)
    assert isinstance(trainer.model.blocks, gpt.TransformerBlock)
    assert (type(trainer.model.blocks).__name__ == "RematTransformerBlock") == (remat != "none")


# -- dropout ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_scanned_dropout_draws_a_stream_per_layer_deterministically():
    x = jnp.asarray(token_batches(1)[0]["inputs"])
    with nnx.use_eager_sharding(False):
        a, b = nnx.jit(lambda: tuple(scanned(nnx.Rngs(0), dropout_rate=0.5) for _ in "ab"))()
    keys = np.asarray(jax.random.key_data(a.blocks.dropout1.rngs.key.get_value()))
    assert keys.shape[0] == LAYERS and len({tuple(k) for k in keys}) == LAYERS
    first, second, other = nnx.jit(lambda a, b, x: (a(x), a(x), b(x)))(a, b, x)
    np.testing.assert_array_equal(other, first)  # one seed, one run
    assert not np.allclose(second, first)  # a fresh mask per call
    np.testing.assert_array_equal(a.blocks.dropout1.rngs.count.get_value(), [2] * LAYERS)
    a.eval()  # reaches the stacked block's Dropouts
    assert a.blocks.dropout1.deterministic and a.blocks.dropout2.deterministic


# -- remat and the config ------------------------------------------------------------------------
def gpt_config(**gpt_keys):
    config = default.get_config()
    config.batch_size = ROWS
    config.gpt.update(seq_len=SEQ, embed_dim=16, num_heads=4, ff_dim=32, num_layers=LAYERS)
    config.gpt.update(gpt_keys)
    return config


@pytest.mark.slow
def test_every_remat_policy_composes_with_scan_layers_through_the_config():
    """config -> gpt_task -> GPT: each policy, unrolled and scanned, computes the plain
    model's loss and gradients (every model given the plain model's initial state)."""
    batch = token_batches(1)[0]
    policies = [p for p in remat_lib.POLICIES if p not in remat_lib.OFFLOADING]
    plain = built(unrolled)
    source = nnx.to_pure_dict(nnx.state(plain))
    models = {}
    for policy in policies:
        for scan in (False, True):
            factory = tasks.build_task(gpt_config(remat=policy, scan_layers=scan)).model
            with nnx.use_eager_sharding(False):
                abstract = nnx.eval_shape(lambda f=factory: f(nnx.Rngs(0)))
            models[policy, scan] = holding(abstract, source, stack=scan)
    results = losses_and_grads([plain, *models.values()], batch)
    ref_loss, ref_grads = results[0]
    for ((policy, scan), model), (loss, grads) in zip(models.items(), results[1:], strict=True):
        assert isinstance(model.blocks, gpt.TransformerBlock) == scan
        block = model.blocks if scan else model.blocks[0]
        assert (type(block).__name__ == "RematTransformerBlock") == (policy != "none")
        assert loss == pytest.approx(ref_loss, rel=1e-5), (policy, scan)
        want = gpt.stack_blocks(ref_grads) if scan else ref_grads
        assert_trees_close(grads, want, rtol=1e-5, atol=1e-6)


def test_bad_scan_and_remat_settings_are_config_errors():
    with pytest.raises(tasks.ConfigError, match=r"config.gpt.remat='fast'.*full"):
        tasks.gpt_layers(gpt_config(remat="fast"))
    with pytest.raises(tasks.ConfigError, match=r"config.gpt.remat=.*offload.*CPU"):
        tasks.gpt_layers(gpt_config(remat="offload_dot_with_no_batch_dims"))
    with pytest.raises(tasks.ConfigError, match=r"scan_layers='yes'.*True"):
        tasks.gpt_layers(ml_collections.ConfigDict({"gpt": {"scan_layers": "yes"}}))
    assert tasks.gpt_layers(gpt_config()) == (False, "none")  # the shipped default


class _Affine(nnx.Module):
    """``(x @ kernel + bias) * scale``: layers that do not commute, so the order shows."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x, scale):
        return self.linear(x) * scale


@pytest.mark.parametrize("form", ["list", "stack"])
def test_run_layers_runs_a_list_or_a_stack_layer_by_layer_in_order(form):
    """``stack.run_layers``, the one scan-or-loop both GPTs call: a list of blocks and a stack
    each equal NumPy's layer-by-layer product, the side array read by every layer."""
    from nnx_spmd_trainer.nn import stack

    with nnx.use_eager_sharding(False):
        if form == "list":
            layers = nnx.List([_Affine(nnx.Rngs(i)) for i in range(3)])
            kernels = [np.asarray(layer.linear.kernel[...]) for layer in layers]
            biases = [np.asarray(layer.linear.bias[...]) for layer in layers]
        else:
            layers = stack.stacked(_Affine, 3, nnx.Rngs(0))
            kernels = list(np.asarray(layers.linear.kernel[...]))
            biases = list(np.asarray(layers.linear.bias[...]))
    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    scale = np.array([[0.5], [2.0]], np.float32)
    want = x.astype(np.float64)
    for kernel, bias in zip(kernels, biases, strict=True):
        want = (want @ kernel + bias) * scale
    got = stack.run_layers(layers, jnp.asarray(x), jnp.asarray(scale))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_a_scanned_stack_keeps_its_rows_split_under_fsdp():
    """The scan's carry is laid out as the batch's rows (``stack.rows_split``), not as
    the weights: under FSDP the compiled step's temporaries per device are about
    DataParallel's, where they were 4-5x (every row's activations on every device),
    growing with the global batch (issue 55's finding on TPU targets)."""

    def make(rngs):
        return GPT(vocab_size=512, seq_len=128, embed_dim=64, num_heads=4, ff_dim=256,
                   num_layers=4, dropout_rate=0.0, rngs=rngs, scan_layers=True)  # fmt: skip

    def temporaries(plan_strategy, rows):
        plan = Plan(make, optax.adamw(1e-3), strategy=plan_strategy, loss_fn=gpt.loss_fn)
        shape = jax.ShapeDtypeStruct((rows, 128), jnp.int32)
        return plan.report({"inputs": shape, "targets": shape}).memory["temporaries"]

    for rows in (8, 32):
        fsdp, data_parallel = temporaries(FSDP(), rows), temporaries(DataParallel(), rows)
        assert fsdp < 1.5 * data_parallel, (rows, fsdp, data_parallel)
