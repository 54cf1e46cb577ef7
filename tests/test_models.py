"""Example models: shapes, train/eval semantics, annotations resolved by the strategies."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, TensorParallel, Trainer
from nnx_spmd_trainer.app.models import CNN, GPT, MLP, TransformerBlock, gpt, mlp
from nnx_spmd_trainer.configs import default

VOCAB = 16
TINY = dict(seq_len=8, embed_dim=32, num_heads=8, ff_dim=64, num_layers=1)


def tiny_gpt(rngs, dropout_rate=0.0):
    return GPT(vocab_size=VOCAB, dropout_rate=dropout_rate, rngs=rngs, **TINY)


def unsharded(build, *args, **kwargs):
    """Builds an annotated model outside any mesh (flax 0.12 shards eagerly by default)."""
    with nnx.use_eager_sharding(False):
        return build(*args, **kwargs)


def token_batches(n, batch=16, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        window = rng.integers(0, VOCAB, size=(batch, TINY["seq_len"] + 1), dtype=np.int32)
        out.append({"inputs": window[:, :-1], "targets": window[:, 1:]})
    return out


forward = nnx.jit(lambda model, x: model(x))  # eager op-by-op dispatch is slow


def specs(trainer):
    return {
        "/".join(map(str, path)): v.get_value().sharding.spec
        for path, v in nnx.to_flat_state(nnx.state(trainer.model, nnx.Param))
    }


def test_gpt_returns_logits_over_the_vocab():
    model = unsharded(tiny_gpt, nnx.Rngs(0))
    model.eval()
    logits = forward(model, jnp.zeros((3, 8), jnp.int32))
    assert logits.shape == (3, 8, VOCAB) and logits.dtype == jnp.float32
    with pytest.raises(ValueError, match="seq_len=8"):
        model(jnp.zeros((1, 9), jnp.int32))


def test_gpt_is_causal():
    model = unsharded(tiny_gpt, nnx.Rngs(0))
    model.eval()
    tokens = jnp.arange(8)[None] % VOCAB
    changed = tokens.at[0, 5].set(0)
    a, b = forward(model, tokens), forward(model, changed)
    np.testing.assert_allclose(a[0, :5], b[0, :5], atol=1e-6)  # the past ignores the future
    assert not np.allclose(a[0, 5:], b[0, 5:])


def test_dropout_follows_train_and_eval_modes():
    block = unsharded(TransformerBlock, 32, 8, 64, 0.5, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 4, 32))
    block.eval()
    np.testing.assert_array_equal(forward(block, x), forward(block, x))
    block.train()
    assert not np.allclose(forward(block, x), forward(block, x))  # a fresh mask per call


def test_loss_fn_is_mean_next_token_cross_entropy():
    model = unsharded(tiny_gpt, nnx.Rngs(1))
    model.eval()
    batch = token_batches(1, batch=4)[0]
    loss, aux = nnx.jit(gpt.loss_fn)(model, batch)
    logits = np.asarray(forward(model, batch["inputs"]), np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, batch["targets"][..., None], -1).mean()
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    # Per-token correctness, for the metrics to average per token (not per batch).
    assert set(aux) == {"accuracy"}
    np.testing.assert_array_equal(aux["accuracy"], logits.argmax(-1) == batch["targets"])

    # Padding rows marked by a mask leave the loss: the mean over the real rows alone.
    padded = {**batch, "mask": np.array([1, 1, 1, 0], np.float32)}
    masked_loss, _ = nnx.jit(gpt.loss_fn)(model, padded)
    real = -np.take_along_axis(log_probs, batch["targets"][..., None], -1)[:3].mean()
    assert float(masked_loss) == pytest.approx(real, rel=1e-5)


def test_gpt_params_are_sharded_under_fsdp_x_tensor_parallel():
    trainer = Trainer(
        tiny_gpt,
        optax.adamw(1e-3),
        strategy=Hybrid(FSDP(4, min_size=256), TensorParallel(2)),
        loss_fn=gpt.loss_fn,
    )
    got = specs(trainer)
    block = "blocks/0"
    assert got[f"{block}/linear1/kernel"] == P("fsdp", "model")  # ff split on model
    assert got[f"{block}/linear2/kernel"] == P("model", "fsdp")
    assert got[f"{block}/mha/query/kernel"] == P("fsdp", "model")  # heads split on model
    assert got[f"{block}/mha/out/kernel"][0] == "model"
    assert got[f"{block}/layer_norm1/scale"] == P("model")  # the seed's annotation
    assert got["token_embed/embedding"][0] == "model"  # vocabulary split
    assert got["head/kernel"][1] == "model"
    leaf = trainer.model.blocks[0].linear1.kernel.get_value()
    assert leaf.sharding.shard_shape(leaf.shape) == (32 // 4, 64 // 2)
    # optimizer moments are laid out like their parameters
    mu = trainer.optimizer.opt_state[0].mu["blocks"][0]["linear1"]["kernel"].get_value()
    assert mu.sharding.spec == P("fsdp", "model")
    history = trainer.fit(token_batches(2), max_steps=2)
    assert np.isfinite(history.history["train/loss"][-1])


@pytest.mark.parametrize("model_axis", [2, 4, 8])
def test_default_sizes_divide_every_model_axis(model_axis):
    sizes = default.get_config().gpt
    build = lambda: GPT(
        vocab_size=104,  # the pydoc characters, padded to a multiple of 8
        seq_len=sizes.seq_len,
        embed_dim=sizes.embed_dim,
        num_heads=sizes.num_heads,
        ff_dim=sizes.ff_dim,
        num_layers=1,
        dropout_rate=0.0,
        rngs=nnx.Rngs(0),
    )
    with nnx.use_eager_sharding(False):
        abstract = nnx.state(nnx.eval_shape(build))
    strategy = Hybrid(DataParallel(), TensorParallel(model_axis))
    shardings = strategy.state_shardings(abstract, strategy.make_mesh())  # raises if not
    split = [s for s in jax.tree.leaves(shardings) if "model" in s.spec]
    assert len(split) >= 10


@pytest.mark.slow
def test_sharded_gpt_trains_like_data_parallel():
    """The annotations change the layout, not the maths."""

    def losses(strategy):
        trainer = Trainer(tiny_gpt, optax.adam(3e-3), strategy=strategy, loss_fn=gpt.loss_fn)
        trainer.fit(token_batches(3), max_steps=3)
        return trainer.evaluate(token_batches(1, seed=9))["loss"]

    reference = losses(DataParallel())
    assert losses(Hybrid(FSDP(2), TensorParallel(4))) == pytest.approx(reference, rel=1e-4)


def test_gpt_with_dropout_trains_under_the_trainer():
    def build(rate):
        return Trainer(
            lambda rngs: tiny_gpt(rngs, dropout_rate=rate),
            optax.adam(1e-3),
            strategy=Hybrid(FSDP(4), TensorParallel(2)),
            loss_fn=gpt.loss_fn,
        )

    trainer, no_dropout = build(0.5), build(0.0)
    trainer.fit(token_batches(2), max_steps=2)
    assert int(trainer.model.dropout.rngs.count.get_value()) == 2  # one key per step
    # Evaluation switches dropout off: the same weights without dropout layers agree...
    no_dropout.state = jax.tree.map(jnp.copy, trainer.state)
    eval_batch = token_batches(1, seed=9)
    expected = no_dropout.evaluate(eval_batch)["loss"]
    assert trainer.evaluate(eval_batch)["loss"] == pytest.approx(expected, rel=1e-6)
    # ...while a training step on the same weights and batch drops units: its loss differs.
    no_dropout.state = jax.tree.map(jnp.copy, trainer.state)
    no_dropout.fit(eval_batch, max_steps=no_dropout.step + 1)
    trainer.fit(eval_batch, max_steps=trainer.step + 1)
    assert trainer.last_step.loss_value() != pytest.approx(
        no_dropout.last_step.loss_value(), rel=1e-3
    )


def test_mlp_and_cnn_shapes_and_annotations():
    model = unsharded(MLP, 8, 32, 4, rngs=nnx.Rngs(0))
    assert forward(model, jnp.ones((2, 8))).shape == (2, 4)
    assert model.fc1.kernel.get_metadata()["out_sharding"] == (None, "model")
    assert model.fc2.kernel.get_metadata()["out_sharding"] == ("model", None)
    cnn = unsharded(CNN, 1, 8, 4, rngs=nnx.Rngs(0))
    assert forward(cnn, jnp.ones((2, 12, 12, 1))).shape == (2, 4)
    assert cnn.conv2.kernel.get_metadata()["out_sharding"] == (None, None, None, "model")


def test_classifier_loss_and_tensor_parallel_layout():
    trainer = Trainer(
        lambda rngs: MLP(8, 32, 4, rngs=rngs),
        optax.adam(1e-2),
        strategy=Hybrid(DataParallel(4), TensorParallel(2)),
        loss_fn=mlp.loss_fn,
    )
    assert trainer.model.fc1.kernel.get_value().sharding.spec == P(None, "model")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    batch = {"inputs": x, "labels": (x[:, 0] > 0).astype(np.int32)}
    history = trainer.fit([batch] * 30, max_steps=30)
    assert history.history["train/loss"][-1] < np.log(4)


def test_causal_attention_equals_numpy():
    q, k, v = (
        np.random.default_rng(i).normal(size=(2, 6, 4, 8)).astype(np.float32) for i in range(3)
    )
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8)
    scores = np.where(np.tril(np.ones((6, 6), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    expected = np.einsum("bhqk,bkhd->bqhd", weights, v)
    got = jax.jit(gpt.causal_attention)(q, k, v)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert gpt.attention_implementation(jnp.float32) == "xla"
    assert gpt.attention_implementation(jnp.bfloat16) == "xla"  # cuDNN only on a GPU


def test_a_bf16_gpt_keeps_fp32_parameters_and_close_losses():
    batch = token_batches(1, batch=4)[0]
    losses = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        model = unsharded(
            lambda rngs, dtype=dtype: GPT(
                vocab_size=16, seq_len=8, embed_dim=32, num_heads=4, ff_dim=64,
                num_layers=1, dropout_rate=0.0, rngs=rngs, dtype=dtype,
            ),
            nnx.Rngs(0),
        )  # fmt: skip
        params = jax.tree.leaves(nnx.state(model, nnx.Param))
        assert {p.dtype for p in params} == {jnp.dtype(jnp.float32)}  # master weights
        loss, _ = nnx.jit(gpt.loss_fn)(model, batch)
        assert loss.dtype == jnp.float32
        losses[dtype] = float(loss)
    assert losses[jnp.bfloat16] == pytest.approx(losses[jnp.float32], abs=0.05)


def test_the_new_attention_equals_the_old_masked_one_in_fp32():
    """jax.nn.dot_product_attention(is_causal) against Flax's attention with a causal mask
    (what nnx.MultiHeadAttention computed before)."""
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 16, 4, 8)) for i in range(3))
    mask = jnp.tril(jnp.ones((16, 16), bool))
    old = nnx.dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(gpt.causal_attention(q, k, v), old, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_bf16_training_tracks_fp32_and_the_step_multiplies_in_bf16():
    batches = token_batches(100, batch=16)
    curves = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        trainer = Trainer(
            lambda rngs, dtype=dtype: GPT(vocab_size=VOCAB, dropout_rate=0.0, rngs=rngs,
                                          dtype=dtype, **TINY),
            optax.adamw(3e-3),
            loss_fn=gpt.loss_fn,
            log_every_n_steps=10,
        )  # fmt: skip
        history = trainer.fit(batches, max_steps=100)
        curves[dtype] = np.asarray(history.history["train/loss"])
        params = jax.tree.leaves(nnx.state(trainer.model, nnx.Param))
        assert {p.dtype for p in params} == {jnp.dtype(jnp.float32)}
        hlo = trainer.plan.lower(batches[0], train_step=trainer.train_step).as_text()
        matmuls = [line for line in hlo.splitlines() if "dot_general" in line]
        in_bf16 = [line for line in matmuls if "bf16" in line]
        assert bool(in_bf16) == (dtype == jnp.bfloat16), matmuls[:3]
    # Random tokens: both curves fall towards log(16) ~ 2.77; within 0.05 nats of each other.
    np.testing.assert_allclose(curves[jnp.bfloat16], curves[jnp.float32], atol=0.05)
