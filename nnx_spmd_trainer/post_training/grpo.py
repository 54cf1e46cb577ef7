"""``GRPOTrainer``: Group Relative Policy Optimization as a ``Trainer`` subclass, written
against the Trainer's public API only (``prepare_batch``, ``train_step``,
``compute_gradients``, ``initial_state``, ``placement``, ``plan``, ``run.timings``).

Each batch ``fit`` takes names prompts (``{"row": int32[prompts]}``, indices into the
trainer's ``PromptRows``: ``rollout.prompt_batches``). A data stage before placement
(``grpo_stage.RolloutStage``) turns each, when the loop asks for it, into this process's
host batch of a rollout, which the loop places once, as any batch:

1. rollout: ``group_size`` completions of each prompt from the library's ``Sampler``
   on the training mesh, reading the live model's arrays (no copy, no second process),
   each row's keys a function of ``(seed, step, the prompt's rank in the batch)``
   (``rollout_seed``, ``rollout.sampler_ranks``), so a resumed run, or one of another
   process count, samples the same completions; a completion ends at ``end_token``, at a
   ``stop`` string, or at ``max_new_tokens``;
2. the rewards (the user's ``reward_fn``: ``rewards``) of the rows this process feeds,
   normalised within each group into advantages.

After placement (``prepare_batch``), with ``beta > 0``: the frozen reference model's
per-token log-probabilities (``ReferenceModel``'s copy, its own compiled program).

Every log-probability (the loss's, the rollout policy's ``old``, the reference's) is of
the distribution the completions were sampled from: the logits over ``temperature``,
renormalised over the set top-k/top-p kept (the sampler's ``Generation.kept_min_logit``),
by the library's one per-token log-probability (``nn.logprob_model.model_token_scores``:
``[rows, seq, vocab]`` never whole for a model with the protocol). The train step takes
``old`` with the function the loss differentiates, in its compiled program, then makes
``num_iterations`` updates (``grpo_loss``): the ratio at the first update is 1 for every
token (``train/ratio_deviation``: the largest ``abs(ratio - 1)``; ``train/ratio/mean``,
``train/ratio/max`` and TRL's ``train/clip_ratio/...``: the ratio over the updates). The
goodput line splits the time into ``rollout``, ``reference`` and ``step`` (learning).

With several processes each feeds its rows of the prompt indices (its ``data_shard``,
as any batch); every process reads the whole batch's indices (a few integers), samples
every prompt, and keeps, scores and places only its own rows: the run trains as one
process of the same devices does.
"""

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnx_spmd_trainer.generate import Sampler
from nnx_spmd_trainer.generate.sampler import TextCodec
from nnx_spmd_trainer.nn.logprob import DEFAULT_CHUNK_SIZE
from nnx_spmd_trainer.nn.logprob_model import log_prob_note, model_token_scores
from nnx_spmd_trainer.post_training import grpo_loss, rewards
from nnx_spmd_trainer.post_training.dpo import LogitsFn
from nnx_spmd_trainer.post_training.grpo_metrics import GRPOMetrics
from nnx_spmd_trainer.post_training.grpo_stage import RolloutStage, global_rows
from nnx_spmd_trainer.post_training.rollout import (
    PromptRows,
    completion_columns,
    encode_prompt,
    process_rows,
    rollout_batch,
    sampler_ranks,
)
from nnx_spmd_trainer.trainer import Trainer


def rollout_seed(seed: int, step: int) -> int:
    """The sampler's seed for the rollout taken at ``step``: a function of both alone.

    >>> rollout_seed(0, 3) == rollout_seed(0, 3) != rollout_seed(0, 4)
    True
    """
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0])


class GRPOTrainer(Trainer):
    """Trains a policy on its own sampled completions, rewarded by a Python function.

    Args:
      model: a factory ``rngs -> nnx.Module`` (or ``init_from=`` weights) of a model the
        ``Sampler`` decodes (docs/topics/sampling.md).
      optimizer: any optax ``GradientTransformation``.
      prompts: the prompt rows (``PromptRows``; ``rollout.read_prompts`` reads JSONL).
      reward_fn: ``(prompts, completions, **fields) -> [completions]`` (``rewards``).
      group_size: completions per prompt (>= 2).
      max_new_tokens: the most tokens a completion has.
      temperature, top_k, top_p: the sampling of completions.
      end_token: the token that ends a completion (kept in it, trained on).
      stop: strings that end a completion (through ``tokenizer``; the token that
        completes one is kept and trained on, the reward's text is cut before it).
      epsilon: the clipping of the ratio.
      beta: the weight of the k3 KL term to the reference model; 0: no reference built.
      num_iterations: updates per rollout (``mu``); ``trainer.step`` counts updates.
      tokenizer: turns text prompts into ids and completions into the reward's text.
      logits_fn: ``(model, inputs) -> logits``, read whole; default: the model's output
        head a chunk of positions at a time (``nn.logprob_model``'s protocol), else
        ``model(inputs)``.
      chunk_size: positions per chunk of the head's projection (``nn.token_log_probs``).
      **kwargs: the ``Trainer``'s keywords; ``metrics`` defaults to ``GRPOMetrics``;
        ``prefetch`` is 0 (a rollout sampled ahead would read older weights).

    Example::

        trainer = GRPOTrainer(lambda rngs: GPT(..., rngs=rngs), optax.sgd(0.1),
                              prompts=PromptRows.of(rows), reward_fn=my_reward,
                              group_size=8, max_new_tokens=16)
        trainer.fit(prompt_batches(len(rows), batch_size=4, steps=50), max_steps=50)
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any = None,
        *,
        prompts: PromptRows,
        reward_fn: rewards.RewardFn,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        end_token: int | None = None,
        stop: Sequence[str] = (),
        epsilon: float = 0.2,
        beta: float = 0.0,
        num_iterations: int = 1,
        tokenizer: TextCodec | None = None,
        logits_fn: LogitsFn | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        **kwargs: Any,
    ) -> None:
        rewards.check_group_size(group_size)
        if num_iterations < 1:
            raise ValueError(f"num_iterations={num_iterations}: give 1 or more updates a rollout.")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: give 1 or more.")
        if beta < 0 or not 0 < epsilon < 1:
            raise ValueError(f"beta={beta}, epsilon={epsilon}: need beta >= 0, 0 < epsilon < 1.")
        if not temperature > 0:
            raise ValueError(
                f"temperature={temperature}: GRPO learns from sampled completions; give a "
                "temperature > 0 (1.0 samples the model's own distribution)."
            )
        if kwargs.get("prefetch"):
            raise ValueError(
                f"prefetch={kwargs['prefetch']}: a GRPO rollout samples the weights of the "
                "step before it, so it cannot be taken ahead; leave prefetch unset."
            )
        if stop and tokenizer is None:
            raise TypeError("GRPOTrainer: stop strings need tokenizer=... to read the text.")
        kwargs["prefetch"] = 0
        self.prompts, self.reward_fn, self.tokenizer = prompts, reward_fn, tokenizer
        self.group_size, self.max_new_tokens = group_size, max_new_tokens
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.end_token, self.epsilon, self.beta = end_token, epsilon, beta
        self.stop = tuple(stop)
        #: Whether sampling keeps only part of the vocabulary (top-k or top-p): then each
        #: position's ``kept_min_logit`` is part of the rollout batch.
        self.truncates = top_k > 0 or top_p < 1.0
        self.num_iterations, self.logits_fn = num_iterations, logits_fn
        self.chunk_size = chunk_size
        self.prompt_ids = [self._encode(p) for p in prompts.prompts]
        #: The training rows' length: the longest prompt and completion, less one.
        self.seq_len = max(len(p) for p in self.prompt_ids) + max_new_tokens - 1
        #: The last rollout's rewards of this process's rows (``process_rows``), on the host.
        self.last_rewards: np.ndarray | None = None
        self._sampler: tuple[nnx.Module, Sampler] | None = None
        self._reference: Any = None
        kwargs.setdefault("metrics", GRPOMetrics)
        super().__init__(model, optimizer, **kwargs)

    def _encode(self, prompt: Any) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    # -- the log-probabilities the loss, the old policy and the reference share ----------
    def policy_logps(self, model: nnx.Module, batch: Any) -> jax.Array:
        """``[rows, seq]``: ``model``'s log-probability of each target of ``batch`` under the
        distribution the rollout sampled from: the logits over ``temperature``,
        renormalised over the tokens at or above ``batch["kept_min_logit"]`` (less
        ``grpo_loss.KEPT_TOLERANCE``: the sampler's cached decode and this pass differ in
        the last bits), fixed, no gradient through it."""
        kept = batch.get("kept_min_logit") if self.truncates else None
        if kept is not None:
            kept = grpo_loss.loosened(jax.lax.stop_gradient(kept))
        logps, _ = model_token_scores(
            model,
            batch["inputs"],
            batch["targets"],
            chunk_size=self.chunk_size,
            temperature=self.temperature,
            kept_min_logit=kept,
            logits_fn=self.logits_fn,
        )
        return logps

    @property
    def log_prob_note(self) -> str | None:
        """Why the log-probabilities are read from the whole logits (one line, for the plan
        report), or ``None`` when they are computed a chunk of positions at a time."""
        return log_prob_note("GRPOTrainer", self.model, self.logits_fn)

    # -- before the step, on the host ------------------------------------------------------
    def sampler(self) -> Sampler:
        """The ``Sampler`` over the live model (rebuilt if the model object changed)."""
        model = self.model
        if self._sampler is None or self._sampler[0] is not model:
            sampler = Sampler(model, self.plan, tokenizer=self.tokenizer, print_fn=None)
            self._sampler = (model, sampler)
        return self._sampler[1]

    def rollout(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """This process's host batch of one rollout of prompt ``rows`` (the global batch's
        indices) at the current step: tokens, completion weights, rewards, advantages, the
        sampler's log-probabilities of its tokens under the distribution it sampled
        (``sampler_logps``) and, with top-k or top-p where the sampler reports it, each
        position's smallest kept scaled logit (``kept_min_logit``).

        Every process samples every prompt, in index order (``sampler_ranks``): the
        sampler's programs run on the whole mesh, and a completion's keys, a function of
        its place in the sampler's batch, are then the same whichever process feeds its
        prompt and however the processes' rows interleave. Each process then keeps the
        rows it feeds (``process_rows``), so the reward function sees only those.
        """
        group, rows = self.group_size, np.asarray(rows)
        ranks = sampler_ranks(rows)
        in_order = np.sort(rows, kind="stable")
        generated = self.sampler().generate(
            [self.prompt_ids[int(r)] for r in in_order for _ in range(group)],
            max_new_tokens=self.max_new_tokens,
            seed=rollout_seed(self.plan.settings.seed, self.step),
            end_token=self.end_token,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            stop=self.stop,
        )
        mine = process_rows(len(rows), self.placement.data_shard)
        rows = rows[mine]
        sampled = [rank * group + g for rank in ranks[mine] for g in range(group)]
        prompt_ids = [self.prompt_ids[int(r)] for r in rows for _ in range(group)]
        completions = [generated.tokens[i] for i in sampled]
        batch = rollout_batch(prompt_ids, completions, self.seq_len)
        texts: tuple[list[Any], list[Any]] = (
            [self.prompts.prompts[int(r)] for r in rows for _ in range(group)],
            list(completions),
        )
        if self.tokenizer is not None:
            said = generated.text  # cut before a stop string, the end token left out
            decode = self.tokenizer.decode
            texts = (
                [decode(p) for p in prompt_ids],
                [said[i] for i in sampled] if said else [decode(c) for c in completions],
            )
        fields: dict[str, list[Any]] = {}
        for r in rows:
            for key, value in self.prompts.fields[int(r)].items():
                fields.setdefault(key, []).extend([value] * group)
        scores = rewards.score(self.reward_fn, texts[0], texts[1], fields)
        self.last_rewards = scores
        # The sampling distribution's log-probabilities and kept sets, as the sampler drew.
        per_token: dict[str, Any] = {"sampler_logps": generated.sampling_log_probs}
        if self.truncates:
            if not generated.kept_min_logit:
                raise TypeError(
                    "GRPOTrainer: top_k/top_p need the sampler's Generation.kept_min_logit "
                    "(the kept set the learner renormalises over); this sampler gives none."
                )
            per_token["kept_min_logit"] = generated.kept_min_logit
        for key, values in per_token.items():
            fill = -np.inf if key == "kept_min_logit" else 0.0
            batch[key] = completion_columns(prompt_ids, [values[i] for i in sampled], batch, fill)
        return {
            **batch,
            "rewards": scores,
            "advantages": rewards.group_advantages(scores, group),
        }

    def rollout_spec(self, prompts: int) -> dict[str, jax.ShapeDtypeStruct]:
        """The shapes and dtypes of the batch the train step reads for a rollout of
        ``prompts`` prompts (``rollout``'s keys, and ``prepare_batch``'s): what the stage
        gives, declared without sampling (a plan, a dry run's memory)."""
        rows = prompts * self.group_size
        table = jax.ShapeDtypeStruct((rows, self.seq_len), np.float32)
        ids = jax.ShapeDtypeStruct((rows, self.seq_len), np.int32)
        spec = {"inputs": ids, "targets": ids, "weights": table, "sampler_logps": table}
        if self.truncates:
            spec["kept_min_logit"] = table
        spec["rewards"] = spec["advantages"] = jax.ShapeDtypeStruct((rows,), np.float32)
        if self.beta > 0:
            spec["reference_logps"] = table
        return spec

    def fit(self, train_data: Iterable[Any], eval_data: Any = None, **kwargs: Any) -> Any:
        """``Trainer.fit`` on the rollouts of ``train_data``'s batches of prompt indices
        (``{"row": int32[prompts]}``, this process's rows): each is sampled when the loop
        asks for its batch (``grpo_stage.RolloutStage``), then placed once. ``eval_data``:
        rollout batches as ``rollout`` makes them, evaluated as they are."""
        stage = RolloutStage(self._rollout_of, train_data)
        return super().fit(stage, eval_data, **kwargs)

    def _rollout_of(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The stage's work for one batch of this process's prompt ``rows``, timed as
        ``rollout``."""
        # The last update must finish before the rollout reads its weights: that wait is
        # learning's ("step"), not the rollout's.
        jax.block_until_ready(jax.tree.leaves(nnx.state(self.model)))
        with self.run.timings.timing("rollout"):
            return self.rollout(global_rows(rows, self.placement.data_shard))

    def prepare_batch(self, batch: Any) -> Any:
        """A placed rollout batch -> the same with the reference's log-probabilities where
        ``beta > 0`` (timed as ``reference``): another compiled program's output, laid out
        as the batch's rows."""
        if self.beta > 0 and "reference_logps" not in batch:
            with self.run.timings.timing("reference"):
                batch = {**batch, "reference_logps": self.reference_logps(batch)}
                jax.block_until_ready(batch)
        return batch

    # -- the reference model ---------------------------------------------------------------
    @property
    def reference(self) -> Any:
        """The frozen reference model (``ReferenceModel``), built the first time asked: a
        copy of the starting model, or, with LoRA adapters the only trained weights, the
        policy's own base with its adapters switched off (``bytes_per_device() == 0``)."""
        if self._reference is None:
            from nnx_spmd_trainer.post_training.reference import (
                ReferenceModel,
                base_is_reference,
            )

            self._reference = ReferenceModel(self, adapters_off=base_is_reference(self))
        return self._reference

    def reference_logps(self, batch: Any) -> jax.Array:
        """``[rows, seq]``: the reference model's log-probability of each target under the
        rollout's sampling distribution (``policy_logps``), laid out as the batch's rows;
        one compiled program per batch shape (``ReferenceModel.run``)."""
        return self.reference.run(self.policy_logps, batch)  # type: ignore[no-any-return]

    # -- the step --------------------------------------------------------------------------
    def loss_fn(self, model: nnx.Module, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The GRPO loss of a rollout batch that carries ``old_logps`` (``grpo_loss``)."""
        reference = batch["reference_logps"] if self.beta > 0 else None
        loss, aux = grpo_loss.grpo_loss(
            self.policy_logps(model, batch),
            batch["old_logps"],
            batch["advantages"],
            batch["weights"],
            reference,
            epsilon=self.epsilon,
            beta=self.beta,
        )
        return loss, aux

    def train_step(
        self, model: nnx.Module, optimizer: nnx.Optimizer[nnx.Module], batch: Any
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``num_iterations`` updates on one rollout. The rollout policy's log-probabilities
        (``old``) come from ``policy_logps`` in this compiled program, before the first
        update: the function the loss differentiates, on the same weights."""
        weights = batch["weights"]
        old = jax.lax.stop_gradient(self.policy_logps(model, batch))
        batch = {**batch, "old_logps": old}
        first: tuple[jax.Array, dict[str, jax.Array]] | None = None
        ratios: list[dict[str, jax.Array]] = []
        for _ in range(self.num_iterations):
            loss, aux, grads = self.compute_gradients(model, batch)
            optimizer.update(model, grads, value=loss)
            ratios.append({k: v for k, v in aux.items() if k.startswith(("ratio/", "clip_ratio/"))})
            if first is None:
                first = (loss, {**aux, "grad_norm": optax.tree.norm(grads)})
        assert first is not None
        loss, aux = first
        # The ratio before clipping over every update of the rollout (the first's is 1).
        for key in ratios[0]:
            values = jnp.stack([r[key] for r in ratios])
            aux[key] = jnp.max(values) if key == "ratio/max" else jnp.mean(values)
        rewards_ = batch["rewards"]
        gap = jnp.max(jnp.where(weights > 0, jnp.abs(old - batch["sampler_logps"]), 0.0))
        aux = {
            **aux,
            "reward": jnp.mean(rewards_),
            "reward_std": jnp.std(rewards_),
            "completion_length": jnp.mean(jnp.sum(weights, axis=-1)),
            "sampler_gap": gap,
        }
        aux.setdefault("kl", jnp.zeros((), jnp.float32))
        return loss, aux
