"""The GRPO run test_grpo_multiprocess compares: made by the test process itself (1
process, 8 devices) and by ``grpo_mp_worker.py`` (2 processes, 4 devices each) alike,
each process feeding its rows of the same global batches of prompt indices."""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

from nnx_spmd_trainer import Callback
from nnx_spmd_trainer.app.models import gpt
from nnx_spmd_trainer.data.to_host import gather_to_host
from nnx_spmd_trainer.post_training.grpo import GRPOTrainer
from nnx_spmd_trainer.post_training.rollout import PromptRows, prompt_batches

VOCAB, SEQ, TARGET, GROUP, NEW, PROMPTS, ROLLOUTS, MU = 16, 16, 3, 2, 4, 8, 2, 2
ROWS = PromptRows.of(
    [
        {"prompt": [int(t) for t in np.random.default_rng(i).integers(1, VOCAB, 2 + i % 3)]}
        for i in range(16)
    ]
)
BATCHES = prompt_batches(len(ROWS), PROMPTS, ROLLOUTS)


def make_model(rngs: nnx.Rngs) -> gpt.GPT:
    return gpt.GPT(VOCAB, SEQ, 32, 2, 32, 1, 0.0, rngs)


#: How many completions each call of the reward function was given, in this process.
REWARD_CALLS: list[int] = []


def target_share(prompts, completions, **fields):
    REWARD_CALLS.append(len(completions))
    return [float(np.mean([t == TARGET for t in c])) for c in completions]


class Recorded(GRPOTrainer):
    """Keeps each rollout's placed batch, gathered whole (a collective: every process)."""

    def prepare_batch(self, batch):
        placed = super().prepare_batch(batch)
        kept = {k: placed[k] for k in ("inputs", "weights", "rewards", "advantages")}
        self.rollouts = [*getattr(self, "rollouts", []), gather_to_host(kept)]
        return placed


class Record(Callback):
    """Each step's loss."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, step, logs):
        self.losses.append(self.step_record.loss_value())


def local_rows(batch: dict, index: int, count: int) -> dict:
    """This process's prompts, ``rows[index::count]`` as ``DataShard`` says (and the CLI
    feeds): the placed global batch interleaves the processes' rows, a permutation of
    the batch one process feeds."""
    return {"row": batch["row"][index::count]}


def train(beta: float = 0.04) -> dict[str, np.ndarray]:
    """ROLLOUTS rollouts of MU SGD updates each (the KL term on): what happened, as host
    arrays (every process's the same, but ``reward_calls``: its own)."""
    REWARD_CALLS.clear()
    record = Record()
    trainer = Recorded(
        make_model, optax.sgd(0.5), prompts=ROWS, reward_fn=target_share, group_size=GROUP,
        max_new_tokens=NEW, beta=beta, num_iterations=MU, log_every_n_steps=MU,
        callbacks=[record],
    )  # fmt: skip
    shard = trainer.placement.data_shard
    trainer.fit([local_rows(b, *shard) for b in BATCHES], max_steps=MU * ROLLOUTS)
    params = multihost_utils.process_allgather(nnx.state(trainer.model, nnx.Param), tiled=True)
    flat = {
        "params/" + "/".join(map(str, p)): np.asarray(leaf)
        for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    history = trainer.history.history
    rollouts = {
        f"rollout/{i}/{k}": v
        for i, rollout in enumerate(trainer.rollouts)
        for k, v in rollout.items()
    }
    return {
        **flat,
        **rollouts,
        "losses": np.asarray(record.losses),
        "reward": np.asarray(history["train/reward"]),
        "kl": np.asarray(history["train/kl"]),
        "reward_calls": np.asarray(REWARD_CALLS),
    }
