"""A seed document's model under SequenceParallel, as the document writes it, exact.

The GPT-2 ``TransformerBlock`` of the JAX scaling slides (``tests/test_seeds.py``
holds it as written: ``nnx.MultiHeadAttention`` with its default attention and
the ``causal_attention_mask(seq_len)`` the slides pass, ``sharding=("model",)``
annotations) is trained through ``Trainer.fit`` with its input's sequence
split, and checked against plain optax on one device
(``toy_models.train_reference``). Nothing of the model is adapted: its
attention is not ``nnx_spmd_trainer.nn.attention.causal_attention``, and the
compiler still splits it along the sequence (the scores of each device's
query chunk against gathered keys and values), exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_seeds import TransformerBlock, regression_batches, regression_loss
from test_sequence_parallel import LAYOUTS
from toy_models import RecordLosses, assert_params_match, train_reference

from nnx_spmd_trainer import (
    Plan,
    SequenceParallel,
    Trainer,
)

ROWS, SEQ, EMBED, STEPS = 4, 16, 16, 3


def block(rngs):
    return TransformerBlock(EMBED, 2, 32, 0.0, rngs)  # the slides' signature; no dropout


# SGD: Adam would turn the float noise of the attention key bias's zero gradient into
# lr-sized steps whose sign depends on the summation order (PITFALLS).
TX = optax.sgd(0.1)


@pytest.fixture(scope="module")
def reference():
    """Plain optax on one device, the same for every layout: computed once."""
    batches = regression_batches(STEPS, (ROWS, SEQ, EMBED))
    return train_reference(block, TX, batches, regression_loss)


@LAYOUTS
def test_the_seed_transformer_block_trains_like_one_device(strategy, spec, reference):
    batches = regression_batches(STEPS, (ROWS, SEQ, EMBED))
    recorder = RecordLosses()
    trainer = Trainer(block, TX, strategy=strategy, loss_fn=regression_loss, callbacks=[recorder])
    trainer.fit(batches, max_steps=STEPS)

    ref_params, ref_losses = reference
    np.testing.assert_allclose(recorder.losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_params_match(trainer, ref_params)
    # The (rows, seq, features) inputs were split along the sequence, the rows as the
    # other members say: each device attended with a chunk of the queries.
    mesh = dict(trainer.mesh.shape)
    rows_parts = trainer.mesh.size // mesh["seq"] // mesh.get("model", 1)
    for leaf in trainer.placement.place(batches[0]).values():
        assert leaf.sharding.spec == spec
        local = (ROWS // rows_parts, SEQ // mesh["seq"], EMBED)
        assert leaf.addressable_shards[0].data.shape == local
    # The slides' annotations still hold where the mesh has their axis; nothing is
    # split along seq.
    if "model" in mesh:
        assert trainer.model.linear1.kernel.get_value().sharding.spec[0] == "model"
    for _, variable in nnx.to_flat_state(nnx.state(trainer.model, nnx.Param)):
        assert "seq" not in jax.tree.leaves(tuple(variable.get_value().sharding.spec))


def test_its_plain_attention_is_split_too_no_device_holds_the_whole_score_matrix():
    """Why the plain attention needs no error under SequenceParallel: from the query chunk
    each device holds, the compiler gathers keys and values (an all-gather) and computes
    only that chunk's scores, as ``causal_attention`` asks it to."""
    rows, seq, embed, heads = 2, 512, 32, 4
    shapes = {k: jax.ShapeDtypeStruct((rows, seq, embed), jnp.float32) for k in ("x", "y")}
    plan = Plan(
        lambda r: TransformerBlock(embed, heads, 64, 0.0, r),
        TX,
        strategy=SequenceParallel(8),
        loss_fn=regression_loss,
    )
    report = plan.report(shapes)
    # A device holding the whole (rows, heads, seq, seq) float32 score matrix would need
    # at least its bytes of temporaries; its chunk is an eighth of that.
    whole_scores = rows * heads * seq * seq * 4
    assert report.memory["temporaries"] < whole_scores
    # Keys and values, gathered whole: (rows, seq, embed) float32 each.
    assert report.collectives["all-gather"]["bytes"] >= 2 * rows * seq * embed * 4
