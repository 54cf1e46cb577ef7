"""The shipped GPU configs gpt2_medium and gpt2_large: planned and lowered from shapes alone
(no array is built, nothing compiled), with GPT-2's parameter counts."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from nnx_spmd_trainer import Plan
from nnx_spmd_trainer.app import tasks
from nnx_spmd_trainer.configs import gpt2_large, gpt2_medium


def expected_parameters(layers: int, width: int, ff: int, vocab: int, seq: int) -> int:
    """Counted by hand from the architecture (gpt.TransformerBlock and GPT)."""
    attention = 4 * width * width + 4 * width  # query, key, value, out: kernels and biases
    mlp = 2 * width * ff + ff + width
    norms = 2 * 2 * width
    embeddings = vocab * width + seq * width
    head = width * vocab + vocab
    return layers * (attention + mlp + norms) + embeddings + 2 * width + head


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "gpt2_count"),
    [(gpt2_medium, 350e6), (gpt2_large, 774e6)],
    ids=["gpt2_medium", "gpt2_large"],
)
def test_gpu_configs_plan_and_lower_with_gpt2_parameter_counts(module, gpt2_count):
    config = module.get_config()
    sizes = config.gpt
    assert (sizes.scan_layers, sizes.chunked_loss > 0) == (True, True)
    assert config.compute_dtype == "bfloat16"
    task = tasks.build_task(config)  # the CLI's own path: config -> gpt_task
    spec, _ = tasks.fit_to_devices(config.strategy, len(jax.devices()))
    plan = Plan(
        task.model,
        tasks.make_optimizer(config),
        strategy=tasks.parse_strategy(spec),
        loss_fn=task.loss_fn,
    )
    params = jax.tree.leaves(nnx.state(plan.abstract_state["model"], nnx.Param))
    count = sum(p.size for p in params)
    assert count == expected_parameters(
        sizes.num_layers, sizes.embed_dim, sizes.ff_dim, sizes.vocab_size, sizes.seq_len
    )
    # GPT-2 ties the head to the token embedding and counts it once: so do we here.
    head = sizes.embed_dim * sizes.vocab_size + sizes.vocab_size
    assert count - head == pytest.approx(gpt2_count, rel=0.05)
    assert {p.dtype for p in params} == {jnp.dtype(jnp.float32)}  # bf16 compute only
    # Stacked: every block parameter has the layer dimension first.
    blocks = nnx.state(plan.abstract_state["model"]["blocks"], nnx.Param)
    assert {p.shape[0] for p in jax.tree.leaves(blocks)} == {sizes.num_layers}

    batch = {
        key: jax.ShapeDtypeStruct((config.batch_size, sizes.seq_len), jnp.int32)
        for key in ("inputs", "targets")
    }
    text = plan.lower(batch).as_text()
    # The blocks and the chunked loss are loops, not 24/36 copies of a block.
    assert text.count("stablehlo.while") >= 2
    assert "bf16" in text
