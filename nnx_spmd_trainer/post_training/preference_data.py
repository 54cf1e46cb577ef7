"""Preference rows (``{"prompt", "chosen", "rejected"}``) to the arrays a DPO step reads.

A row becomes two weighted token sequences (``WeightedTokens``: the prompt's tokens then
a completion's, weight 1 on the completion's tokens only), and a batch of pairs becomes
six arrays (``pair_batch``), ``[rows, seq_len]`` each::

    chosen_inputs,   chosen_targets,   chosen_weights
    rejected_inputs, rejected_targets, rejected_weights

``*_weights[r, t]`` is the weight of predicting ``*_targets[r, t]`` (the ``loss_weights``
contract of ``data.packing``): 1 on a completion's tokens, 0 on the prompt and padding,
so a sequence's log-probability sums the completion's tokens only.

Text rows (``{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}``) are
encoded by ``encode_text_pair``. Chat rows, TRL's conversational preference format::

    {"prompt": [{"role": "user", "content": "What color is the sky?"}],
     "chosen": [{"role": "assistant", "content": "It is blue."}],
     "rejected": [{"role": "assistant", "content": "It is green."}]}

are rendered with the model's chat template by ``encode_chat_pair`` (``data.chat``'s
``ChatTokenizer``: the prompt's messages then a completion's), weight 1 on the
completion's assistant tokens only (its content and end-of-turn token, as
``data.chat`` marks them), never on an earlier assistant turn of the prompt.
``pair_batch`` reads nothing but the ``WeightedTokens`` pairs either gives.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from nnx_spmd_trainer.data import jsonl_rows

if TYPE_CHECKING:
    from nnx_spmd_trainer.data.chat import ChatTokenizer

#: The keys of a preference row.
ROW_KEYS = ("prompt", "chosen", "rejected")
#: The keys of a batch of pairs (``pair_batch``).
BATCH_KEYS = tuple(
    f"{side}_{part}" for side in ("chosen", "rejected") for part in ("inputs", "targets", "weights")
)


class PreferenceError(ValueError):
    """A preference row that cannot be read (the message names the line and the fix)."""


class WeightedTokens(NamedTuple):
    """One sequence: its token ids and the weight of each token in the sequence's
    log-probability (1.0 on a completion's tokens, 0.0 on the prompt's)."""

    tokens: np.ndarray
    weights: np.ndarray


class EncodedPair(NamedTuple):
    """A preference pair as two weighted sequences, the same prompt before each."""

    chosen: WeightedTokens
    rejected: WeightedTokens


@dataclass(frozen=True)
class PreferenceRows:
    """The rows read from a file, and what was left out.

    Attributes:
      rows: the usable rows, in file order.
      identical: rows whose ``chosen`` equals ``rejected`` (no preference), skipped.
    """

    rows: list[dict[str, Any]]
    identical: int = 0

    def line(self) -> str:
        """The data line a run prints: the pairs kept and those skipped."""
        return (
            f"preference data: {len(self.rows)} pairs, {self.identical} skipped "
            "(chosen identical to rejected)"
        )


def is_chat_row(row: Mapping[str, Any]) -> bool:
    """Whether a preference row holds chat messages (lists of ``{"role", "content"}``)
    rather than text: its ``prompt`` is a list."""
    return isinstance(row.get("prompt"), list)


def _check_messages(messages: Any, key: str, where: str) -> None:
    if not isinstance(messages, list) or not all(
        isinstance(m, Mapping)
        and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise PreferenceError(
            f"{where}: {key!r} of a chat row must be a list of {{'role', 'content'}} messages "
            "(strings); give prompt, chosen and rejected all as text or all as messages."
        )
    if key != "prompt" and not any(m["role"] == "assistant" for m in messages):
        raise PreferenceError(
            f"{where}: {key!r} has no assistant message; a completion is "
            '[{"role": "assistant", "content": ...}].'
        )


def with_implicit_prompt(row: Any) -> Any:
    """A row of TRL's implicit-prompt format (``{"chosen", "rejected"}``, no ``prompt``:
    two texts or two lists of messages) split as TRL's ``extract_prompt`` splits it: the
    prompt is what both share from the start, up to their first difference, less a space
    just before it (text); ``chosen`` and ``rejected`` are the rest. Where one is a prefix
    of the other, TRL's loop leaves the last shared item to the completions, and so does
    this. Any other row is returned as it is (``check_row`` judges it).

    >>> with_implicit_prompt({"chosen": "The sky is blue.", "rejected": "The sky is green."})
    {'prompt': 'The sky is', 'chosen': ' blue.', 'rejected': ' green.'}
    """
    if not isinstance(row, Mapping) or "prompt" in row:
        return row
    chosen, rejected = row.get("chosen"), row.get("rejected")
    both = (isinstance(chosen, str) and isinstance(rejected, str)) or (
        isinstance(chosen, list) and isinstance(rejected, list)
    )
    if not both or not chosen or not rejected:
        return row
    cut = 0
    for cut in range(min(len(chosen), len(rejected))):  # TRL's loop, its last index kept
        if chosen[cut] != rejected[cut]:
            if chosen[cut - 1] == " ":  # the space before the completions is theirs
                cut -= 1
            break
    others = {key: value for key, value in row.items() if key not in ROW_KEYS}
    return {"prompt": chosen[:cut], "chosen": chosen[cut:], "rejected": rejected[cut:], **others}


def check_row(row: Any, where: str) -> bool:
    """Whether ``row`` is a usable pair: ``False`` when ``chosen`` equals ``rejected``
    (skipped, counted by the caller); a row that is not one raises ``PreferenceError``.
    A row is text (three strings) or chat (three lists of messages, ``is_chat_row``)."""
    if not isinstance(row, Mapping):
        raise PreferenceError(
            f"{where}: a preference row is a JSON object with {', '.join(ROW_KEYS)}; "
            f"got {type(row).__name__}."
        )
    missing = [key for key in ROW_KEYS if key not in row]
    if missing:
        raise PreferenceError(
            f"{where}: the preference row has no {', '.join(repr(k) for k in missing)}; "
            f"every row needs {', '.join(repr(k) for k in ROW_KEYS)}."
        )
    if is_chat_row(row):
        for key in ROW_KEYS:
            _check_messages(row[key], key, where)
        return bool(row["chosen"] != row["rejected"])
    for key in ROW_KEYS:
        if not isinstance(row[key], str):
            raise PreferenceError(
                f"{where}: {key!r} must be text, got {type(row[key]).__name__}; "
                "give each of prompt, chosen and rejected as a string."
            )
    return bool(row["chosen"] != row["rejected"])


def read_preferences(path: str | os.PathLike[str]) -> PreferenceRows:
    """The rows of a JSONL file of preference pairs, one JSON object a line; rows whose
    ``chosen`` equals ``rejected`` are counted and skipped. A row without ``prompt`` (TRL's
    implicit prompt) is split by ``with_implicit_prompt``. Raises ``PreferenceError``
    naming the line of a row that is not JSON or lacks a key."""
    rows: list[dict[str, Any]] = []
    identical = 0
    for where, read in jsonl_rows(path, PreferenceError):
        row = with_implicit_prompt(read)
        if check_row(row, where):
            rows.append(row)
        else:
            identical += 1
    if not rows:
        raise PreferenceError(f"{path}: no usable preference pair; give rows that differ.")
    return PreferenceRows(rows, identical)


def encode_text_pair(row: Mapping[str, str], encode: Callable[[str], np.ndarray]) -> EncodedPair:
    """A text row as two weighted sequences: ``encode(prompt)`` then ``encode(completion)``,
    weight 1 on the completion's tokens. ``encode``: a tokenizer's ``str -> ids``."""
    prompt = np.asarray(encode(row["prompt"]), np.int32)

    def side(text: str) -> WeightedTokens:
        completion = np.asarray(encode(text), np.int32)
        weights = np.concatenate([np.zeros(len(prompt)), np.ones(len(completion))])
        return WeightedTokens(np.concatenate([prompt, completion]), weights.astype(np.float32))

    return EncodedPair(side(row["chosen"]), side(row["rejected"]))


def encode_chat_pair(row: Mapping[str, Any], tokenizer: ChatTokenizer) -> EncodedPair:
    """A chat row as two weighted sequences: ``prompt + chosen`` and ``prompt + rejected``
    rendered by ``tokenizer``'s chat template (``data.chat.ChatTokenizer.encode``), weight
    1 on the completion's assistant tokens (content and end-of-turn token) and 0 on the
    prompt, an earlier assistant turn of the prompt included.

    Raises ``PreferenceError`` for a role the template does not read, or a completion the
    template renders no assistant token for.
    """
    prompt = list(row["prompt"])
    for message in (*prompt, *row["chosen"], *row["rejected"]):
        if message["role"] not in tokenizer.roles:
            raise PreferenceError(
                f"unknown role {message['role']!r} in a chat preference row; this template "
                f"reads {', '.join(tokenizer.roles)}."
            )
    earlier = sum(message["role"] == "assistant" for message in prompt)

    def side(key: str) -> WeightedTokens:
        document = tokenizer.encode([*prompt, *row[key]])
        mask = document.assistant.astype(bool)
        starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
        if len(starts) <= earlier:
            raise PreferenceError(
                f"the chat template renders no assistant token for the {key} completion; "
                "give it an assistant message the template writes."
            )
        weights = mask.astype(np.float32)
        weights[: starts[earlier]] = 0.0  # the prompt's own assistant turns are context
        return WeightedTokens(np.asarray(document.ids, np.int32), weights)

    return EncodedPair(side("chosen"), side("rejected"))


def _shifted(sequence: WeightedTokens, seq_len: int, pad_id: int) -> tuple[np.ndarray, ...]:
    """``(inputs, targets, weights)`` of one sequence, cut or padded to ``seq_len``: the
    weight of a target is that of the token predicted."""
    tokens, weights = sequence.tokens[: seq_len + 1], sequence.weights[: seq_len + 1]
    inputs = np.full(seq_len, pad_id, np.int32)
    targets = np.full(seq_len, pad_id, np.int32)
    target_weights = np.zeros(seq_len, np.float32)
    n = len(tokens) - 1
    inputs[:n], targets[:n], target_weights[:n] = tokens[:-1], tokens[1:], weights[1:]
    return inputs, targets, target_weights


def pair_batch(pairs: Sequence[EncodedPair], seq_len: int, *, pad_id: int = 0) -> dict[str, Any]:
    """The arrays of a batch of pairs (``BATCH_KEYS``), ``[len(pairs), seq_len]`` each.

    A sequence longer than ``seq_len + 1`` tokens is cut at its end; a pair whose cut
    leaves a side no completion token raises ``PreferenceError`` (give a longer
    ``seq_len`` or shorter prompts).
    """
    columns: dict[str, list[np.ndarray]] = {key: [] for key in BATCH_KEYS}
    for index, pair in enumerate(pairs):
        for side, sequence in zip(("chosen", "rejected"), pair, strict=True):
            inputs, targets, weights = _shifted(sequence, seq_len, pad_id)
            if not weights.any():
                raise PreferenceError(
                    f"pair {index}: its {side} completion does not fit in seq_len={seq_len} "
                    "after the prompt; give a longer seq_len or a shorter prompt."
                )
            columns[f"{side}_inputs"].append(inputs)
            columns[f"{side}_targets"].append(targets)
            columns[f"{side}_weights"].append(weights)
    return {key: np.stack(values) for key, values in columns.items()}


def preference_batches(
    pairs: Sequence[EncodedPair],
    *,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    pad_id: int = 0,
) -> Iterator[dict[str, Any]]:
    """Endless batches of ``batch_size`` pairs, each pass over ``pairs`` in a new order
    drawn from ``seed`` (the same order for the same seed); the last partial batch of a
    pass is left out."""
    if len(pairs) < batch_size:
        raise PreferenceError(
            f"{len(pairs)} pairs cannot fill a batch of {batch_size}; give more pairs or a "
            "smaller batch_size."
        )
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(pairs))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            chosen = [pairs[i] for i in order[start : start + batch_size]]
            yield pair_batch(chosen, seq_len, pad_id=pad_id)
