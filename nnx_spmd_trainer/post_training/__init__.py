"""Post-training: trainers that start from a trained model, written against the
``Trainer``'s public API, as a researcher's subclass would be.

- ``dpo``: ``DPOTrainer``, preference pairs with the DPO (sigmoid) or IPO loss.
- ``dpo_loss``: the losses and TRL's metrics, pure over log-probabilities.
- ``reference``: ``ReferenceModel``, the frozen starting model laid out as the policy.
- ``preference_data``: ``{"prompt", "chosen", "rejected"}`` rows to a batch of pairs.
"""

from nnx_spmd_trainer.post_training.dpo import DPOMetrics, DPOTrainer
from nnx_spmd_trainer.post_training.dpo_loss import LOSS_TYPES, dpo_loss, sequence_logps
from nnx_spmd_trainer.post_training.preference_data import (
    EncodedPair,
    PreferenceError,
    PreferenceRows,
    WeightedTokens,
    encode_text_pair,
    pair_batch,
    preference_batches,
    read_preferences,
)
from nnx_spmd_trainer.post_training.reference import ReferenceModel

__all__ = [
    "LOSS_TYPES",
    "DPOMetrics",
    "DPOTrainer",
    "EncodedPair",
    "PreferenceError",
    "PreferenceRows",
    "ReferenceModel",
    "WeightedTokens",
    "dpo_loss",
    "encode_text_pair",
    "pair_batch",
    "preference_batches",
    "read_preferences",
    "sequence_logps",
]
