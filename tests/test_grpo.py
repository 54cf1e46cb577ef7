"""GRPOTrainer: the ratio at each rollout's first update is exactly 1, two updates of one
rollout equal a one-device plain-JAX computation of the GRPO formula (the k3 KL to the
starting model included), the mean reward of a toy task rises, a stopped run resumes to
the same rewards and weights, and bad inputs are refused in one line."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnx_spmd_trainer import Callback
from nnx_spmd_trainer.app.models import gpt
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint
from nnx_spmd_trainer.data.to_host import gather_to_host
from nnx_spmd_trainer.data_shard import DataShard
from nnx_spmd_trainer.post_training.grpo import GRPOTrainer
from nnx_spmd_trainer.post_training.rewards import (
    RewardError,
    group_advantages,
    load_reward,
    score,
)
from nnx_spmd_trainer.post_training.rollout import (
    PromptRows,
    process_rows,
    prompt_batches,
    sampler_ranks,
)

# The toy task: a reward of the share of completion tokens equal to TARGET.
VOCAB, SEQ, TARGET, GROUP, NEW, PROMPTS, LR, BETA, EPS, MU = 16, 16, 3, 4, 4, 8, 0.5, 0.04, 0.2, 2
ROLLOUTS = 4  # rollouts of the learning run: 8 updates
KL_ROLLOUTS = 3  # of the run with the KL term


def make_model(rngs: nnx.Rngs) -> gpt.GPT:
    return gpt.GPT(VOCAB, SEQ, 32, 2, 64, 1, 0.0, rngs)


def target_share(prompts, completions, **fields):
    assert fields["tag"] == ["t"] * len(completions)  # the rows' fields, one per completion
    return [float(np.mean([t == TARGET for t in c])) for c in completions]


ROWS = PromptRows.of(
    [
        {"prompt": list(np.random.default_rng(i).integers(1, VOCAB, 3)), "tag": "t"}
        for i in range(16)
    ]
)
BATCHES = prompt_batches(len(ROWS), PROMPTS, ROLLOUTS)


class Record(Callback):
    """The parameters after each step and each rollout's host batch."""

    def __init__(self) -> None:
        self.params: list[dict] = []

    def on_train_batch_end(self, step, logs):
        self.params.append(
            jax.device_get(nnx.to_pure_dict(nnx.state(self.trainer.model, nnx.Param)))
        )


class Rollouts(GRPOTrainer):
    """Keeps each rollout's host batch, for the plain computation."""

    def rollout(self, rows):
        batch = super().rollout(rows)
        self.rollouts = [*getattr(self, "rollouts", []), batch]
        return batch


def trainer_for(callbacks=(), beta=BETA, **options) -> Rollouts:
    return Rollouts(
        make_model,
        optax.sgd(LR),
        prompts=ROWS,
        reward_fn=target_share,
        group_size=GROUP,
        max_new_tokens=NEW,
        beta=beta,
        epsilon=EPS,
        num_iterations=MU,
        log_every_n_steps=MU,
        callbacks=callbacks,
        **options,
    )


@pytest.fixture(scope="module")
def run():
    """Without the KL term: the toy task learned (a KL to the random start slows it)."""
    trainer = trainer_for(beta=0.0)
    trainer.fit(BATCHES, max_steps=MU * ROLLOUTS)
    return trainer


@pytest.fixture(scope="module")
def kl_run():
    """With the KL term, KL_ROLLOUTS rollouts: the exactness and the resume."""
    record = Record()
    trainer = trainer_for([record])
    initial = jax.device_get(nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))
    trainer.fit(BATCHES, max_steps=MU * KL_ROLLOUTS)
    return trainer, record, initial


@pytest.mark.parametrize("which", ["run", "kl_run"])
def test_the_ratio_at_each_first_update_is_exactly_one(which, request):
    trainer = request.getfixturevalue(which)
    trainer = trainer[0] if isinstance(trainer, tuple) else trainer
    deviations = trainer.history.history["train/ratio_deviation"]
    print("max |ratio - 1| at each rollout's first update:", deviations)
    assert len(deviations) == len(trainer.rollouts) and max(deviations) == 0.0
    # The sampler's own log-probabilities (decoded with its cache) agree within float noise.
    assert max(trainer.history.history["train/sampler_gap"]) < 1e-4


def test_the_mean_reward_rises(run):
    """From about 1/16 (a random token) to >= 0.45 more within 4 rollouts (8 SGD updates;
    measured: 0.039, 0.055, 0.562, 0.992)."""
    trainer = run
    reward = trainer.history.history["train/reward"]
    assert reward[0] < 0.2 and reward[-1] >= reward[0] + 0.45, reward


def test_the_goodput_splits_rollout_reference_and_step(run, kl_run):
    assert "goodput/reference_s" not in run.run.timings.goodput()  # beta=0: no reference
    trainer, _, _ = kl_run
    goodput = trainer.run.timings.goodput()
    assert goodput["goodput/rollout_s"] > 0 and goodput["goodput/reference_s"] > 0
    assert goodput["goodput/step_s"] > 0


def plain_logps(params, graphdef, rest, batch):
    logits = nnx.merge(graphdef, params, rest)(jnp.asarray(batch["inputs"]))
    lp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(lp, jnp.asarray(batch["targets"])[..., None], axis=-1)[..., 0]


def plain_grpo(params, old, ref, graphdef, rest, batch):
    """The GRPO formula, token mean, on one device."""
    logp = plain_logps(params, graphdef, rest, batch)
    w = jnp.asarray(batch["weights"])
    a = jnp.asarray(batch["advantages"])[:, None]
    ratio = jnp.exp(logp - old)
    surrogate = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - EPS, 1 + EPS) * a)
    kl = jnp.exp(ref - logp) - (ref - logp) - 1
    return jnp.sum((-surrogate + BETA * kl) * w) / jnp.sum(w)


def test_two_updates_of_a_rollout_equal_a_plain_jax_computation(kl_run):
    trainer, record, initial = kl_run
    batch = trainer.rollouts[0]
    np.testing.assert_allclose(
        batch["advantages"], group_advantages(batch["rewards"], GROUP), rtol=0, atol=0
    )
    with nnx.use_eager_sharding(False):
        model = make_model(nnx.Rngs(1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    nnx.replace_by_pure_dict(params, initial)  # the trainer's starting weights, on one device
    ref = plain_logps(params, graphdef, rest, batch)  # the reference: the starting weights
    old = ref
    losses = []
    grad_fn = jax.jit(jax.value_and_grad(plain_grpo), static_argnums=3)
    batch = {k: batch[k] for k in ("inputs", "targets", "weights", "advantages")}
    for _ in range(MU):
        loss, grads = grad_fn(params, old, ref, graphdef, rest, batch)
        params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
        losses.append(float(loss))
    np.testing.assert_allclose(trainer.history.history["train/loss"][0], losses[0], atol=1e-5)
    got = jax.tree.leaves(record.params[0])
    want = jax.tree.leaves(nnx.to_pure_dict(params))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_a_stopped_run_resumes_to_the_same_rewards_and_weights(kl_run, tmp_path):
    whole, record, _ = kl_run

    class Crash(Callback):
        def on_train_batch_end(self, step, logs):
            if step == MU * 2:
                raise RuntimeError("simulated crash")

    crashed = trainer_for([OrbaxCheckpoint(tmp_path, save_every_n_steps=MU), Crash()])
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit(BATCHES, max_steps=MU * KL_ROLLOUTS)
    checkpoint = OrbaxCheckpoint(tmp_path, save_every_n_steps=MU)
    resumed = trainer_for([checkpoint])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "Resuming epoch", UserWarning)  # no batch re-read
        resumed.fit(BATCHES, max_steps=MU * KL_ROLLOUTS)
    # The crash comes before step 2 * MU is saved: the run resumes from the first rollout's,
    # seeking the prompt batches (the rollout stage's position) without sampling the first.
    assert checkpoint.restored_step == MU and resumed.step == MU * KL_ROLLOUTS
    assert len(resumed.rollouts) == KL_ROLLOUTS - 1
    for got, want in zip(resumed.rollouts, whole.rollouts[1:], strict=True):
        np.testing.assert_array_equal(got["rewards"], want["rewards"])
        np.testing.assert_array_equal(got["inputs"], want["inputs"])
    final = jax.device_get(nnx.to_pure_dict(nnx.state(resumed.model, nnx.Param)))
    for g, w in zip(jax.tree.leaves(final), jax.tree.leaves(record.params[-1]), strict=True):
        np.testing.assert_array_equal(g, w)


# -- bad input ------------------------------------------------------------------------------
def test_a_group_of_one_is_refused():
    with pytest.raises(ValueError, match=r"group_size=1: .* needs >= 2"):
        GRPOTrainer(
            make_model, optax.sgd(LR), prompts=ROWS, reward_fn=target_share, group_size=1,
            max_new_tokens=NEW,
        )  # fmt: skip


def test_a_reward_of_the_wrong_shape_is_refused_saying_what_it_returned():
    def two_per(prompts, completions):
        return [[1.0, 2.0]] * len(completions)

    with pytest.raises(RewardError) as error:
        score(two_per, ["a"] * 3, ["b"] * 3, {})
    message = str(error.value)
    assert "returned list of shape (3, 2)" in message and "expected a sequence of 3" in message
    assert "\n" not in message
    with pytest.raises(RewardError, match="returned NoneType"):
        score(lambda p, c: None, ["a"], ["b"], {})


def test_a_reward_that_cannot_be_imported_is_refused():
    with pytest.raises(RewardError, match="'no_such_module_xyz' cannot be imported"):
        load_reward("no_such_module_xyz:f")
    with pytest.raises(RewardError, match="has no function 'nope'"):
        load_reward("math:nope")
    with pytest.raises(RewardError, match="name it as module:function"):
        load_reward("math.fsum")
    assert load_reward("math:fsum") is __import__("math").fsum


def test_with_lora_the_reference_is_the_base_itself_with_no_copy():
    """LoRA adapters the only trained weights: the reference is the policy's own base with
    its adapters switched off. After two updates moved the adapters, its log-probabilities
    equal (1e-5) those of the same model built without LoRA, untrained, and differ from
    the adapted policy's; it holds no weights of its own."""
    from nnx_spmd_trainer import LoRA

    adapted = trainer_for(lora=LoRA(rank=4, alpha=8.0, targets=r".*mha/(query|value)"))
    adapted.fit(BATCHES[:1], max_steps=MU)
    assert adapted.reference.adapters_off and adapted.reference.bytes_per_device() == 0
    plain = trainer_for()  # the same seed: the same base weights, no adapters
    base = nnx.to_pure_dict(nnx.state(plain.model, nnx.Param))
    adapted_base = nnx.to_pure_dict(
        nnx.state(adapted.model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    )
    for leaf, expected in zip(jax.tree.leaves(adapted_base), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(expected))  # never trained
    host = adapted.rollouts[0]
    with jax.set_mesh(adapted.mesh):
        reference = np.asarray(adapted.reference_logps(adapted.placement.place(host)))
    one_device = {k: jnp.asarray(v) for k, v in host.items()}
    untrained = np.asarray(plain.policy_logps(plain.model, one_device))
    policy = np.asarray(adapted.policy_logps(adapted.model, one_device))
    weights = host["weights"] > 0
    np.testing.assert_allclose(reference[weights], untrained[weights], atol=1e-5)
    assert np.abs(policy[weights] - untrained[weights]).max() > 1e-4  # the adapters moved


# -- several processes, simulated in one (tests/test_grpo_multiprocess.py runs two) ----------
def test_a_rollout_samples_as_the_batch_in_prompt_order_and_keeps_its_process_rows(
    run, monkeypatch
):
    """A batch fed interleaved by two processes is a permutation of the one-process batch:
    the sampled rows follow the prompts' order, not the batch's, so each prompt gets the
    same completions; a process keeps (and scores) only the rows it feeds, whole groups."""
    rows = BATCHES[0]["row"]
    whole = run.rollout(rows)
    interleaved = np.concatenate([rows[0::2], rows[1::2]])  # what 2 processes' place makes
    halves = []
    for index in range(2):
        monkeypatch.setattr(run.placement, "data_shard", DataShard(index, 2))
        halves.append(run.rollout(interleaved))
        assert len(run.last_rewards) == PROMPTS // 2 * GROUP  # the reward saw its half

    # Each prompt's group of completions as one row: sort the groups, then compare.
    def groups(batch):
        inputs = batch["inputs"].reshape(-1, GROUP * batch["inputs"].shape[1])
        return inputs[np.lexsort(inputs.T[::-1])]

    two = {k: np.concatenate([h[k] for h in halves]) for k in whole}
    np.testing.assert_array_equal(groups(two), groups(whole))
    np.testing.assert_array_equal(np.sort(two["rewards"]), np.sort(whole["rewards"]))


def test_process_rows_and_sampler_ranks():
    assert process_rows(8, DataShard(0, 1)) == slice(0, 8)
    assert [process_rows(8, DataShard(i, 2)) for i in range(2)] == [slice(0, 4), slice(4, 8)]
    with pytest.raises(ValueError, match="6 prompts a batch do not split over 4 processes"):
        process_rows(6, DataShard(0, 4))
    rows = np.array([5, 1, 5, 0])
    ranks = sampler_ranks(rows)
    np.testing.assert_array_equal(np.sort(rows)[ranks], rows)
    assert ranks.tolist() == [2, 1, 3, 0]  # equal indices keep their order


def test_the_prompt_indices_are_read_whole_from_a_batch_split_over_the_devices(run):
    placed = run.placement.place(BATCHES[1])["row"]
    assert len(placed.addressable_shards) == 8 and placed.addressable_shards[0].data.shape == (1,)
    read = gather_to_host(placed)
    assert isinstance(read, np.ndarray)
    np.testing.assert_array_equal(read, BATCHES[1]["row"])
