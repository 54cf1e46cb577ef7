"""PipelineParallel with 2 JAX processes x 4 simulated devices, the stages spanning the
processes (process 0 holds stages 0-1, process 1 stages 2-3; a data axis inside each):
the scanned GPT trained through ``Trainer.fit`` gives one device's per-step losses (1e-5)
and parameters (1e-4), plain optax; both processes feed the same (all) rows."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from mp_runs import PIPELINE_STRATEGIES, STEPS, launched, tiny_gpt_layers, token_batches
from toy_models import train_reference

from nnx_spmd_trainer.app.models import gpt

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # make test runs these alone


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[str, np.ndarray]:
    return launched(tmp_path_factory.mktemp("mp-pipeline"), "--pipeline", *PIPELINE_STRATEGIES)


@pytest.fixture(scope="module")
def one_device() -> tuple[dict[str, np.ndarray], list[float]]:
    params, losses = train_reference(
        tiny_gpt_layers, optax.sgd(0.5), token_batches(STEPS), loss_fn=gpt.loss_fn
    )
    # The scanned model's parameter state holding them, named as mp_runs.gathered names.
    with nnx.use_eager_sharding(False):
        scanned = nnx.eval_shape(lambda: tiny_gpt_layers(nnx.Rngs(0), scan_layers=True))
    state = nnx.state(scanned, nnx.Param)
    nnx.replace_by_pure_dict(state, gpt.stack_blocks(nnx.to_pure_dict(params)))
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return {"/".join(map(str, path)): np.asarray(leaf) for path, leaf in flat}, losses


@pytest.mark.parametrize("name", list(PIPELINE_STRATEGIES))
def test_stages_over_two_processes_train_the_gpt_like_one_device(two_processes, one_device, name):
    ref_params, ref_losses = one_device
    np.testing.assert_allclose(two_processes[f"{name}/losses"], ref_losses, rtol=1e-5, atol=1e-5)
    prefix = f"{name}/params/"
    got = {k.removeprefix(prefix): v for k, v in two_processes.items() if k.startswith(prefix)}
    assert got.keys() == ref_params.keys()
    for key, want in ref_params.items():
        np.testing.assert_allclose(got[key], want, rtol=1e-4, atol=1e-5, err_msg=key)
    assert int(two_processes[f"{name}/shard"][1]) == 1  # both processes feed every row
