"""``GRPOTrainer``: Group Relative Policy Optimization as a ``Trainer`` subclass, written
against the Trainer's public API only (``prepare_batch``, ``train_step``,
``compute_gradients``, ``initial_state``, ``placement``, ``plan``, ``run.timings``).

Each batch ``fit`` takes names prompts (``{"row": int32[prompts]}``, indices into the
trainer's ``PromptRows``: ``rollout.prompt_batches``). Before its step
(``prepare_batch``), on the host:

1. rollout: ``group_size`` completions of each prompt from the library's ``Sampler``
   on the training mesh, reading the live model's arrays (no copy, no second process),
   each row's keys a function of ``(seed, step, the prompt's rank in the batch)``
   (``rollout_seed``, ``rollout.sampler_ranks``), so a resumed run, or one of another
   process count, samples the same completions;
2. the rewards (the user's ``reward_fn``: ``rewards``) of the rows this process feeds,
   normalised within each group into advantages;
3. reference: with ``beta > 0``, the frozen reference model's per-token log-probabilities
   (``ReferenceModel``'s copy, its own compiled program).

The train step then computes the rollout policy's log-probabilities (``old``) with the
same function, in the same compiled program, as the loss reads them, and makes
``num_iterations`` updates on the rollout (``grpo_loss``): the ratio at the first update
is 1 for every token (``train/ratio_deviation`` logs the largest ``abs(ratio - 1)``).
The goodput line splits the time into ``rollout``, ``reference`` and ``step`` (learning).

With several processes each feeds its rows of the prompt indices (its ``data_shard``,
as any batch); every process reads the whole batch's indices (a few integers), samples
every prompt, and keeps, scores and places only its own rows: the run trains as one
process of the same devices does.
"""

# No ``from __future__ import annotations``: clu reads GRPOMetrics' annotations as objects.
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from clu import metrics as clu_metrics
from flax import nnx, struct

from nnx_spmd_trainer.data.to_host import gather_to_host
from nnx_spmd_trainer.generate import Sampler
from nnx_spmd_trainer.generate.sampler import TextCodec
from nnx_spmd_trainer.post_training import grpo_loss, rewards
from nnx_spmd_trainer.post_training.dpo import LogitsFn, default_logits
from nnx_spmd_trainer.post_training.rollout import (
    PromptRows,
    process_rows,
    rollout_batch,
    sampler_ranks,
)
from nnx_spmd_trainer.trainer import Trainer


@struct.dataclass
class GRPOMetrics(clu_metrics.Collection):
    """The loss of each rollout's first update and what the rollout was, averaged over the
    steps between log points (``train/reward``, ``train/ratio_deviation``, ...)."""

    loss: clu_metrics.Average.from_output("loss")  # type: ignore[valid-type]
    reward: clu_metrics.Average.from_output("reward")  # type: ignore[valid-type]
    reward_std: clu_metrics.Average.from_output("reward_std")  # type: ignore[valid-type]
    ratio_deviation: clu_metrics.Average.from_output("ratio_deviation")  # type: ignore[valid-type]
    clip_fraction: clu_metrics.Average.from_output("clip_fraction")  # type: ignore[valid-type]
    kl: clu_metrics.Average.from_output("kl")  # type: ignore[valid-type]
    completion_length: clu_metrics.Average.from_output("completion_length")  # type: ignore[valid-type]
    sampler_gap: clu_metrics.Average.from_output("sampler_gap")  # type: ignore[valid-type]


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
      epsilon: the clipping of the ratio.
      beta: the weight of the k3 KL term to the reference model; 0: no reference built.
      num_iterations: updates per rollout (``mu``); ``trainer.step`` counts updates.
      tokenizer: turns text prompts into ids and completions into the reward's text.
      logits_fn: ``(model, inputs) -> logits``; default ``model(inputs)``.
      **kwargs: the ``Trainer``'s keywords; ``metrics`` defaults to ``GRPOMetrics``.

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
        epsilon: float = 0.2,
        beta: float = 0.0,
        num_iterations: int = 1,
        tokenizer: TextCodec | None = None,
        logits_fn: LogitsFn = default_logits,
        **kwargs: Any,
    ) -> None:
        rewards.check_group_size(group_size)
        if num_iterations < 1:
            raise ValueError(f"num_iterations={num_iterations}: give 1 or more updates a rollout.")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: give 1 or more.")
        if beta < 0 or not 0 < epsilon < 1:
            raise ValueError(f"beta={beta}, epsilon={epsilon}: need beta >= 0, 0 < epsilon < 1.")
        self.prompts, self.reward_fn, self.tokenizer = prompts, reward_fn, tokenizer
        self.group_size, self.max_new_tokens = group_size, max_new_tokens
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.end_token, self.epsilon, self.beta = end_token, epsilon, beta
        self.num_iterations, self.logits_fn = num_iterations, logits_fn
        self.prompt_ids = [self._encode(p) for p in prompts.prompts]
        #: The training rows' length: the longest prompt and completion, less one.
        self.seq_len = max(len(p) for p in self.prompt_ids) + max_new_tokens - 1
        #: The last rollout's rewards of this process's rows (``process_rows``), on the host.
        self.last_rewards: np.ndarray | None = None
        self._sampler: tuple[nnx.Module, Sampler] | None = None
        self._reference: Any = None
        self._reference_programs: dict[Any, Callable[..., Any]] = {}
        kwargs.setdefault("metrics", GRPOMetrics)
        super().__init__(model, optimizer, **kwargs)

    def _encode(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError("GRPOTrainer: text prompts need tokenizer=...; or give token ids.")
            return [int(t) for t in self.tokenizer.encode(prompt)]
        return [int(t) for t in prompt]

    # -- the log-probabilities the loss, the old policy and the reference share ----------
    def policy_logps(self, model: nnx.Module, batch: Any) -> jax.Array:
        """``[rows, seq]``: ``model``'s log-probability of each target of ``batch``."""
        return grpo_loss.token_logps(self.logits_fn(model, batch["inputs"]), batch["targets"])

    # -- before the step, on the host ------------------------------------------------------
    def sampler(self) -> Sampler:
        """The ``Sampler`` over the live model (rebuilt if the model object changed)."""
        model = self.model
        if self._sampler is None or self._sampler[0] is not model:
            self._sampler = (model, Sampler(model, self.plan, print_fn=None))
        return self._sampler[1]

    def rollout(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """This process's host batch of one rollout of prompt ``rows`` (the global batch's
        indices, as placed) at the current step: tokens, completion weights, rewards,
        advantages and the sampler's own log-probabilities.

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
        )
        mine = process_rows(len(rows), self.placement.data_shard)
        rows = rows[mine]
        sampled = [rank * group + g for rank in ranks[mine] for g in range(group)]
        prompt_ids = [self.prompt_ids[int(r)] for r in rows for _ in range(group)]
        completions = [generated.tokens[i] for i in sampled]
        batch = rollout_batch(prompt_ids, completions, self.seq_len)
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        texts = (
            ([self.prompts.prompts[int(r)] for r in rows for _ in range(group)], completions)
            if decode is None
            else (
                [decode(p) for p in prompt_ids],
                [decode(c) for c in completions],
            )
        )
        fields: dict[str, list[Any]] = {}
        for r in rows:
            for key, value in self.prompts.fields[int(r)].items():
                fields.setdefault(key, []).extend([value] * group)
        scores = rewards.score(self.reward_fn, texts[0], texts[1], fields)
        self.last_rewards = scores
        sampler_logps = np.zeros_like(batch["weights"])
        for r, (prompt, i) in enumerate(zip(prompt_ids, sampled, strict=True)):
            logps = generated.log_probs[i]
            start = len(prompt) - 1
            sampler_logps[r, start : start + len(logps)] = logps
        return {
            **batch,
            "rewards": scores,
            "advantages": rewards.group_advantages(scores, group),
            "sampler_logps": sampler_logps,
        }

    def prepare_batch(self, batch: Any) -> Any:
        """A batch of prompt indices -> the placed rollout batch (timed as ``rollout``),
        with the reference's log-probabilities where ``beta > 0`` (``reference``)."""
        if "row" not in batch:  # evaluation of rollouts given as they are
            return batch
        timings = self.run.timings
        # The last update must finish before the rollout reads its weights: that wait is
        # learning's ("step"), not the rollout's.
        jax.block_until_ready(jax.tree.leaves(nnx.state(self.model)))
        with timings.timing("rollout"):
            rows = gather_to_host(batch["row"])
            host = self.rollout(rows)
            placed = self.placement.place(host, divisor=self.plan.grad_accum_steps)
            jax.block_until_ready(placed)
        if self.beta > 0:
            with timings.timing("reference"):
                placed = {**placed, "reference_logps": self.reference_logps(placed)}
                jax.block_until_ready(placed)
        return placed

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

            self._reference = ReferenceModel(
                self, lambda model, b, side: b, adapters_off=base_is_reference(self)
            )
        return self._reference

    def reference_logps(self, batch: Any) -> jax.Array:
        """``[rows, seq]``: the reference model's log-probability of each target, laid out
        as the batch's rows; one compiled program per batch shape."""
        reference = self.reference
        key = tuple((k, v.shape) for k, v in sorted(batch.items()))
        if key not in self._reference_programs:
            self._reference_programs[key] = self._compile_reference(batch)
        return self._reference_programs[key](reference.state, batch)  # type: ignore[no-any-return]

    def _compile_reference(self, batch: Any) -> Callable[..., Any]:
        plan, reference, logps = self.plan, self._reference, self.policy_logps
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
        batch_shardings = plan.batch_shardings(abstract)

        def program(state: nnx.State, batch: Any) -> jax.Array:
            with plan.trace_context(batch_shardings), reference.traced(state) as model:
                return logps(model, batch)

        return plan.compile_program(
            program,
            in_shardings=(self._reference.shardings(), batch_shardings),
            out_shardings=batch_shardings["weights"],
        )

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
        for _ in range(self.num_iterations):
            loss, aux, grads = self.compute_gradients(model, batch)
            optimizer.update(model, grads, value=loss)
            if first is None:
                first = (loss, {**aux, "grad_norm": optax.tree.norm(grads)})
        assert first is not None
        loss, aux = first
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
