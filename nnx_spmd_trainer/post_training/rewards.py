"""Rewards for GRPO: a user's Python function, its answers checked, and the advantages
normalised within each group of completions of one prompt.

A reward function has this signature::

    def reward(prompts: list[str], completions: list[str], **fields) -> Sequence[float]

one entry per completion (each prompt repeated once per completion of its group, in
order); ``fields`` holds every other key of the prompt rows (``answer=[...]``), one
value per completion. Without a tokenizer, prompts and completions are token-id lists.
On the command line it is named ``module:function`` (``load_reward``).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "RewardError",
    "RewardFn",
    "check_group_size",
    "group_advantages",
    "load_reward",
    "score",
]

#: ``(prompts, completions, **fields) -> one float per completion``.
RewardFn = Callable[..., Sequence[float]]


class RewardError(ValueError):
    """A reward function that cannot be imported or answered wrongly: one line, the fix."""


def load_reward(spec: str) -> RewardFn:
    """The function ``spec`` names as ``module:function`` (``my_rewards:exact_sum``).

    >>> load_reward("math:fsum")([0.5, 0.25])
    0.75
    """
    module_name, colon, name = spec.partition(":")
    if not colon or not module_name or not name:
        raise RewardError(
            f"reward {spec!r}: name it as module:function (e.g. my_rewards:exact_sum)."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise RewardError(
            f"reward {spec!r}: module {module_name!r} cannot be imported ({error}); put it "
            "on PYTHONPATH or fix the name."
        ) from error
    function = getattr(module, name, None)
    if not callable(function):
        raise RewardError(
            f"reward {spec!r}: module {module_name!r} has no function {name!r}; fix the name."
        )
    return function  # type: ignore[no-any-return]


def score(
    reward_fn: RewardFn,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    fields: dict[str, list[Any]],
) -> np.ndarray:
    """``reward_fn``'s answer as float32 ``[completions]``, or a ``RewardError`` of one
    line saying what it raised, or returned and what was expected (a non-finite reward
    included: no step is taken on it)."""
    name = getattr(reward_fn, "__qualname__", repr(reward_fn))
    try:
        answer = reward_fn(list(prompts), list(completions), **fields)
    except Exception as error:  # noqa: BLE001 -- the user's function: named in one line
        said = str(error).splitlines()[0] if str(error) else ""
        raise RewardError(
            f"reward function {name} raised {type(error).__name__}"
            f"{': ' + said[:200] if said else ''} on {len(completions)} completions; it "
            "must score any completion (an empty one included) with a finite float."
        ) from error
    expected = f"a sequence of {len(completions)} finite floats, one per completion"
    try:
        rewards = np.asarray(answer, dtype=np.float32)
    except (TypeError, ValueError) as error:
        raise RewardError(
            f"reward function {name} returned {type(answer).__name__} {answer!r:.80}; "
            f"expected {expected}."
        ) from error
    if rewards.shape != (len(completions),):
        raise RewardError(
            f"reward function {name} returned {type(answer).__name__} of shape "
            f"{rewards.shape}; expected {expected}."
        )
    if not np.isfinite(rewards).all():
        raise RewardError(
            f"reward function {name} returned a non-finite reward "
            f"({rewards[~np.isfinite(rewards)][0]} for completion "
            f"{int(np.flatnonzero(~np.isfinite(rewards))[0])}); expected {expected}."
        )
    return rewards


def group_advantages(rewards: np.ndarray, group_size: int, eps: float = 1e-4) -> np.ndarray:
    """``(r - mean) / (std + eps)`` within each group of ``group_size`` consecutive rewards
    (the group's sample standard deviation, ``ddof=1``, as TRL's GRPOTrainer).

    >>> [round(float(a), 3) for a in group_advantages(np.array([1.0, 0.0, 2.0, 2.0]), 2)]
    [0.707, -0.707, 0.0, 0.0]
    """
    if group_size < 2 or rewards.size % group_size:
        raise ValueError(
            f"group_advantages: {rewards.size} rewards in groups of {group_size}; a group "
            "needs >= 2 completions and the rewards a whole number of groups."
        )
    groups = rewards.reshape(-1, group_size).astype(np.float64)
    mean = groups.mean(axis=1, keepdims=True)
    std = groups.std(axis=1, ddof=1, keepdims=True)
    return ((groups - mean) / (std + eps)).reshape(-1).astype(np.float32)


def check_group_size(group_size: int) -> None:
    """A ``ValueError`` for a group that cannot be normalised (fewer than two)."""
    if not isinstance(group_size, int) or group_size < 2 or math.isnan(group_size):
        raise ValueError(
            f"group_size={group_size!r}: GRPO normalises rewards within a group of "
            "completions of one prompt, so a group needs >= 2; pass group_size=4 or more."
        )
