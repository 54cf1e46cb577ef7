"""Chat files to training documents: JSONL conversations read with their ``FILE:LINE``
(``read_conversations``), rendered by a ``data.chat.ChatTokenizer`` and fitted to rows
(``chat_documents``), with what became of each (``ChatCounts``, the run's data line).

A document (``chat_documents``) is ``{"ids": int32[n], "loss_weights": float32[n]}``,
``loss_weights[t]`` the weight of predicting ``ids[t]``; ``data.packing``'s
``pack_documents(..., weighted=True)`` packs them into rows carrying ``loss_weights``
aligned with ``targets``, which the loss multiplies in (docs/topics/chat.md).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Literal

import numpy as np

from nnx_spmd_trainer.data.chat import ChatError, ChatTokenizer, Messages
from nnx_spmd_trainer.data.jsonl import jsonl_rows

__all__ = ["ChatCounts", "chat_documents", "read_conversations"]


def read_conversations(path: str | os.PathLike[str]) -> list[tuple[str, Messages]]:
    """``(where, messages)`` of each row of a JSONL file, ``where`` being ``"FILE:LINE"``.

    Raises ``ChatError`` naming the file and line of a row that is not JSON, has no
    ``messages`` list, or a message without a string ``role`` and ``content``. Blank lines
    are skipped. Roles are checked against a template by ``chat_documents``.
    """
    conversations = []
    for where, row in jsonl_rows(path, ChatError):
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list):
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ChatError(
                f"{where} has no 'messages' list (it has {keys}); each row must be "
                '{"messages": [{"role": ..., "content": ...}, ...]}.'
            )
        for message in messages:
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise ChatError(
                    f"{where}: the message {message!r} needs a string 'role' and 'content'."
                )
        conversations.append((where, messages))
    return conversations


@dataclasses.dataclass(frozen=True)
class ChatCounts:
    """What became of a chat file's conversations (the run's data line).

    Attributes:
      conversations: rows read.
      kept: conversations that became documents (``cut`` ones included).
      cut: longer than a row, cut after their last assistant turn that fits.
      too_long: longer than a row and dropped (``too_long="drop"``, or no turn fits).
      no_assistant: skipped: no token for the loss to train (never trained as zero loss).
      tokens, trained: tokens of the kept documents, and of those the assistant's.
    """

    conversations: int = 0
    kept: int = 0
    cut: int = 0
    too_long: int = 0
    no_assistant: int = 0
    tokens: int = 0
    trained: int = 0

    def line(self, source: str, seq_len: int) -> str:
        """``"chat: ..."``, the data line of a dry run and a run's start."""
        return (
            f"chat: {self.kept} of {self.conversations} conversations from {source} "
            f"({self.cut} cut at a turn to fit {seq_len} tokens, {self.too_long} too long "
            f"dropped, {self.no_assistant} without an assistant token skipped); "
            f"{self.trained} assistant tokens trained of {self.tokens}"
        )


def chat_documents(
    conversations: Iterable[tuple[str, Messages]],
    tokenizer: ChatTokenizer,
    seq_len: int,
    *,
    too_long: Literal["cut", "drop"] = "cut",
) -> tuple[list[dict[str, np.ndarray]], ChatCounts]:
    """Weighted documents (``{"ids", "loss_weights"}``) of conversations, each fitting a
    row of ``seq_len`` (input, target) pairs, and what became of them.

    Args:
      conversations: ``(where, messages)`` pairs (``read_conversations``).
      tokenizer: renders them and finds the assistant's tokens.
      seq_len: pairs a row holds: a document has at most ``seq_len + 1`` tokens.
      too_long: a longer conversation is ``"cut"`` after its last assistant turn that
        fits (dropped if none does), or dropped (``"drop"``).

    Raises ``ChatError`` naming the row of an unknown role or a template that fails.
    """
    if too_long not in ("cut", "drop"):
        raise ChatError(f"too_long={too_long!r}: a long conversation is 'cut' or 'drop'ped.")
    documents = []
    counts = dict.fromkeys((f.name for f in dataclasses.fields(ChatCounts)), 0)
    for where, messages in conversations:
        counts["conversations"] += 1
        for message in messages:
            if message["role"] not in tokenizer.roles:
                raise ChatError(
                    f"{where}: unknown role {message['role']!r}; this template reads "
                    f"{', '.join(tokenizer.roles)}."
                )
        try:
            encoded = tokenizer.encode(messages)
        except ChatError as error:
            raise ChatError(f"{where}: {error}") from None
        except Exception as error:  # the template's own raise_exception, a Jinja error
            raise ChatError(f"{where}: the chat template fails ({error}).") from None
        end: int | None = None
        if len(encoded.ids) > seq_len + 1:
            fits = [e for e in encoded.turn_ends if e <= seq_len + 1]
            if too_long == "drop" or not fits:
                counts["too_long"] += 1
                continue
            end = max(fits)
            counts["cut"] += 1
        document = encoded.document(end)
        trained = int(document["loss_weights"][1:].sum())
        if not trained:
            counts["no_assistant"] += 1
            continue
        documents.append(document)
        counts["kept"] += 1
        counts["tokens"] += len(document["ids"])
        counts["trained"] += trained
    return documents, ChatCounts(**counts)
