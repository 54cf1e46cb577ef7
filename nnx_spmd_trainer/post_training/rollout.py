"""GRPO's prompts and rollouts on the host: prompt rows read from JSONL, the batches of
row indices ``GRPOTrainer.fit`` takes, and one rollout's sampled completions laid out as
the training batch (prompt + completion, right padded, weights on the completion).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nnx_spmd_trainer.data import jsonl_rows
from nnx_spmd_trainer.data_shard import DataShard

__all__ = [
    "PromptRows",
    "completion_columns",
    "encode_prompt",
    "process_rows",
    "prompt_batches",
    "read_prompts",
    "rollout_batch",
    "sampler_ranks",
]


@dataclasses.dataclass(frozen=True)
class PromptRows:
    """Prompts (text or token ids) and the other fields of each row (handed to the
    reward function as keyword lists)."""

    prompts: list[Any]
    fields: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.prompts)

    @classmethod
    def of(cls, rows: Sequence[dict[str, Any]]) -> PromptRows:
        """``[{"prompt": ..., "answer": ...}, ...]`` -> rows; a row without ``prompt``
        is a ``ValueError`` naming it."""
        for i, row in enumerate(rows):
            if "prompt" not in row:
                raise ValueError(f"prompt row {i} has no 'prompt' key (it has {sorted(row)}).")
        return cls(
            [row["prompt"] for row in rows],
            [{k: v for k, v in row.items() if k != "prompt"} for row in rows],
        )


def read_prompts(path: str | Path) -> PromptRows:
    """The rows of a JSONL file of ``{"prompt": ..., <fields>}``; a line that is not a JSON
    object is a ``ValueError`` naming its line."""
    rows = []
    for where, row in jsonl_rows(path):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a JSON object with 'prompt'.")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompt rows.")
    return PromptRows.of(rows)


def prompt_batches(rows: int, batch_size: int, steps: int, seed: int = 0) -> list[dict[str, Any]]:
    """``steps`` batches ``{"row": int32[batch_size]}`` of prompt indices, each pass over
    the rows in a seeded order: a list, so a resumed ``fit`` seeks into it."""
    rng = np.random.default_rng(seed)
    order: list[int] = []
    while len(order) < batch_size * steps:
        order.extend(rng.permutation(rows).tolist())
    return [
        {"row": np.asarray(order[i * batch_size : (i + 1) * batch_size], np.int32)}
        for i in range(steps)
    ]


def process_rows(rows: int, shard: DataShard) -> slice:
    """The rows of a global batch of ``rows`` that the process ``shard`` names feeds: the
    ``index``-th of ``count`` equal blocks, the order ``Placement.place`` lays its rows
    out in (``count`` 1, as when a model axis spans the processes: every row).

    >>> process_rows(8, DataShard(index=1, count=2)), process_rows(8, DataShard(0, 1))
    (slice(4, 8, None), slice(0, 8, None))
    """
    if rows % shard.count:
        raise ValueError(
            f"{rows} prompts a batch do not split over {shard.count} processes; give a "
            f"multiple of {shard.count}."
        )
    size = rows // shard.count
    return slice(shard.index * size, (shard.index + 1) * size)


def sampler_ranks(rows: np.ndarray) -> np.ndarray:
    """Each prompt index's place in the sampler's batch: the indices in ascending order
    (equal ones in their order in ``rows``). A completion's keys follow its place, so a
    batch whose rows the processes fed interleaved samples as it does fed in one piece.

    >>> sampler_ranks(np.array([7, 2, 9, 2])).tolist()
    [2, 0, 3, 1]
    """
    order = np.argsort(rows, kind="stable")
    ranks = np.empty(len(rows), np.int64)
    ranks[order] = np.arange(len(rows))
    return ranks


def rollout_batch(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    seq_len: int,
) -> dict[str, np.ndarray]:
    """Each ``prompt + completion`` as a causal LM row: ``inputs`` (all but the last token)
    and ``targets`` (all but the first), right padded to ``seq_len``, ``weights`` 1.0 on
    the targets that are completion tokens. Right padding keeps every row's positions
    from 0, as the sampler's left-padded rows have them; causal attention never reads
    the padding after a row."""
    rows = len(prompts)
    inputs = np.zeros((rows, seq_len), np.int32)
    targets = np.zeros((rows, seq_len), np.int32)
    weights = np.zeros((rows, seq_len), np.float32)
    for r, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        tokens = [*prompt, *completion]
        if len(tokens) - 1 > seq_len:
            raise ValueError(
                f"rollout row {r}: {len(tokens)} tokens do not fit seq_len={seq_len} + 1."
            )
        n = len(tokens) - 1
        inputs[r, :n] = tokens[:-1]
        targets[r, :n] = tokens[1:]
        weights[r, len(prompt) - 1 : n] = 1.0
    return {"inputs": inputs, "targets": targets, "weights": weights}


def completion_columns(
    prompts: Sequence[Sequence[int]],
    values: Sequence[Sequence[float]],
    batch: dict[str, np.ndarray],
    fill: float,
) -> np.ndarray:
    """Per-token values of each completion (``values[r]``, one a generated token) laid out
    as ``rollout_batch``'s ``batch`` lays out its targets: row ``r``'s from column
    ``len(prompts[r]) - 1``, ``fill`` elsewhere; float32 ``[rows, seq_len]``."""
    out = np.full(batch["weights"].shape, fill, np.float32)
    for r, (prompt, row) in enumerate(zip(prompts, values, strict=True)):
        start = len(prompt) - 1
        out[r, start : start + len(row)] = row
    return out


def encode_prompt(tokenizer: Any, prompt: Any) -> list[int]:
    """A prompt row's ids: token ids as they are; text (or chat messages, a list of
    ``{"role", "content"}``) through ``tokenizer``, rendered with a chat tokenizer's
    template and generation prompt (``ChatTokenizer.prompt_ids``) where it has one."""
    messages = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
    if not isinstance(prompt, str) and not messages:
        return [int(t) for t in prompt]
    if tokenizer is None:
        raise TypeError("GRPOTrainer: text prompts need tokenizer=...; or give token ids.")
    chat = getattr(tokenizer, "prompt_ids", None)
    if chat is not None:
        return [int(t) for t in chat(prompt)]
    if messages:
        raise TypeError("GRPOTrainer: chat-message prompts need a chat tokenizer (prompt_ids).")
    return [int(t) for t in tokenizer.encode(prompt)]
