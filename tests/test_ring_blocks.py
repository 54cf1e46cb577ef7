"""How ring attention computes its blocks: cuDNN's fused kernel where it runs, einsums elsewhere.

The merge of fused blocks by their log-sum-exps is checked here on the CPU with
``jax.nn.dot_product_attention``'s XLA blocks (``blocks="xla"``), against a NumPy
reference on one device, packed rows included; the cuDNN kernel itself only where a
GPU is (skipped here).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_sequence_parallel import gpt_loss, tiny_gpt, token_batches

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, Plan, SequenceParallel
from nnx_spmd_trainer.adapters import jax_private
from nnx_spmd_trainer.nn.ring_attention import ring_attention
from nnx_spmd_trainer.nn.ring_blocks import block_implementation

SEQ = 16
# Row 0: one document; row 1: three documents and padding (0) at the end.
SEGMENTS = np.array([[1] * SEQ, [1] * 5 + [2] * 7 + [3] * 2 + [0] * 2], np.int32)
on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN needs a GPU")


def reference(q, k, v, segments):
    """Causal attention within segments, in float64 NumPy (padding attends to padding)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    keep = np.tril(np.ones((SEQ, SEQ), bool)) & (
        segments[:, None, :, None] == segments[:, None, None, :]
    )
    weights = np.exp(np.where(keep, scores, -np.inf) - scores.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", weights / weights.sum(-1, keepdims=True), v)


def qkv(dtype=np.float32):
    rng = np.random.default_rng(0)
    return [rng.normal(size=(2, SEQ, 2, 8)).astype(dtype) for _ in range(3)]


def test_the_einsum_blocks_are_chosen_on_this_cpu_and_cudnn_by_its_rule():
    if jax.default_backend() == "cpu":
        assert block_implementation(jnp.bfloat16, 64, 512) == "einsum"
    # The rule itself, for a GPU: half precision, a head dim cuDNN takes, even blocks.
    assert jax_private.cudnn_attention() is not None  # this JAX still offers the kernel
    assert block_implementation(jnp.bfloat16, 64, 512, backend="gpu") == "cudnn"
    assert block_implementation(jnp.float16, 128, 2, backend="gpu") == "cudnn"
    for dtype, head_dim, block in [
        (jnp.float32, 64, 512),  # cuDNN refuses fp32
        (jnp.bfloat16, 12, 512),  # not a multiple of 8
        (jnp.bfloat16, 256, 512),  # past the flash kernel's limit before Hopper
        (jnp.bfloat16, 64, 7),  # an odd block with a bias: refused in training
    ]:
        assert block_implementation(dtype, head_dim, block, backend="gpu") == "einsum"


def test_a_wrong_block_name_is_refused():
    mesh = SequenceParallel(8).make_mesh()
    q = jnp.ones((1, SEQ, 1, 8))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"blocks='cuda'.*'einsum'"):
        ring_attention(q, q, q, "seq", blocks="cuda")


@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_fused_blocks_merged_by_their_lse_equal_one_device(packed):
    strategy = Hybrid(DataParallel(2), SequenceParallel(4))
    mesh = strategy.make_mesh()
    q, k, v = qkv()
    segments = SEGMENTS if packed else np.ones_like(SEGMENTS)
    given = SEGMENTS if packed else None

    def attend(blocks):
        return lambda q, k, v: ring_attention(q, k, v, "seq", segment_ids=given, blocks=blocks)

    def loss(f):
        return lambda q, k, v: (f(q, k, v) * np.cos(np.arange(8))).sum()

    split = NamedSharding(mesh, P("data", "seq"))
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, split) for x in (q, k, v)]
        fused = jax.jit(attend("xla"))(*args)
        grads = {b: jax.jit(jax.grad(loss(attend(b)), (0, 1, 2)))(*args) for b in ("xla", "einsum")}
    np.testing.assert_allclose(np.asarray(fused), reference(q, k, v, segments), atol=1e-5)
    assert np.isfinite(np.asarray(fused)).all()
    # The backward ring runs einsum blocks from the fused forward's log-sum-exp.
    for got, want in zip(grads["xla"], grads["einsum"], strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_the_plan_report_says_how_the_ring_blocks_ran():
    strategy = Hybrid(FSDP(2), SequenceParallel(4, attention="ring"))
    plan = Plan(tiny_gpt, optax.sgd(0.5), strategy=strategy, loss_fn=gpt_loss)
    (line,) = [s for s in str(plan.report(token_batches(1)[0])).splitlines() if "sequence:" in s]
    # The tiny GPT computes in fp32, which cuDNN refuses: einsum blocks on every backend.
    assert re.search(r"attention ring .*collective-permute x\d+; blocks einsum", line), line


@on_gpu
def test_cudnn_blocks_on_a_gpu_match_the_einsum_blocks():
    mesh = SequenceParallel(len(jax.devices())).make_mesh()
    seq = 256 * len(jax.devices())
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, seq, 4, 64)), jnp.bfloat16) for _ in range(3))
    segments = np.repeat([[1, 2]], seq // 2, axis=1).astype(np.int32)
    assert block_implementation(q.dtype, 64, seq // (2 * len(jax.devices()))) == "cudnn"
    with jax.set_mesh(mesh):
        for given in (None, segments):

            def attend(blocks, given=given):
                return jax.jit(
                    lambda q, k, v: ring_attention(q, k, v, "seq", segment_ids=given, blocks=blocks)
                )

            text = attend(None).lower(q, k, v).compile().as_text()
            assert jax_private.CUDNN_ATTENTION_TARGET in text
            got, want = attend(None)(q, k, v), attend("einsum")(q, k, v)
            np.testing.assert_allclose(
                np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2
            )
