"""On a machine with a GPU: a bf16 step, cuDNN attention, the default job on one GPU.

Skipped where there is none. Each check runs in a process of its own with the
GPU as JAX's platform (the test processes themselves are pinned to the CPU by
``conftest.py``).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

HAS_GPU = bool(glob.glob("/dev/nvidia[0-9]*")) and any(
    importlib.util.find_spec(name) is not None
    for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins")
)
pytestmark = pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine")


def on_gpu(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    # One GPU, allocated as needed: test processes run side by side under pytest -n.
    env.update(
        JAX_PLATFORMS="cuda", CUDA_VISIBLE_DEVICES="0", XLA_PYTHON_CLIENT_PREALLOCATE="false"
    )
    command = [sys.executable, "-c", textwrap.dedent(code), *args] if code else list(args)
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


GPT = """
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
from nnx_spmd_trainer import DataParallel, Trainer
from nnx_spmd_trainer.app.models import GPT, gpt

def build(dtype):
    return lambda rngs: GPT(vocab_size=64, seq_len=128, embed_dim=128, num_heads=4, ff_dim=256,
                            num_layers=2, dropout_rate=0.0, rngs=rngs, dtype=dtype)

rng = np.random.default_rng(0)
tokens = rng.integers(0, 64, (5, 8, 129)).astype(np.int32)
batches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]
"""


def test_a_bf16_step_keeps_fp32_weights_and_tracks_the_fp32_loss():
    proc = on_gpu(
        GPT
        + """
losses = {}
for dtype in (jnp.float32, jnp.bfloat16):
    trainer = Trainer(build(dtype), optax.adamw(1e-3), strategy=DataParallel(),
                      loss_fn=gpt.loss_fn, devices=jax.devices()[:1])
    history = trainer.fit(batches, max_steps=5)
    kernel = trainer.model.blocks[0].linear1.kernel.get_value()
    assert kernel.dtype == jnp.float32, kernel.dtype   # master weights
    losses[str(jnp.dtype(dtype))] = history.history["train/loss"][-1]
print(losses)
assert np.isfinite(losses["bfloat16"])
assert abs(losses["bfloat16"] - losses["float32"]) < 0.05, losses
"""
    )
    assert "bfloat16" in proc.stdout


def test_attention_runs_cudnn_in_bf16_and_agrees_with_xla():
    on_gpu(
        GPT
        + """
q, k, v = (jax.random.normal(jax.random.key(i), (2, 128, 4, 32), jnp.bfloat16) for i in range(3))
assert gpt.attention_implementation(jnp.bfloat16) == "cudnn"
assert gpt.attention_implementation(jnp.float32) == "xla"
fused = jax.jit(gpt.causal_attention)
assert "cudnn" in fused.lower(q, k, v).compile().as_text().lower()
reference = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                         is_causal=True, implementation="xla")
error = float(jnp.abs(fused(q, k, v).astype(jnp.float32) - reference).max())
assert error < 3e-2, error
"""
    )


def test_the_default_job_runs_on_one_gpu(tmp_path):
    proc = on_gpu(
        "",
        sys.executable, "-m", "nnx_spmd_trainer", f"--workdir={tmp_path}",
        "--config.max_steps=3", "--config.max_eval_batches=1",
    )  # fmt: skip
    assert "model=2 does not fit 1 device" in proc.stdout
    assert "final after 3 steps" in proc.stdout
