"""A zoo model samples as authored: jax-ml/bonsai's Qwen3 (vendored, Apache-2.0), which
carries its cache as an argument and is written for JAX's explicit sharding mode, decodes
greedily through the library's ``Sampler`` under FSDP x TP; its tokens and
log-probabilities equal its own teacher-forced forward pass on one device."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from vendored.bonsai_qwen3 import modeling

from nnx_spmd_trainer import FSDP, Hybrid, Sampler, TensorParallel, Trainer

CONFIG = modeling.ModelConfig(
    num_layers=2, vocab_size=64, emb_dim=32, mlp_dim=64, num_heads=8, head_dim=8,
    num_kv_heads=4, rope_theta=10_000, rope_scaling_factor=1, local_rope_theta=1e4,
    norm_eps=1e-6, tie_word_embeddings=False,
    # bonsai's own layout: its ShardConfig names the mesh axes "fsdp" and "tp".
    shd_cfg=modeling.ShardConfig.default(use_fsdp=True, use_tp=True),
)  # fmt: skip
# Full prompt blocks (16 tokens: the sampler's column bucket): bonsai's Qwen3 counts a
# decode step's rotary position from its cache index, so a left-padded row would decode
# at positions shifted by its padding (its own code; a model that takes positions, as the
# shipped GPT, has no such limit).
PROMPTS = [[(7 * r + 3 * c) % 64 for c in range(16)] for r in range(4)]
NEW = 6


@pytest.fixture(scope="module")
def sampled() -> tuple[Trainer, list[list[int]], list[list[float]]]:
    strategy = Hybrid(FSDP(4), TensorParallel(2, axis="tp"), axis_types="explicit")
    trainer = Trainer(
        lambda rngs: modeling.Qwen3(CONFIG, rngs=rngs), optax.sgd(0.1), strategy=strategy,
        loss_fn=lambda m, b: (0.0, {}),
    )  # fmt: skip
    sampler = Sampler(
        trainer.model, trainer.plan, init_cache=functools.partial(modeling.init_cache, CONFIG)
    )
    out = sampler.generate(PROMPTS, max_new_tokens=NEW)
    assert out.finish == ["length"] * len(PROMPTS)
    return trainer, out.tokens, out.log_probs


def teacher_forced(trainer: Trainer, rows: list[list[int]]) -> list[np.ndarray]:
    """bonsai's own forward pass over each whole row (prompt + generated) at once, on one
    device with no mesh, the trained weights copied: float32 log-probabilities."""
    plain = dataclasses.replace(CONFIG, shd_cfg=modeling.ShardConfig.no_sharding())
    with jax.default_device(jax.devices()[0]):
        model = modeling.Qwen3(plain, rngs=nnx.Rngs(0))
        trained = nnx.state(trainer.model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), trained))

        @jax.jit
        def forward(tokens: jax.Array) -> jax.Array:
            cache = modeling.init_cache(plain, 1, tokens.shape[1], 0, jnp.float32)
            logits = model(tokens, cache=cache, segment_ids=jnp.ones_like(tokens))
            return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

        return [np.asarray(forward(jnp.asarray([row], jnp.int32)))[0] for row in rows]


def test_bonsai_qwen3_samples_as_its_own_forward_pass_under_fsdp_x_tp(sampled) -> None:
    trainer, tokens, log_probs = sampled
    mesh = trainer.plan.mesh
    assert dict(mesh.shape) == {"fsdp": 4, "tp": 2}
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}
    full = [p + t for p, t in zip(PROMPTS, tokens, strict=True)]
    for prompt, new, got, forced in zip(
        PROMPTS, tokens, log_probs, teacher_forced(trainer, full), strict=True
    ):
        assert len(new) == NEW
        chose = forced[len(prompt) - 1 : len(prompt) + NEW - 1]  # the positions that chose
        assert new == chose.argmax(-1).tolist()  # greedy: the forward pass's argmax
        np.testing.assert_allclose(got, chose[np.arange(NEW), new], atol=1e-5, rtol=0)


def test_the_cache_is_the_models_own_and_laid_out_as_it_says(sampled) -> None:
    trainer, _, _ = sampled
    sampler = Sampler(
        trainer.model, trainer.plan, init_cache=functools.partial(modeling.init_cache, CONFIG),
        print_fn=None,
    )  # fmt: skip
    rows, _, length = sampler.bucket(PROMPTS, NEW)
    # Per layer: keys and values of [rows 4/4, 32 positions, 4 heads/2, 8], float32; the
    # rows' start indices (one per row of this device's) and the write index.
    per_layer = 2 * (1 * 32 * 2 * 8 * 4) + 1 * 4 + 4
    assert (rows, length) == (4, 32)
    assert sampler.cache_bytes(PROMPTS, max_new_tokens=NEW) == CONFIG.num_layers * per_layer
