"""The seed documents' examples, written as they teach them, trained through the Trainer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from toy_models import assert_params_match, train_reference

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, TensorParallel, Trainer

# -- seed: logical axis names with sharding_rules -----------------------------------
sharding_rules = (("batch", "data"), ("hidden", "model"), ("embed", None))


class LogicalDotReluDot(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth,
            depth,
            kernel_init=nnx.with_metadata(
                init_fn, sharding=("embed", "hidden"), sharding_rules=sharding_rules
            ),
            use_bias=False,
            rngs=rngs,
        )
        self.w2 = nnx.Param(
            init_fn(rngs.params(), (depth, depth)),
            sharding=("hidden", "embed"),
            sharding_rules=sharding_rules,
        )

    def __call__(self, x):
        y = jax.nn.relu(self.dot1(x))
        y = jax.lax.with_sharding_constraint(y, P("data", "model"))  # physical names in jit
        return jnp.dot(y, self.w2[...])


# -- seed: an MLP annotated (None, "model") ------------------------------------------
class MLP(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(
            nnx.with_metadata(init_fn, sharding=(None, "model"))(rngs.params(), (din, dhidden))
        )
        self.w2 = nnx.Param(
            nnx.with_metadata(init_fn, sharding=("model", None))(rngs.params(), (dhidden, dout))
        )

    def __call__(self, x):
        return nnx.relu(x @ self.w1[...]) @ self.w2[...]


# -- seed: the GPT-2 TransformerBlock annotated with sharding=("model",) ------------
def causal_attention_mask(seq_len):
    return jnp.tril(jnp.ones((seq_len, seq_len)))


class TransformerBlock(nnx.Module):
    def __init__(
        self, embed_dim: int, num_heads: int, ff_dim: int, dropout_rate: float, rngs: nnx.Rngs
    ):
        self.layer_norm1 = nnx.LayerNorm(
            epsilon=1e-6,
            num_features=embed_dim,
            scale_init=nnx.with_metadata(nnx.initializers.ones_init(), sharding=("model",)),
            bias_init=nnx.with_metadata(nnx.initializers.zeros_init(), sharding=("model",)),
            rngs=rngs,
        )
        self.mha = nnx.MultiHeadAttention(
            num_heads=num_heads,
            in_features=embed_dim,
            kernel_init=nnx.with_metadata(nnx.initializers.xavier_uniform(), sharding=("model",)),
            bias_init=nnx.with_metadata(nnx.initializers.zeros_init(), sharding=("model",)),
            rngs=rngs,
        )
        self.dropout1 = nnx.Dropout(rate=dropout_rate)
        self.layer_norm2 = nnx.LayerNorm(
            epsilon=1e-6,
            num_features=embed_dim,
            scale_init=nnx.with_metadata(nnx.initializers.ones_init(), sharding=("model",)),
            bias_init=nnx.with_metadata(nnx.initializers.zeros_init(), sharding=("model",)),
            rngs=rngs,
        )
        self.linear1 = nnx.Linear(
            in_features=embed_dim,
            out_features=ff_dim,
            kernel_init=nnx.with_metadata(nnx.initializers.xavier_uniform(), sharding=("model",)),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), sharding=("model",)),
            rngs=rngs,
        )
        self.linear2 = nnx.Linear(
            in_features=ff_dim,
            out_features=embed_dim,
            kernel_init=nnx.with_metadata(nnx.initializers.xavier_uniform(), sharding=("model",)),
            bias_init=nnx.with_metadata(nnx.initializers.zeros_init(), sharding=("model",)),
            rngs=rngs,
        )
        self.dropout2 = nnx.Dropout(rate=dropout_rate)

    def __call__(self, inputs, training: bool = False):
        _, seq_len, _ = inputs.shape
        attention_output = self.mha(
            inputs_q=self.layer_norm1(inputs), mask=causal_attention_mask(seq_len), decode=False
        )
        x = inputs + self.dropout1(attention_output, deterministic=not training)
        mlp_output = nnx.gelu(self.linear1(self.layer_norm2(x)))
        mlp_output = self.dropout2(self.linear2(mlp_output), deterministic=not training)
        return x + mlp_output


def regression_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}


def regression_batches(n, shape, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=shape).astype(np.float32),
            "y": rng.normal(size=shape).astype(np.float32),
        }
        for _ in range(n)
    ]


def train_and_compare(factory, strategy, batches, steps=3, tx=None):
    tx = tx or optax.adam(1e-2)
    trainer = Trainer(factory, tx, strategy=strategy, loss_fn=regression_loss)
    history = trainer.fit(batches, max_steps=steps)
    ref, losses = train_reference(factory, tx, batches[:steps], regression_loss)
    assert_params_match(trainer, ref)
    np.testing.assert_allclose(history.history["train/loss"], [np.mean(losses)], rtol=1e-5)
    return trainer


def test_logical_dot_relu_dot_with_sharding_rules():
    trainer = train_and_compare(
        lambda r: LogicalDotReluDot(16, r),
        Hybrid(DataParallel(4), TensorParallel(2)),
        regression_batches(3, (8, 16)),
    )
    assert trainer.model.dot1.kernel.get_value().sharding.spec == P(None, "model")
    assert trainer.model.w2.get_value().sharding.spec == P("model")


def test_seed_mlp_with_none_model_annotation():
    trainer = train_and_compare(
        lambda r: MLP(16, 32, 16, r), TensorParallel(8), regression_batches(3, (8, 16))
    )
    assert trainer.model.w1.get_value().sharding.spec == P(None, "model")
    assert trainer.model.w1.get_value().sharding.shard_shape((16, 32)) == (16, 4)


@pytest.mark.parametrize(
    "strategy",
    [
        Hybrid(
            DataParallel(4, axis="batch"), TensorParallel(2)
        ),  # the seed's ("batch", "model") mesh
        Hybrid(FSDP(4, min_size=256), TensorParallel(2)),
    ],
    ids=["batch4xmodel2", "fsdp4xmodel2"],
)
def test_gpt2_transformer_block_annotated_model(strategy):
    # The attention key bias has an exactly zero gradient (softmax ignores a shift shared
    # by a row), so Adam's default eps would turn rounding noise into full-size steps.
    trainer = train_and_compare(
        lambda r: TransformerBlock(16, 2, 32, 0.0, r),
        strategy,
        regression_batches(3, (8, 4, 16)),
        tx=optax.adam(1e-2, eps=1e-4),
    )
    block = trainer.model
    assert block.linear1.kernel.get_value().sharding.spec[0] == "model"
    assert block.layer_norm1.scale.get_value().sharding.spec == P("model")
    assert block.mha.query.kernel.get_value().sharding.spec[0] == "model"
    assert dict(trainer.mesh.shape)["model"] == 2


# -- seed: manual parallelism with shard_map and psum, inside the model ------------------
class ShardMapLayer(nnx.Module):
    """``layer_sharded`` of the seed: each device multiplies its feature slice, psum adds."""

    def __init__(self, din: int, dout: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.weights = nnx.Param(
            nnx.with_metadata(init_fn, sharding=("model", None))(rngs.params(), (din, dout))
        )
        self.bias = nnx.Param(jnp.zeros((dout,)))

    def __call__(self, x):
        def layer_sharded(x, weights, bias):
            return jax.nn.sigmoid(jax.lax.psum(x @ weights, "model") + bias)

        # No mesh argument: shard_map takes the mesh the Trainer sets around each step.
        return jax.shard_map(
            layer_sharded,
            in_specs=(P(None, "model"), P("model", None), P()),
            out_specs=P(),
        )(x, self.weights[...], self.bias[...])


def test_shard_map_with_psum_inside_the_model():
    batches = [
        {"x": b["x"], "y": b["y"][:, :4]} for b in regression_batches(3, (8, 16))
    ]  # 16 features in, 4 out
    trainer = train_and_compare(lambda r: ShardMapLayer(16, 4, r), TensorParallel(8), batches)
    assert trainer.model.weights.get_value().sharding.spec == P("model")
