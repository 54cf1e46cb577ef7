"""Post-training: trainers that start from a trained model, written against the
``Trainer``'s public API, as a researcher's subclass would be.

- ``dpo.py``: ``DPOTrainer``, preference pairs with the DPO (sigmoid) or IPO loss.
- ``dpo_loss.py``: the losses and TRL's metrics, pure over log-probabilities.
- ``reference.py``: ``ReferenceModel``, the frozen starting model laid out as the policy.
- ``preference_data.py``: ``{"prompt", "chosen", "rejected"}`` rows to a batch of pairs.
- ``grpo.py``: ``GRPOTrainer``, rollouts sampled on the training mesh, rewarded, learned from.
- ``grpo_loss.py``: the clipped GRPO objective and the k3 KL, pure over log-probabilities.
- ``rewards.py``: a reward function (``module:function``), its answers checked, group advantages.
- ``rollout.py``: prompt rows (JSONL), batches of prompt indices, a rollout as a training batch.
"""

from nnx_spmd_trainer.post_training.dpo import DPOMetrics, DPOTrainer
from nnx_spmd_trainer.post_training.dpo_loss import LOSS_TYPES, dpo_loss, sequence_logps
from nnx_spmd_trainer.post_training.grpo import GRPOMetrics, GRPOTrainer, rollout_seed
from nnx_spmd_trainer.post_training.grpo_loss import grpo_loss, token_logps
from nnx_spmd_trainer.post_training.preference_data import (
    EncodedPair,
    PreferenceError,
    PreferenceRows,
    WeightedTokens,
    encode_chat_pair,
    encode_text_pair,
    is_chat_row,
    pair_batch,
    preference_batches,
    read_preferences,
)
from nnx_spmd_trainer.post_training.reference import ReferenceModel, base_is_reference
from nnx_spmd_trainer.post_training.rewards import (
    RewardError,
    RewardFn,
    group_advantages,
    load_reward,
    score,
)
from nnx_spmd_trainer.post_training.rollout import (
    PromptRows,
    encode_prompt,
    prompt_batches,
    read_prompts,
    rollout_batch,
)

__all__ = [
    "LOSS_TYPES",
    "DPOMetrics",
    "DPOTrainer",
    "EncodedPair",
    "GRPOMetrics",
    "GRPOTrainer",
    "PreferenceError",
    "PreferenceRows",
    "PromptRows",
    "ReferenceModel",
    "RewardError",
    "RewardFn",
    "WeightedTokens",
    "base_is_reference",
    "dpo_loss",
    "encode_chat_pair",
    "encode_prompt",
    "encode_text_pair",
    "group_advantages",
    "grpo_loss",
    "is_chat_row",
    "load_reward",
    "pair_batch",
    "preference_batches",
    "prompt_batches",
    "read_preferences",
    "read_prompts",
    "rollout_batch",
    "rollout_seed",
    "score",
    "sequence_logps",
    "token_logps",
]
