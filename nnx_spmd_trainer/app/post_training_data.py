"""The data of ``--config=dpo`` and ``--config=grpo`` runs, read and checked before
anything is written: each bad input a ``ConfigError`` naming its key (one line).

- DPO: ``config.data.preferences``, a JSONL of ``{"prompt", "chosen", "rejected"}`` rows
  (text, or chat messages rendered with ``config.data.chat_template``), encoded with the
  run's tokenizer into batches of pairs (``pair_batches``).
- GRPO: ``config.data.prompts``, a JSONL of ``{"prompt", <fields>}`` rows, batches of
  prompt indices (``prompt_index_batches``), and the reward function named
  ``module:function`` (``config.grpo.reward``), its answer's shape tried before the run.

Both are Grain ``MapDataset``s of ``max_steps`` (or rollouts) batches, each a function of
its index and the seed: a resumed run seeks to its batch without reading the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grain
import ml_collections
import numpy as np

from nnx_spmd_trainer import DataShard
from nnx_spmd_trainer.app.datasets.chat import run_chat_tokenizer
from nnx_spmd_trainer.app.run_config import ConfigError
from nnx_spmd_trainer.data import ChatError, ChatTokenizer, Tokenizer
from nnx_spmd_trainer.post_training import (
    LOSS_TYPES,
    EncodedPair,
    PreferenceError,
    PreferenceRows,
    PromptRows,
    RewardError,
    RewardFn,
    encode_chat_pair,
    encode_text_pair,
    is_chat_row,
    load_reward,
    pair_batch,
    prompt_batches,
    read_preferences,
    read_prompts,
    score,
)

__all__ = [
    "chat_tokenizer",
    "dpo_keys",
    "grpo_keys",
    "model_positions",
    "pair_batches",
    "preference_pairs",
    "prompt_index_batches",
    "prompt_rows",
    "reward_function",
]


def _data_file(config: ml_collections.ConfigDict, key: str, what: str) -> Path:
    """``config.data.<key>``: a file that exists, or a ``ConfigError`` saying what to give."""
    path = (config.get("data") or {}).get(key, "")
    if not path:
        raise ConfigError(
            f"config.data.{key}: give the JSONL file of {what} (--config.data.{key}=FILE.jsonl)."
        )
    if not Path(path).is_file():
        raise ConfigError(f"config.data.{key}={path!r}: there is no file there.")
    return Path(path)


def model_positions(config: ml_collections.ConfigDict) -> tuple[str, int]:
    """``(its key, the tokens a row has)``: the model's ``seq_len`` (``config.gpt.seq_len``
    for the GPT, ``config.gpt2_hf.seq_len`` for GPT-2).

    >>> model_positions(ml_collections.ConfigDict({"model": "gpt", "gpt": {"seq_len": 32}}))
    ('config.gpt.seq_len', 32)
    """
    return f"config.{config.model}.seq_len", int(config[config.model].seq_len)


def preference_pairs(
    config: ml_collections.ConfigDict, codec: Any
) -> tuple[PreferenceRows, list[EncodedPair]]:
    """The rows of ``config.data.preferences`` and their encoded pairs (text rows with
    ``codec.encode``, chat rows rendered by ``chat_tokenizer``), each pair checked to fit
    the model's ``seq_len``: a ``ConfigError`` naming the row otherwise."""
    path = _data_file(config, "preferences", "preference pairs")
    key = f"config.data.preferences={str(path)!r}"
    try:
        rows = read_preferences(path)
    except PreferenceError as error:
        raise ConfigError(f"{key}: {error}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{key}: not UTF-8 text ({error.reason}).") from None
    chat = chat_tokenizer(config, codec) if any(map(is_chat_row, rows.rows)) else None
    seq_key, seq_len = model_positions(config)
    pairs = []
    for number, row in enumerate(rows.rows, start=1):
        which = f"the {_ordinal(number)} pair kept (prompt {str(row['prompt'])!r:.40})"
        try:
            pair = (
                encode_chat_pair(row, chat) if chat and is_chat_row(row)
                else encode_text_pair(row, codec.encode)
            )  # fmt: skip
        except PreferenceError as error:
            raise ConfigError(f"{key}: {which}: {error}") from None
        try:
            pair_batch([pair], seq_len)
        except PreferenceError:
            raise ConfigError(
                f"{key}: {which} leaves a completion no token within {seq_key}={seq_len}; "
                f"give a longer {seq_key} or shorter prompts."
            ) from None
        pairs.append(pair)
    return rows, pairs


def chat_tokenizer(config: ml_collections.ConfigDict, codec: Any) -> ChatTokenizer:
    """What renders chat preference rows: ``config.data.tokenizer``'s own template (or
    ``config.data.chat_template``), or the run's BPE with ``config.data.chat_template``
    (``"chatml"``); a ``ConfigError`` naming the key when there is none."""
    data = config.get("data") or ml_collections.ConfigDict()
    key = f"config.data.chat_template={data.get('chat_template', '')!r}"
    try:
        return run_chat_tokenizer(
            data,
            lambda: codec if isinstance(codec, Tokenizer) else None,
            "config.data.preferences holds chat rows, and the run's tokenizer",
        )
    except (ChatError, ImportError, ValueError) as error:
        raise ConfigError(f"{key}: {error}") from None


def _ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``11th``...

    >>> [_ordinal(n) for n in (1, 2, 3, 4, 11, 22)]
    ['1st', '2nd', '3rd', '4th', '11th', '22nd']
    """
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def pair_batches(
    pairs: Sequence[EncodedPair],
    *,
    batch_size: int,
    seq_len: int,
    steps: int,
    seed: int,
    shard: DataShard,
) -> grain.MapDataset:
    """``steps`` batches of pairs (``pair_batch``) as a ``MapDataset``: batch ``i`` takes
    the ``i``-th ``batch_size`` pairs of a pass over ``pairs`` in the order drawn from
    ``(seed, pass)``, this process's rows of it (``shard``); a pass's last partial batch is
    left out."""
    if len(pairs) < batch_size:
        raise ConfigError(
            f"config.batch_size={batch_size}: config.data.preferences holds {len(pairs)} "
            "usable pairs, fewer than one batch; give more pairs or a smaller batch_size."
        )
    per_pass = len(pairs) // batch_size

    def batch(index: int) -> dict[str, Any]:
        epoch, k = divmod(index, per_pass)
        order = np.random.default_rng([seed, epoch]).permutation(len(pairs))
        rows = order[k * batch_size : (k + 1) * batch_size][shard.index :: shard.count]
        return pair_batch([pairs[int(r)] for r in rows], seq_len)

    return grain.MapDataset.range(steps).map(batch)


def prompt_rows(config: ml_collections.ConfigDict) -> PromptRows:
    """The rows of ``config.data.prompts``; a ``ConfigError`` naming the line of a bad one."""
    path = _data_file(config, "prompts", "prompts")
    try:
        return read_prompts(path)
    except (ValueError, UnicodeDecodeError) as error:
        raise ConfigError(f"config.data.prompts={str(path)!r}: {error}") from None


def prompt_index_batches(
    rows: int, *, batch_size: int, rollouts: int, seed: int, shard: DataShard
) -> grain.MapDataset:
    """``rollouts`` batches ``{"row": int32[batch_size / processes]}`` of prompt indices
    (``prompt_batches``), this process's share of each."""
    batches = prompt_batches(rows, batch_size, rollouts, seed=seed)
    return grain.MapDataset.source(batches).map(
        lambda b: {"row": b["row"][shard.index :: shard.count]}
    )


def dpo_keys(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """``DPOTrainer``'s loss keywords from ``config.dpo``, checked: a ``ConfigError``
    naming the key."""
    dpo = config.dpo
    loss_type, beta, smoothing = dpo.loss_type, dpo.beta, dpo.label_smoothing
    if loss_type not in LOSS_TYPES:
        raise ConfigError(
            f"config.dpo.loss_type={loss_type!r}: must be one of "
            f"{', '.join(map(repr, LOSS_TYPES))}."
        )
    if not beta > 0:
        raise ConfigError(
            f"config.dpo.beta={beta!r}: must be > 0 (the pull towards the reference); "
            "pass e.g. --config.dpo.beta=0.1."
        )
    if not 0.0 <= smoothing < 0.5 or (smoothing and loss_type != "sigmoid"):
        raise ConfigError(
            f"config.dpo.label_smoothing={smoothing!r}: must be in [0, 0.5), and 0 unless "
            "config.dpo.loss_type='sigmoid' (the assumed share of flipped labels)."
        )
    return {"beta": float(beta), "loss_type": loss_type, "label_smoothing": float(smoothing)}


def grpo_keys(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """``GRPOTrainer``'s keywords from ``config.grpo`` (the reward excepted), checked: a
    ``ConfigError`` naming the key; ``max_steps`` and ``checkpoint_every_n_steps`` must be
    whole rollouts (multiples of ``num_iterations``)."""
    grpo = config.grpo
    group = grpo.group_size
    if isinstance(group, bool) or not isinstance(group, int) or group < 2:
        raise ConfigError(
            f"config.grpo.group_size={group!r}: GRPO normalises rewards within a group of "
            "completions of one prompt, so a group needs >= 2; pass "
            "--config.grpo.group_size=4 or more."
        )
    iterations = grpo.num_iterations
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ConfigError(
            f"config.grpo.num_iterations={iterations!r}: the updates made on each rollout, "
            "an integer >= 1; pass e.g. --config.grpo.num_iterations=2."
        )
    for key in ("max_steps", "checkpoint_every_n_steps"):
        value = config.get(key) or 0
        if value % iterations:
            raise ConfigError(
                f"config.{key}={value} with config.grpo.num_iterations={iterations}: steps "
                f"count updates, {iterations} a rollout, so give a multiple of {iterations}."
            )
    new_tokens = grpo.max_new_tokens
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ConfigError(
            f"config.grpo.max_new_tokens={new_tokens!r}: the most tokens a completion has, "
            "an integer >= 1; pass e.g. --config.grpo.max_new_tokens=8."
        )
    for key, low, high in (("temperature", 0.0, math.inf), ("top_p", 0.0, 1.0)):
        value = grpo[key]
        if not low < value <= high:
            raise ConfigError(
                f"config.grpo.{key}={value!r}: must be in ({low:g}, {high:g}]; pass e.g. "
                f"--config.grpo.{key}=1.0."
            )
    if grpo.beta < 0 or not 0 < grpo.epsilon < 1:
        raise ConfigError(
            f"config.grpo.beta={grpo.beta!r}, config.grpo.epsilon={grpo.epsilon!r}: need "
            "beta >= 0 (the KL term's weight) and 0 < epsilon < 1 (the ratio's clipping)."
        )
    return {
        "group_size": group, "num_iterations": iterations, "max_new_tokens": new_tokens,
        "temperature": float(grpo.temperature), "top_k": int(grpo.top_k),
        "top_p": float(grpo.top_p), "epsilon": float(grpo.epsilon), "beta": float(grpo.beta),
    }  # fmt: skip


def reward_function(config: ml_collections.ConfigDict, prompts: PromptRows) -> RewardFn:
    """The function ``config.grpo.reward`` names, imported and tried once on the first
    prompt's fields and a group of empty completions (a completion can be empty: its first
    token the end token): an answer of the wrong shape, a non-finite one or an exception is
    a ``ConfigError`` of one line saying so, before the run writes anything."""
    spec = config.grpo.reward
    if not spec:
        raise ConfigError(
            "config.grpo.reward: name the reward function as module:function "
            "(--config.grpo.reward=my_rewards:exact_sum, my_rewards.py on PYTHONPATH)."
        )
    key = f"config.grpo.reward={spec!r}"
    try:
        reward_fn = load_reward(spec)
    except RewardError as error:
        raise ConfigError(f"{key}: {error}") from None
    group = config.grpo.group_size
    fields = {name: [value] * group for name, value in prompts.fields[0].items()}
    try:  # a raising function is a RewardError too (rewards.score names it)
        score(reward_fn, [prompts.prompts[0]] * group, [""] * group, fields)
    except RewardError as error:
        raise ConfigError(f"{key}: tried on empty completions before the run: {error}") from None
    return reward_fn
