"""``DPOTrainer``: Direct Preference Optimization as a ``Trainer`` subclass, written
against the Trainer's public API only (``loss_fn``, ``prepare_batch``,
``initial_state``, ``plan``).

Each batch holds pairs (``preference_data.pair_batch``). Before its step, the reference
model (``ReferenceModel``: the starting weights, frozen, laid out as the policy) gives
its log-probabilities of both completions in one compiled program, added to the batch;
the step's loss (``dpo_loss``) then differentiates the policy's alone. With LoRA
(``lora=LoRA(...)``, only the adapters trained) the reference is the policy's own base
with the adapters switched off (``nn.lora.adapters_off``): no second copy of the weights.
"""

# No ``from __future__ import annotations``: clu reads DPOMetrics' annotations as objects.
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from clu import metrics as clu_metrics
from flax import nnx, struct

from nnx_spmd_trainer.planner.auto import Choice
from nnx_spmd_trainer.post_training import dpo_loss
from nnx_spmd_trainer.post_training.reference import ReferenceModel, base_is_reference
from nnx_spmd_trainer.trainer import Trainer

#: ``(model, inputs) -> logits [rows, seq, vocab]``: how the policy is called on tokens.
LogitsFn = Callable[[nnx.Module, jax.Array], jax.Array]

_METRIC_NAMES = {
    "rewards_chosen": "rewards/chosen",
    "rewards_rejected": "rewards/rejected",
    "rewards_accuracies": "rewards/accuracies",
    "rewards_margins": "rewards/margins",
    "logps_chosen": "logps/chosen",
    "logps_rejected": "logps/rejected",
}


@struct.dataclass
class DPOMetrics(clu_metrics.Collection):
    """The loss and TRL's DPO metrics, averaged over the steps between log points; logged
    as ``train/loss``, ``train/rewards/chosen``, ... (``dpo_loss`` says what each is)."""

    loss: clu_metrics.Average.from_output("loss")  # type: ignore[valid-type]
    rewards_chosen: clu_metrics.Average.from_output("rewards/chosen")  # type: ignore[valid-type]
    rewards_rejected: clu_metrics.Average.from_output("rewards/rejected")  # type: ignore[valid-type]
    rewards_accuracies: clu_metrics.Average.from_output("rewards/accuracies")  # type: ignore[valid-type]
    rewards_margins: clu_metrics.Average.from_output("rewards/margins")  # type: ignore[valid-type]
    logps_chosen: clu_metrics.Average.from_output("logps/chosen")  # type: ignore[valid-type]
    logps_rejected: clu_metrics.Average.from_output("logps/rejected")  # type: ignore[valid-type]

    def compute(self) -> dict[str, jax.Array]:
        """The averages, under TRL's names (``rewards/chosen``, ...)."""
        return {_METRIC_NAMES.get(k, k): v for k, v in super().compute().items()}


def default_logits(model: nnx.Module, inputs: jax.Array) -> jax.Array:
    """``model(inputs)``: a language model called on token ids returns its logits."""
    return model(inputs)  # type: ignore[no-any-return]


def _with_placeholder_reference(batch: Any) -> Any:
    """``batch`` with zero reference log-probabilities (``[rows]``) where it has none."""
    if all(key in batch for key in ReferenceModel.KEYS):
        return batch
    rows = np.shape(batch["chosen_inputs"])[0]
    return {**batch, **{key: np.zeros(rows, np.float32) for key in ReferenceModel.KEYS}}


class DPOTrainer(Trainer):
    """Trains a policy on preference pairs with the DPO (sigmoid) or IPO loss.

    Args:
      model: a factory ``rngs -> nnx.Module`` (or ``init_from=`` weights): the reference
        is the same starting model built again, so a resumed run rebuilds it bit for bit;
        with ``lora=LoRA(...)`` (and ``wrt`` training the adapters alone, the default) it
        is the policy's frozen base with the adapters switched off, never copied.
      optimizer: any optax ``GradientTransformation``.
      beta: the strength of the pull towards the reference (``dpo_loss``).
      loss_type: ``"sigmoid"`` (DPO) or ``"ipo"``.
      label_smoothing: the assumed share of flipped labels (conservative DPO), sigmoid only.
      logits_fn: ``(model, inputs) -> logits``; default ``model(inputs)``.
      **kwargs: the ``Trainer``'s keywords (``strategy``, ``seed``, ``callbacks``, ...);
        ``metrics`` defaults to ``DPOMetrics``.

    Batches are ``preference_data.pair_batch`` dicts; a batch that already carries
    ``reference_chosen_logps`` and ``reference_rejected_logps`` (precomputed once for a
    data set) is used as it is, and the reference model is then never built.

    Example::

        trainer = DPOTrainer(lambda rngs: GPT(..., rngs=rngs), optax.sgd(1e-2), beta=0.1,
                             strategy=Hybrid(FSDP(4), TensorParallel(2)))
        pairs = [encode_text_pair(row, tokenizer.encode) for row in rows]
        trainer.fit(preference_batches(pairs, batch_size=8, seq_len=64), max_steps=100)
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any = None,
        *,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        logits_fn: LogitsFn = default_logits,
        **kwargs: Any,
    ) -> None:
        dpo_loss.check_loss(loss_type, beta, label_smoothing)
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing
        self.logits_fn = logits_fn
        self._reference: ReferenceModel | None = None
        kwargs.setdefault("metrics", DPOMetrics)
        super().__init__(model, optimizer, **kwargs)

    @property
    def reference(self) -> ReferenceModel:
        """The frozen reference model, built the first time asked (``ReferenceModel``): a
        copy of the starting model, or, when ``reference_is_base``, the policy itself with
        its adapters switched off (``bytes_per_device() == 0``)."""
        if self._reference is None:
            self._reference = ReferenceModel(
                self, self.side_logps, adapters_off=self.reference_is_base
            )
        return self._reference

    @property
    def reference_is_base(self) -> bool:
        """Whether the reference is the policy's own base: the trainer has LoRA adapters
        (``lora=``) and trains nothing else, so its base weights are the starting model's."""
        return base_is_reference(self)

    def choose_layout(self, batches: Iterable[Any]) -> Choice:
        """``strategy="auto"`` (``Trainer.choose_layout``): the layouts are timed on the
        first batches with zeros in place of the reference's log-probabilities (the
        reference needs a layout to run in), so each is timed on the policy's step alone;
        the reference's program, one forward pass, is left out of the ranking. Training
        then adds the real ones (``prepare_batch``)."""
        return super().choose_layout(map(_with_placeholder_reference, batches))

    def side_logps(self, model: nnx.Module, batch: Any, side: str) -> jax.Array:
        """``[rows]``: ``model``'s summed log-probabilities of the ``side`` completions."""
        logits = self.logits_fn(model, batch[f"{side}_inputs"])
        return dpo_loss.sequence_logps(logits, batch[f"{side}_targets"], batch[f"{side}_weights"])

    def prepare_batch(self, batch: Any) -> Any:
        """Adds the reference's log-probabilities of both completions to ``batch``
        (unless it carries them), computed by the reference's own compiled program."""
        if all(key in batch for key in ReferenceModel.KEYS):
            return batch
        return {**batch, **self.reference.logps(batch)}

    def loss_fn(self, model: nnx.Module, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The DPO (or IPO) loss of a batch of pairs, and TRL's metrics as ``aux``."""
        chosen_key, rejected_key = ReferenceModel.KEYS
        policy = (
            self.side_logps(model, batch, "chosen"),
            self.side_logps(model, batch, "rejected"),
        )
        reference = (batch[chosen_key], batch[rejected_key])
        tokens = (
            jnp.sum(batch["chosen_weights"], axis=-1),
            jnp.sum(batch["rejected_weights"], axis=-1),
        )
        return dpo_loss.dpo_loss(
            policy,
            reference,
            tokens,
            beta=self.beta,
            loss_type=self.loss_type,
            label_smoothing=self.label_smoothing,
        )
