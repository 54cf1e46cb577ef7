"""``DPOTrainer``: Direct Preference Optimization as a ``Trainer`` subclass, written
against the Trainer's public API only (``loss_fn``, ``prepare_batch``,
``initial_state``, ``plan``).

Each batch holds pairs (``preference_data.pair_batch``). Two forward passes a step, as
TRL's concatenated forward: the chosen and rejected rows of a batch go through a model
together (``pair_logps``: each pair's two rows side by side, so a device's rows stay its
own), once for the reference (``ReferenceModel.run``: the starting weights, frozen, laid
out as the policy; its own compiled program, before the step, added to the batch) and
once for the policy in the step, whose loss (``dpo_loss``) differentiates the policy's
alone. Each token's log-probability is the one chunked computation
(``nn.logprob_model.model_token_scores``): ``[rows, seq, vocab]`` never exists for a model
that gives its hidden states and head (the shipped GPT and GPT-2). With LoRA
(``lora=LoRA(...)``, only the adapters trained) the reference is the policy's own base
with the adapters switched off (``nn.lora.adapters_off``): no second copy of the weights;
``reference=`` takes another model of the policy's architecture instead.

``precompute_ref_log_probs=True`` (TRL's name): the reference's log-probabilities of the
whole data set are computed in one pass before training (``precompute_reference_logps``),
kept in a file with the run (``dpo_reference.ReferenceTable``) and read back on a resume;
the reference is then never run during training.
"""

# No ``from __future__ import annotations``: clu reads DPOMetrics' annotations as objects.
import os
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from clu import metrics as clu_metrics
from flax import nnx, struct

from nnx_spmd_trainer.nn.logprob import DEFAULT_CHUNK_SIZE
from nnx_spmd_trainer.nn.logprob_model import log_prob_note, model_token_scores
from nnx_spmd_trainer.planner.auto import Choice
from nnx_spmd_trainer.post_training import dpo_loss
from nnx_spmd_trainer.post_training.dpo_reference import ReferenceTable
from nnx_spmd_trainer.post_training.reference import ReferenceModel, base_is_reference
from nnx_spmd_trainer.trainer import Trainer

#: ``(model, inputs) -> logits [rows, seq, vocab]``: how the policy is called on tokens.
LogitsFn = Callable[[nnx.Module, jax.Array], jax.Array]

#: The keys of a batch of pairs that DPO reads (``preference_data.pair_batch``).
SIDES = ("chosen", "rejected")

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


def _side_by_side(chosen: jax.Array, rejected: jax.Array) -> jax.Array:
    """``[2 * rows, ...]``: each pair's chosen row, then its rejected row. Interleaved, not
    stacked end to end: a device holding pairs ``i..j`` holds both rows of each, so rows
    split over data/FSDP axes stay where they are (no rows move between devices)."""
    both = jnp.stack([chosen, rejected], axis=1)
    return both.reshape(-1, *both.shape[2:])


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
      logits_fn: ``(model, inputs) -> logits``: the models' log-probabilities are read from
        these whole logits. Default: through the model's hidden states and head, a chunk
        of positions at a time (``nn.logprob_model``'s protocol; a model without it is
        called as ``model(inputs)``).
      chunk_size: positions per chunk of the head's projection (``nn.token_log_probs``).
      reference: another ``nnx.Module`` as the reference (the policy's architecture and
        sizes: an SFT model under a policy started elsewhere), placed in the policy's
        layout; default the starting model (or, with LoRA, the base).
      precompute_ref_log_probs: the reference's log-probabilities are read from a table
        computed before training (``precompute_reference_logps``), never live.
      **kwargs: the ``Trainer``'s keywords (``strategy``, ``seed``, ``callbacks``, ...);
        ``metrics`` defaults to ``DPOMetrics``.

    Batches are ``preference_data.pair_batch`` dicts; a batch that already carries
    ``reference_chosen_logps`` and ``reference_rejected_logps`` is used as it is. An
    evaluation split of pairs (``fit(..., eval_data=...)``, ``evaluate``) reports the
    same metrics under ``eval/`` (``eval/rewards/accuracies``, ...).

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
        logits_fn: LogitsFn | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        reference: nnx.Module | None = None,
        precompute_ref_log_probs: bool = False,
        **kwargs: Any,
    ) -> None:
        dpo_loss.check_loss(loss_type, beta, label_smoothing)
        if reference is not None and not isinstance(reference, nnx.Module):
            raise TypeError(
                f"DPOTrainer(reference=...) takes an nnx.Module laid out as the policy, got "
                f"{type(reference).__name__}."
            )
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing
        self.logits_fn, self.chunk_size = logits_fn, chunk_size
        self.precompute_ref_log_probs = precompute_ref_log_probs
        self._reference_model = reference
        self._reference: ReferenceModel | None = None
        self._table: ReferenceTable | None = None
        kwargs.setdefault("metrics", DPOMetrics)
        super().__init__(model, optimizer, **kwargs)

    @property
    def reference(self) -> ReferenceModel:
        """The frozen reference model, built the first time asked (``ReferenceModel``): a
        copy of the starting model, the ``reference=`` model, or, when
        ``reference_is_base``, the policy itself with its adapters switched off
        (``bytes_per_device() == 0``)."""
        if self._reference is None:
            self._reference = ReferenceModel(
                self,
                adapters_off=self._reference_model is None and self.reference_is_base,
                model=self._reference_model,
            )
        return self._reference

    @property
    def reference_is_base(self) -> bool:
        """Whether the reference is the policy's own base: the trainer has LoRA adapters
        (``lora=``) and trains nothing else, so its base weights are the starting model's."""
        return base_is_reference(self)

    @property
    def log_prob_note(self) -> str | None:
        """Why the models' log-probabilities are read from their whole logits (one line),
        or ``None`` when they are computed a chunk of positions at a time."""
        return log_prob_note("DPOTrainer", self.model, self.logits_fn)

    def choose_layout(self, batches: Iterable[Any]) -> Choice:
        """``strategy="auto"`` (``Trainer.choose_layout``): the layouts are timed on the
        first batches with zeros in place of the reference's log-probabilities (the
        reference needs a layout to run in), so each is timed on the policy's step alone;
        the reference's program, one forward pass, is left out of the ranking. Training
        then adds the real ones (``prepare_batch``)."""
        return super().choose_layout(map(_with_placeholder_reference, batches))

    # -- the log-probabilities ----------------------------------------------------------
    def pair_logps(self, model: nnx.Module, batch: Any) -> tuple[jax.Array, jax.Array]:
        """``(chosen, rejected)``, ``[rows]`` each: ``model``'s summed log-probabilities of
        each pair's completions, from one forward pass over both sides' rows."""
        inputs, targets, weights = (
            _side_by_side(batch[f"chosen_{key}"], batch[f"rejected_{key}"])
            for key in ("inputs", "targets", "weights")
        )
        logps, _ = model_token_scores(
            model, inputs, targets, chunk_size=self.chunk_size, logits_fn=self.logits_fn
        )
        sums = jnp.sum(logps * weights, axis=-1).reshape(-1, 2)
        return sums[:, 0], sums[:, 1]

    def side_logps(self, model: nnx.Module, batch: Any, side: str) -> jax.Array:
        """``[rows]``: ``model``'s summed log-probabilities of the ``side`` completions alone
        (a pass of its own; the step and the reference read both sides in one,
        ``pair_logps``)."""
        logps, _ = model_token_scores(
            model,
            batch[f"{side}_inputs"],
            batch[f"{side}_targets"],
            chunk_size=self.chunk_size,
            logits_fn=self.logits_fn,
        )
        return jnp.sum(logps * batch[f"{side}_weights"], axis=-1)

    def _reference_pass(self, model: nnx.Module, batch: Any) -> dict[str, jax.Array]:
        pairs = {key: batch[key] for key in _BATCH_KEYS}  # its program: one per pair shapes
        return dict(zip(ReferenceModel.KEYS, self.pair_logps(model, pairs), strict=True))

    def reference_logps(self, batch: Any) -> dict[str, jax.Array]:
        """``{reference_chosen_logps, reference_rejected_logps}`` (``[rows]`` each) of a
        placed batch of pairs: the reference's one forward pass, its own compiled program
        (``ReferenceModel.run``), laid out as the batch's rows."""
        pairs = {key: batch[key] for key in _BATCH_KEYS}
        return self.reference.run(self._reference_pass, pairs)  # type: ignore[no-any-return]

    # -- the precomputed reference ------------------------------------------------------
    def precompute_reference_logps(
        self, batches: Iterable[Any], *, path: str | os.PathLike[str] | None = None
    ) -> ReferenceTable:
        """The reference's log-probabilities of every pair in ``batches`` (host batches of
        pairs: the whole data set, one pass), kept for training: each training batch then
        reads its rows from this table instead of running the reference.

        With ``path`` (a file kept with the run: ``<workdir>/reference_logps.npz``) the
        table is written there once, atomically; when the file exists already (a resumed
        run) it is read back and the reference is not run. The values are the live
        reference's, bit for bit: the same compiled program on batches of the same shapes.
        The reference's copy of the weights is let go once the table is made.
        """
        if path is not None and os.path.exists(path):
            self._table = ReferenceTable.load(path)
            return self._table
        table = ReferenceTable()
        with jax.set_mesh(self.plan.mesh):
            for host in batches:
                pairs = {key: np.asarray(host[key]) for key in _BATCH_KEYS}
                placed = self.placement.place(pairs, divisor=self.plan.grad_accum_steps)
                values = jax.device_get(self.reference_logps(placed))
                rows = len(pairs["chosen_inputs"])
                table.add(pairs, *(np.asarray(values[k])[:rows] for k in ReferenceModel.KEYS))
        if path is not None:
            table.save(path)
        self._table = table
        self._reference = None  # its copy of the weights is not needed during training
        return table

    def _with_table(self, batch: Any) -> Any:
        """A host batch with its rows' precomputed reference log-probabilities."""
        if self._table is None or all(key in batch for key in ReferenceModel.KEYS):
            return batch
        chosen, rejected = self._table.lookup(batch)
        return {**batch, ReferenceModel.KEYS[0]: chosen, ReferenceModel.KEYS[1]: rejected}

    def fit(
        self, train_data: Iterable[Any], eval_data: Iterable[Any] | None = None, **kwargs: Any
    ) -> Any:
        """``Trainer.fit``; with ``precompute_ref_log_probs``, each batch (train and eval)
        carries its rows' reference log-probabilities from the table
        (``precompute_reference_logps``, which must have run)."""
        if self.precompute_ref_log_probs:
            if self._table is None:
                raise ValueError(
                    "DPOTrainer(precompute_ref_log_probs=True): call "
                    "trainer.precompute_reference_logps(batches, path=...) over the data set "
                    "before fit (path: a file kept with the run, read back on a resume)."
                )
            train_data = map(self._with_table, train_data)
            if eval_data is not None:
                eval_data = _Mapped(self._with_table, eval_data)
        return super().fit(train_data, eval_data, **kwargs)

    # -- the step ------------------------------------------------------------------------
    def prepare_batch(self, batch: Any) -> Any:
        """Adds the reference's log-probabilities of both completions to ``batch``
        (unless it carries them), computed by the reference's own compiled program."""
        if all(key in batch for key in ReferenceModel.KEYS):
            return batch
        return {**batch, **self.reference_logps(batch)}

    def loss_fn(self, model: nnx.Module, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The DPO (or IPO) loss of a batch of pairs, and TRL's metrics as ``aux``."""
        chosen_key, rejected_key = ReferenceModel.KEYS
        policy = self.pair_logps(model, batch)
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


_BATCH_KEYS = tuple(f"{side}_{key}" for side in SIDES for key in ("inputs", "targets", "weights"))


class _Mapped:
    """``map(fn, iterable)`` that can be iterated again (evaluation reads its data at
    each evaluation)."""

    def __init__(self, fn: Callable[[Any], Any], iterable: Iterable[Any]) -> None:
        self.fn, self.iterable = fn, iterable

    def __iter__(self) -> Any:
        return map(self.fn, self.iterable)
