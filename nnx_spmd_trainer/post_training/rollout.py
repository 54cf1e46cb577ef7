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

from nnx_spmd_trainer.data.jsonl import jsonl_rows

__all__ = ["PromptRows", "prompt_batches", "read_prompts", "rollout_batch"]


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
