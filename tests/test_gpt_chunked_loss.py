"""config.gpt.chunked_loss: the GPT's loss computed a chunk of positions at a time
(``gpt.chunked_loss_fn``) equals its plain loss over the full logits, values and gradients."""

import jax
import numpy as np
import pytest
from flax import nnx

from nnx_spmd_trainer.app import tasks
from nnx_spmd_trainer.app.models import gpt
from nnx_spmd_trainer.configs import default
from nnx_spmd_trainer.sharding import path_str

VOCAB, SEQ, ROWS = 16, 8, 4


def batch():
    window = np.random.default_rng(0).integers(0, VOCAB, size=(ROWS, SEQ + 1), dtype=np.int32)
    # The last row is padding: both losses average over the real rows only.
    return {"inputs": window[:, :-1], "targets": window[:, 1:], "mask": np.array([1, 1, 1, 0])}


def flat(tree):
    return {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_the_chunked_gpt_loss_equals_the_plain_one(scan_layers):
    config = default.get_config()
    config.batch_size = ROWS
    config.gpt.update(seq_len=SEQ, embed_dim=16, num_heads=4, ff_dim=32, num_layers=2)
    config.gpt.update(scan_layers=scan_layers, chunked_loss=3)  # 8 positions: chunks 3, 3, 2
    task = tasks.build_task(config)  # config -> gpt_task -> the chunked loss
    assert task.loss_fn.func is gpt.chunked_loss_fn and task.loss_fn.keywords == {"chunk_size": 3}
    with nnx.use_eager_sharding(False):
        model = nnx.jit(lambda: task.model(nnx.Rngs(0)))()

    def both(model, batch):
        losses = (task.loss_fn, gpt.loss_fn)
        return [nnx.value_and_grad(f, has_aux=True)(model, batch) for f in losses]

    (chunked, chunked_grads), (plain, plain_grads) = nnx.jit(both)(model, batch())
    (loss, aux), (ref_loss, ref_aux) = chunked, plain
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    np.testing.assert_array_equal(aux["accuracy"], ref_aux["accuracy"])
    got, want = flat(nnx.to_pure_dict(chunked_grads)), flat(nnx.to_pure_dict(plain_grads))
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_chunked_loss_off_and_bad_values():
    config = default.get_config()
    # -1, the shipped default: the character vocabulary x 256 positions is small: plain
    assert tasks.build_task(config).loss_fn is gpt.loss_fn
    config.gpt.chunked_loss = -2
    with pytest.raises(tasks.ConfigError, match=r"config.gpt.chunked_loss=-2: .*>= -1"):
        tasks.build_task(config)


def test_the_default_chunks_the_loss_from_a_vocabulary_x_positions_size():
    """-1 (the default) chunks where vocabulary x positions >= tasks.CHUNKED_FROM."""
    config = default.get_config()
    assert config.gpt.chunked_loss == -1
    config.gpt.vocab_size = tasks.CHUNKED_FROM // config.gpt.seq_len
    task = tasks.build_task(config)
    assert task.loss_fn.func is gpt.chunked_loss_fn
    assert task.loss_fn.keywords == {"chunk_size": tasks.AUTO_CHUNK}
    config.gpt.vocab_size -= 8
    assert tasks.build_task(config).loss_fn is gpt.loss_fn


def test_the_chunked_loss_names_what_a_model_without_a_head_lacks():
    """``chunked_loss_fn`` reads ``features`` and ``head``; a model without them (the MLP) is
    refused with both names and the fix, not an AttributeError from inside the trace."""
    from nnx_spmd_trainer.app.models import MLP

    with nnx.use_eager_sharding(False):
        model = MLP(4, 8, 2, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"model\.features.*model\.head.*MLP lacks them.*loss_fn"):
        gpt.chunked_loss_fn(model, batch(), chunk_size=3)
