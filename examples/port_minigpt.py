"""The JAX AI Stack's miniGPT tutorial on the ``Trainer``: its own model, loss and layout.

    python examples/port_minigpt.py          # tiny: 2 blocks x 64, 24 steps
    python examples/port_minigpt.py --full   # the tutorial's sizes (vocabulary 50257)

A model the library did not write, ported as a user would. The model is the
tutorial's (``TransformerBlock``, ``TokenAndPositionEmbedding``, ``MiniGPT``),
each parameter annotated ``nnx.with_partitioning(init, NamedSharding(mesh,
P(...)))`` against its own ``Mesh(... ('batch', 'model'))``; its ``loss_fn``
returns ``(loss, logits)``; its loop is ``@nnx.jit def train_step(model,
optimizer, metrics, batch)`` over batches put on the mesh with
``NamedSharding(mesh, P('batch', None))``. What changes on the ``Trainer``:

* the mesh becomes a strategy of the same shape and names,
  ``Hybrid(DataParallel(4, axis="batch"), TensorParallel(2))``; the model's
  ``NamedSharding`` annotations are read against the trainer's mesh as they are;
* ``loss_fn`` is wrapped to return ``(loss, {})``: the tutorial's metrics read
  only the loss, and the trainer averages it;
* ``create_model`` is handed to the ``Trainer`` instead of being called, and the
  ``for`` loop with its ``train_step`` becomes ``fit``.

Two changes to the tutorial's code, both needed under Flax 0.12: the 1-D
parameters it annotates ``P(None, 'model')`` (two dimensions for one) are
annotated ``P('model')``, and ``optimizer.update`` takes the model. The
vocabulary is padded to a multiple of 128 (so of the model axis): 50257 does
not split over 2 devices. ``benchmarks/minigpt_overhead.py`` times both loops.
The script checks that both reach the same losses (to 1e-6, relative).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import mesh_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from nnx_spmd_trainer import DataParallel, Hybrid, TensorParallel, Trainer  # noqa: E402

LOG_EVERY = 8

# The tutorial's mesh: 4-way data parallel ("batch") by 2-way tensor parallel ("model").
mesh = Mesh(mesh_utils.create_device_mesh((4, 2)), ("batch", "model"))


def partitioned(init: nnx.Initializer, *spec: str | None) -> nnx.Initializer:
    """The tutorial's annotation: ``init`` with ``NamedSharding(mesh, P(*spec))`` attached."""
    return nnx.with_partitioning(init, NamedSharding(mesh, P(*spec)))


xavier, zeros, ones = (
    nnx.initializers.xavier_uniform(),
    nnx.initializers.zeros_init(),
    nnx.initializers.ones_init(),
)


def causal_attention_mask(seq_len: int) -> jax.Array:
    return jnp.tril(jnp.ones((seq_len, seq_len)))


class TransformerBlock(nnx.Module):
    """Self-attention and a feed-forward network, each with dropout, a residual and a
    post-layer norm; kernels split over "model" along their output dimension."""

    def __init__(
        self, embed_dim: int, num_heads: int, ff_dim: int, *, rngs: nnx.Rngs, rate: float = 0.1
    ):
        self.mha = nnx.MultiHeadAttention(
            num_heads=num_heads,
            in_features=embed_dim,
            kernel_init=partitioned(xavier, None, "model"),
            bias_init=partitioned(zeros, "model"),
            rngs=rngs,
        )
        self.dropout1 = nnx.Dropout(rate=rate)
        self.layer_norm1 = nnx.LayerNorm(
            embed_dim,
            epsilon=1e-6,
            scale_init=partitioned(ones, "model"),
            bias_init=partitioned(zeros, "model"),
            rngs=rngs,
        )
        self.linear1 = nnx.Linear(
            embed_dim,
            ff_dim,
            kernel_init=partitioned(xavier, None, "model"),
            bias_init=partitioned(zeros, "model"),
            rngs=rngs,
        )
        self.linear2 = nnx.Linear(
            ff_dim,
            embed_dim,
            kernel_init=partitioned(xavier, None, "model"),
            bias_init=partitioned(zeros, "model"),
            rngs=rngs,
        )
        self.dropout2 = nnx.Dropout(rate=rate)
        self.layer_norm2 = nnx.LayerNorm(  # the tutorial: P(None, "model") on these 1-D leaves
            embed_dim,
            epsilon=1e-6,
            scale_init=partitioned(ones, "model"),
            bias_init=partitioned(zeros, "model"),
            rngs=rngs,
        )

    def __call__(self, inputs: jax.Array, training: bool = False) -> jax.Array:
        _, seq_len, _ = inputs.shape
        attention = self.mha(inputs_q=inputs, mask=causal_attention_mask(seq_len), decode=False)
        attention = self.dropout1(attention, deterministic=not training)
        out1 = self.layer_norm1(inputs + attention)
        ffn = self.linear2(nnx.relu(self.linear1(out1)))
        ffn = self.dropout2(ffn, deterministic=not training)
        return self.layer_norm2(out1 + ffn)


class TokenAndPositionEmbedding(nnx.Module):
    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
        self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        positions = jnp.arange(0, x.shape[1])[None, :]
        return self.token_emb(x) + self.pos_emb(positions)


class MiniGPT(nnx.Module):
    def __init__(
        self,
        maxlen: int,
        vocab_size: int,
        embed_dim: int,
        num_heads: int,
        feed_forward_dim: int,
        num_transformer_blocks: int,
        rngs: nnx.Rngs,
    ):
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim, rngs=rngs)
        self.transformer_blocks = nnx.List(
            TransformerBlock(embed_dim, num_heads, feed_forward_dim, rngs=rngs)
            for _ in range(num_transformer_blocks)
        )
        self.output_layer = nnx.Linear(
            embed_dim,
            vocab_size,
            kernel_init=partitioned(xavier, None, "model"),
            bias_init=partitioned(zeros, "model"),  # the tutorial: P(None, "model")
            rngs=rngs,
        )

    def __call__(self, inputs: jax.Array, training: bool = False) -> jax.Array:
        x = self.embedding_layer(inputs)
        for transformer_block in self.transformer_blocks:
            x = transformer_block(x, training=training)
        return self.output_layer(x)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The tutorial's hyperparameters (``--full``) or tiny ones for a CPU."""

    vocab_size: int = 1000
    maxlen: int = 64
    embed_dim: int = 64
    num_heads: int = 4
    feed_forward_dim: int = 64
    num_transformer_blocks: int = 2
    batch_size: int = 32  # rows: a multiple of the "batch" axis
    steps: int = 24

    @property
    def padded_vocab(self) -> int:
        """The vocabulary rounded up to a multiple of 128 (so of the "model" axis)."""
        return -(-self.vocab_size // 128) * 128


TINY = Sizes()
# The tutorial's sizes (its create_model builds 4 blocks); a CPU step takes seconds.
FULL = Sizes(50257, 256, 256, 8, 256, 4, batch_size=32, steps=48)


def create_model(sizes: Sizes, rngs: nnx.Rngs) -> MiniGPT:
    return MiniGPT(
        sizes.maxlen,
        sizes.padded_vocab,
        sizes.embed_dim,
        sizes.num_heads,
        sizes.feed_forward_dim,
        sizes.num_transformer_blocks,
        rngs=rngs,
    )


def loss_fn(model: MiniGPT, batch: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """The tutorial's loss: ``batch`` is ``(inputs, targets)``; returns ``(loss, logits)``."""
    logits = model(batch[0])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch[1]).mean()
    return loss, logits


def token_batches(sizes: Sizes, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(inputs, targets)`` host batches: rows of a fixed walk through the vocabulary (so
    there is something to learn) from random starts, targets shifted left with a 0 pad
    (the tutorial's ``prep_target_batch``)."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, sizes.vocab_size, (sizes.steps, sizes.batch_size, 1))
    tokens = (starts + 7 * np.arange(sizes.maxlen)) % sizes.vocab_size
    targets = np.concatenate([tokens[..., 1:], np.zeros_like(tokens[..., :1])], axis=-1)
    return [(x.astype(np.int32), y.astype(np.int32)) for x, y in zip(tokens, targets, strict=True)]


# ---- BEFORE: the tutorial's loop -----------------------------------------------------------
@nnx.jit
def train_step(model: MiniGPT, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch[1])
    optimizer.update(model, grads)


def tutorial_loop(sizes: Sizes, batches: list) -> list[float]:
    """The tutorial's training loop; the average loss every ``LOG_EVERY`` steps."""
    model = create_model(sizes, nnx.Rngs(0))  # parameters born sharded on `mesh`
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    history = []
    for step, (inputs, targets) in enumerate(batches, start=1):
        train_step(
            model,
            optimizer,
            metrics,
            jax.device_put((inputs, targets), NamedSharding(mesh, P("batch", None))),
        )
        if step % LOG_EVERY == 0:
            history.append(float(metrics.compute()["loss"]))
            metrics.reset()
    return history


# ---- AFTER: the same on the Trainer --------------------------------------------------------
def trainer_loss_fn(model: MiniGPT, batch: tuple) -> tuple[jax.Array, dict]:
    return loss_fn(model, batch)[0], {}  # the tutorial's metrics read only the loss


def ported_trainer(sizes: Sizes, **options: object) -> Trainer:
    """The tutorial's model, loss and optimizer on a ``Trainer`` laid out as its mesh."""
    shape = dict(mesh.shape)
    return Trainer(
        lambda rngs: create_model(sizes, rngs),  # seed=0: the same nnx.Rngs(0)
        optax.adam(1e-3),
        strategy=Hybrid(DataParallel(shape["batch"], axis="batch"), TensorParallel(shape["model"])),
        loss_fn=trainer_loss_fn,
        log_every_n_steps=LOG_EVERY,
        **options,  # type: ignore[arg-type]
    )


def trainer_loop(sizes: Sizes, batches: list) -> list[float]:
    trainer = ported_trainer(sizes)
    return trainer.fit(batches, max_steps=len(batches)).history["train/loss"]


def main(full: bool = False) -> list[float]:
    sizes = FULL if full else TINY
    batches = token_batches(sizes)
    old = tutorial_loop(sizes, batches)
    new = trainer_loop(sizes, batches)
    print("loss every", LOG_EVERY, "steps, tutorial loop:", np.round(old, 5).tolist())
    print("loss every", LOG_EVERY, "steps, Trainer:      ", np.round(new, 5).tolist())
    # Relative float32 rounding: the trainer's step sums in its own order, and Adam turns
    # the noise on the attention's key bias (whose true gradient is 0) into lr-sized steps.
    drift = float(np.max(np.abs(np.subtract(old, new)) / np.abs(old)))
    print(f"largest relative difference {drift:.1e}")
    if drift > 1e-6 or not new[-1] < new[0]:
        raise SystemExit(f"FAILED: the two loops differ or did not learn: {old} vs {new}")
    print("OK: port_minigpt: the tutorial's loop and the Trainer reach the same losses")
    return new


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the tutorial's sizes")
    main(parser.parse_args().full)
