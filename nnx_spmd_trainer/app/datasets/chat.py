"""A GPT job's chat data (``--config.data.chat=FILE.jsonl``): conversations rendered with the
tokenizer's chat template, the loss on the assistant's tokens (``data.chat``).

``config.data`` keys read here (``configs/default.py``):

- ``chat``: the JSONL file of ``{"messages": [...]}`` rows.
- ``tokenizer``: the ``tokenizer.json`` (or its folder) whose ``tokenizer_config.json``
  holds the template; ``""`` trains a byte-level BPE of ``vocab_size`` ids on the
  conversations, with ChatML's special tokens (it has no template of its own).
- ``chat_template``: ``""``: the tokenizer's own; ``"chatml"``: the library's default.
- ``chat_too_long``: a conversation longer than a row is ``"cut"`` at a turn or ``"drop"``-ped.

The last ``eval_fraction`` of the conversations (at least one) is held out, packed into
fixed batches the same way. Every bad input is a ``ConfigError`` naming its key (the CLI's
exit 2), raised before anything is written.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import grain
import ml_collections
import numpy as np

from nnx_spmd_trainer.app.datasets.base import Batch, Splits
from nnx_spmd_trainer.app.datasets.text import SplitOptions
from nnx_spmd_trainer.app.run_config import ConfigError
from nnx_spmd_trainer.data import (
    CHATML_TOKENS,
    EOS_TOKEN,
    ChatError,
    ChatTokenizer,
    PackedBlocks,
    Tokenizer,
    chat_documents,
    load_chat_tokenizer,
    pack_documents,
    read_conversations,
    train_bpe,
)

__all__ = ["chat_splits", "run_chat_tokenizer"]

Document = dict[str, np.ndarray]


def run_chat_tokenizer(
    data: ml_collections.ConfigDict, base: Callable[[], Tokenizer | None], whose: str
) -> ChatTokenizer:
    """A chat job's tokenizer, for SFT and preference rows alike: ``config.data.tokenizer``'s
    own (its template, or ``config.data.chat_template``); else ``base()`` (the run's BPE, or
    one trained here) with ``config.data.chat_template``. A ``ChatError`` names the fix;
    ``whose`` says which tokenizer lacks a template when none is given."""
    path, template = data.get("tokenizer", ""), data.get("chat_template", "") or None
    if path:
        try:
            return load_chat_tokenizer(path, template=template)
        except ChatError as error:
            try:  # refused for the template's special tokens alone? Say the CLI's fix too.
                load_chat_tokenizer(path, template=template, add_tokens=True)
            except ChatError:
                raise error from None
            raise ChatError(
                f"{error} Here config.data.tokenizer={path!r} (with --config.init_from, that "
                "run's) lacks them: start from a run of the default job's BPE or of a corpus "
                "written by nnx-spmd-train corpus (both have ChatML's tokens), or give "
                "--config.data.tokenizer=<a tokenizer.json with them>."
            ) from None
    if template is None or (tokenizer := base()) is None:
        raise ChatError(
            f"{whose} has no chat template; choose the library's default with "
            "--config.data.chat_template=chatml, or give --config.data.tokenizer=DIR holding "
            "a tokenizer_config.json with one."
        )
    return ChatTokenizer.from_tokenizer(tokenizer, template)


def _chat_tokenizer(data: ml_collections.ConfigDict, conversations: list) -> ChatTokenizer:
    def trained_bpe() -> Tokenizer:
        return train_bpe(
            texts=(m["content"] for _, messages in conversations for m in messages),
            vocab_size=data.get("vocab_size", 1024),
            special_tokens=(EOS_TOKEN, *CHATML_TOKENS),
        )

    return run_chat_tokenizer(data, trained_bpe, "config.data.tokenizer='' trains a BPE, which")


def _held_out_batches(
    documents: Sequence[Document],
    seq_len: int,
    batch_size: int,
    shard: tuple[int, int],
    limit: int | None,
) -> list[Batch]:
    """Fixed batches of the held-out documents packed into rows (this process's rows of
    each); the last batch filled with empty rows (segment 0, weight 0: never scored)."""
    index, count = shard
    source = grain.MapDataset.source(list(documents))
    packer = pack_documents(
        source, seq_len, weighted=True, num_packing_bins=batch_size * count, shuffle_bins=False
    )
    rows = list(packer)
    per_batch = batch_size * count
    empty = {key: np.zeros_like(value) for key, value in rows[0].items()}
    rows += [empty] * (-len(rows) % per_batch)
    batches = []
    for start in itertools.islice(range(0, len(rows), per_batch), limit):
        mine = rows[start + index * batch_size : start + (index + 1) * batch_size]
        batches.append({key: np.stack([row[key] for row in mine]) for key in mine[0]})
    return batches


def _assistant_targets(documents: Sequence[Document]) -> np.ndarray:
    return np.concatenate([d["ids"][1:][d["loss_weights"][1:] > 0] for d in documents])


def chat_splits(
    config: ml_collections.ConfigDict, options: SplitOptions, model_vocab: int
) -> tuple[int, Splits]:
    """``(the tokenizer's vocabulary, the splits)`` of ``config.data.chat``.

    ``model_vocab``: the model's vocabulary (``config.gpt.vocab_size``; 0: the
    tokenizer's), which every id must fit.
    """
    data = config.data
    path, too_long = data.chat, data.get("chat_too_long", "cut")
    seq_len, shard = options["seq_len"], options.get("shard", (0, 1))
    try:
        conversations = read_conversations(path)
        tokenizer = _chat_tokenizer(data, conversations)
        documents, counts = chat_documents(conversations, tokenizer, seq_len, too_long=too_long)
    except OSError as error:
        raise ConfigError(f"config.data.chat={path!r}: {error}") from None
    except ChatError as error:
        raise ConfigError(f"config.data.chat={path!r}: {error}") from None
    if len(documents) < 2:
        raise ConfigError(
            f"config.data.chat={path!r}: {len(documents)} conversation(s) to train on "
            "(one to train, one to hold out at least); " + counts.line(path, seq_len)
        )
    if model_vocab and (too_big := max(int(d["ids"].max()) for d in documents)) >= model_vocab:
        raise ConfigError(
            f"config.data.chat={path!r}: the tokenizer writes id {too_big}, beyond the model's "
            f"vocabulary (config.gpt.vocab_size={model_vocab}); use 0 for the tokenizer's."
        )
    held = min(max(1, int(len(documents) * options.get("eval_fraction", 0.1))), len(documents) - 1)
    train, held_out = documents[:-held], documents[-held:]
    eval_batches = _held_out_batches(
        held_out, seq_len, options["batch_size"], shard, options.get("max_eval_batches")
    )
    train_rows = PackedBlocks(  # the same rows on any process count
        train,
        seq_len,
        options["batch_size"] * shard[1],
        shard,
        seed=options["seed"],
        packed=data.get("packed", True),
        weighted=True,
    )
    counts_by_id = np.bincount(_assistant_targets(train), minlength=tokenizer.vocab_size)
    targets = _assistant_targets(held_out)
    log_probs = np.log(counts_by_id + 1.0) - np.log((counts_by_id + 1.0).sum())
    text_bytes = sum(
        len(tokenizer.decode(d["ids"][1:][d["loss_weights"][1:] > 0]).encode()) for d in held_out
    )
    summary = (counts.line(path, seq_len) + f"; {len(train)} trained on, {held} held out",)
    splits = Splits(
        train_rows,
        eval_batches,
        float(-log_probs[targets].mean()),
        "unigram baseline of the assistant's tokens",
        text_bytes / len(targets),
        tokenizer,
    )
    return tokenizer.vocab_size, dataclasses.replace(splits, summary=summary)
