"""Conversations to token ids and a per-token loss weight: chat data, the loss on the
assistant's tokens only.

A conversation is a JSONL row ``{"messages": [{"role", "content"}, ...]}`` (roles
``system``, ``user``, ``assistant``, and ``tool`` where the template speaks of tools).
It is rendered with the model's own chat template by Hugging Face transformers'
``apply_chat_template`` (the ``[chat]`` extra; no torch): the template in the
``tokenizer_config.json`` beside a ``tokenizer.json``, or ``CHATML_TEMPLATE`` for the
library's own BPE tokenizers when the user chooses it. No template engine is written here.

Which tokens the loss trains (the assistant mask): the assistant's content and its
end-of-turn token, as the model must write them after the generation prompt.

- A template with ``{% generation %}`` markers: what they enclose
  (``return_assistant_tokens_mask=True``).
- A template without them (stock Llama-3, Qwen3, Gemma): each assistant turn is found
  by rendering the conversation before it with the generation prompt (where the turn
  starts) and the conversation ending with it (the turn as the model writes it: a
  think block, the content, the end token). Templates that render an earlier turn
  otherwise once more turns follow (Qwen3 drops its think block) are read where the
  turn's content ends in the whole conversation (found by rendering it once more
  with a probe character after that content). The end text is the end token(s)
  without the whitespace after them (``<|im_end|>``, not its newline): what a model
  generates before it stops.

Conversation files become training documents in ``data.conversations``.

>>> from nnx_spmd_trainer.data.tokenizer import EOS_TOKEN, train_bpe
>>> bpe = train_bpe(texts=["hi", "hello"], vocab_size=300,
...                 special_tokens=(EOS_TOKEN, *CHATML_TOKENS))
>>> tokenizer = ChatTokenizer.from_tokenizer(bpe)  # CHATML_TEMPLATE
>>> document = tokenizer.encode([{"role": "user", "content": "hi"},
...                              {"role": "assistant", "content": "hello"}])
>>> tokenizer.decode(document.ids[document.assistant])
'hello<|im_end|>'
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nnx_spmd_trainer.data.tokenizer import TOKENIZER_FILE, Tokenizer

__all__ = [
    "CHATML_TEMPLATE",
    "CHATML_TOKENS",
    "ChatDocument",
    "ChatError",
    "ChatTokenizer",
    "load_chat_tokenizer",
]

#: The roles every template is given; ``tool`` too where the template mentions tools.
ROLES = ("system", "user", "assistant")

#: The special tokens ``CHATML_TEMPLATE`` writes: train a BPE with them
#: (``train_bpe(..., special_tokens=(EOS_TOKEN, *CHATML_TOKENS))``).
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")

#: The library's default template (ChatML, with generation markers), for a tokenizer
#: that has none: ``ChatTokenizer.from_tokenizer(tokenizer)`` or ``template="chatml"``.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# transformers' own test for a template's generation markers
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
# appended to one content to find where that content ends in the rendered text
_PROBE = "\x00"
# what a template's end of turn looks like when it is meant to be one token
_TAG = re.compile(r"<[^<>\s]+>")

Messages = list[dict[str, Any]]


class ChatError(ValueError):
    """A conversation, a chat file or a chat template that cannot be read."""


def _transformers() -> Any:
    # transformers says at import that PyTorch was not found, an advisory notice (its
    # TRANSFORMERS_NO_ADVISORY_WARNINGS): templates and tokenizers need no torch, so every
    # chat command would print it for nothing. Set for the import only.
    advisory = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    before = os.environ.get(advisory)
    os.environ[advisory] = "1"
    try:
        import transformers
    except ImportError:
        raise ChatError(
            "Chat data is rendered by Hugging Face transformers' apply_chat_template; "
            "install it with: pip install 'nnx-spmd-trainer[chat]'"
        ) from None
    finally:
        if before is None:
            del os.environ[advisory]
        else:
            os.environ[advisory] = before
    return transformers


@dataclasses.dataclass(frozen=True)
class ChatDocument:
    """One conversation's tokens and which of them the assistant writes.

    Attributes:
      ids: the rendered conversation's token ids, ``int32[n]``.
      assistant: ``bool[n]``, the tokens the loss trains (content and end tokens).
    """

    ids: np.ndarray
    assistant: np.ndarray

    @property
    def turn_ends(self) -> list[int]:
        """The token index just after each assistant turn (where a cut keeps whole turns)."""
        mask = self.assistant.astype(np.int8)
        return [int(i) + 1 for i in np.flatnonzero(mask[:-1] > mask[1:])] + (
            [len(mask)] if len(mask) and mask[-1] else []
        )

    def document(self, end: int | None = None) -> dict[str, np.ndarray]:
        """``{"ids", "loss_weights"}`` of the first ``end`` tokens (``pack_documents``'s)."""
        return {
            "ids": self.ids[:end],
            "loss_weights": self.assistant[:end].astype(np.float32),
        }


class ChatTokenizer:
    """A tokenizer and the chat template it renders conversations with.

    The template's special tokens (ChatML's ``<|im_start|>`` and ``<|im_end|>``, and the
    end of an assistant turn, ``<|eot_id|>``, ``<end_of_turn>``) must each be one token of
    the tokenizer: split into byte pieces, a marker costs ten tokens a turn and the end of
    turn could never end a generation. A tokenizer without them is refused (``ChatError``
    saying the fix), or, with ``add_tokens=True``, given them as added special tokens at
    the end of its vocabulary (``vocab_size`` grows: a model trained before has no rows
    for them).

    Args:
      backend: a transformers tokenizer (``PreTrainedTokenizerFast``) with ``chat_template``.
      add_tokens: add the template's special tokens the tokenizer lacks, rather than refuse.

    Attributes:
      template: the chat template's Jinja text.
      markers: whether it has ``{% generation %}`` markers (which then give the mask).
      roles: the roles a conversation may use (``tool`` where the template mentions it).
      end_of_turn: the token that ends an assistant turn (``"<|im_end|>"``; ``None``
        where the template ends it with no such token): what generation stops at.

    >>> from nnx_spmd_trainer.data.tokenizer import EOS_TOKEN, train_bpe
    >>> bpe = train_bpe(texts=["hi"], vocab_size=260, special_tokens=(EOS_TOKEN, *CHATML_TOKENS))
    >>> ChatTokenizer.from_tokenizer(bpe).end_of_turn
    '<|im_end|>'
    >>> plain = train_bpe(texts=["hi"], vocab_size=260)
    >>> grown = ChatTokenizer.from_tokenizer(plain, add_tokens=True)
    >>> grown.vocab_size - plain.vocab_size, grown.end_of_turn_id == plain.vocab_size + 1
    (2, True)
    """

    def __init__(self, backend: Any, *, add_tokens: bool = False) -> None:
        if not getattr(backend, "chat_template", None):
            raise ChatError(
                "The tokenizer has no chat template; give a tokenizer_config.json with one "
                "beside the tokenizer.json, or choose the library's default "
                "(template='chatml', --config.data.chat_template=chatml)."
            )
        self.backend = backend
        self.template: str = backend.chat_template
        self.markers = bool(_GENERATION.search(self.template))
        self.roles = ROLES + (("tool",) if "tool" in self.template else ())
        self.end_of_turn = self._end_of_turn_text()
        wanted = [t for t in CHATML_TOKENS if t in self.template]
        if self.end_of_turn is not None and self.end_of_turn not in wanted:
            wanted.append(self.end_of_turn)
        split = {t: n for t in wanted if (n := self._pieces(t)) != 1}
        if split and add_tokens:
            backend.add_tokens(list(split), special_tokens=True)
            split = {t: n for t in wanted if (n := self._pieces(t)) != 1}
        if split:
            pieces = ", ".join(
                f"{t!r} into {n} pieces" if n else f"{t!r} unknown" for t, n in split.items()
            )
            raise ChatError(
                f"The chat template writes {', '.join(map(repr, split))}, which this "
                f"tokenizer of {self.vocab_size} ids has no single token for: each would be "
                f"read as text ({pieces}) and the turn's end could never end a generation. Use a "
                "tokenizer with them as special tokens (train_bpe(..., special_tokens="
                "(EOS_TOKEN, *CHATML_TOKENS)); the default job's BPE has ChatML's), or add "
                "them (add_tokens=True; the vocabulary grows, and a model trained before "
                "has no rows for them)."
            )

    def _end_of_turn_text(self) -> str | None:
        """What the template writes after an assistant's content to end the turn, where it
        is one tag (``<|im_end|>``); ``None`` otherwise or where it cannot say."""
        turn: Messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
        try:
            text = self.render(turn)
            after = text[_common_prefix(text, self.render(_probed(turn, 1))) :].split()
        except Exception:  # a template that needs more (a system turn, tools): no end known
            return None
        return after[0] if after and _TAG.fullmatch(after[0]) else None

    def _pieces(self, text: str) -> int:
        """The tokens ``text`` is encoded into: 1 where it is a token of its own, 0 where
        it becomes one unknown token."""
        ids = self.backend(text, add_special_tokens=False)["input_ids"]
        if ids == [self.backend.get_vocab().get(text)]:
            return 1
        return 0 if len(ids) == 1 else len(ids)

    @property
    def end_of_turn_id(self) -> int | None:
        """The id of ``end_of_turn`` (``None`` where there is none)."""
        if self.end_of_turn is None:
            return None
        return int(self.backend.convert_tokens_to_ids(self.end_of_turn))

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Tokenizer, template: str = "chatml", *, add_tokens: bool = False
    ) -> ChatTokenizer:
        """The library's own ``Tokenizer`` with ``template``: ``"chatml"``
        (``CHATML_TEMPLATE``, whose ``CHATML_TOKENS`` the tokenizer must have as special
        tokens, or be given with ``add_tokens``) or a template's Jinja text."""
        backend = _transformers().PreTrainedTokenizerFast(
            tokenizer_object=tokenizer.backend, chat_template=_template_text(template)
        )
        return cls(backend, add_tokens=add_tokens)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, its added tokens included."""
        return len(self.backend)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """``ids -> str``, special tokens kept."""
        return str(self.backend.decode(np.asarray(ids).ravel().tolist()))

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Writes the tokenizer and its template (``save_pretrained``); returns the
        ``tokenizer.json`` path (what ``data.load_tokenizer`` reads)."""
        self.backend.save_pretrained(os.fspath(directory))
        return Path(directory) / TOKENIZER_FILE

    def render(self, messages: Messages, *, generation_prompt: bool = False) -> str:
        """The conversation as the template writes it."""
        return str(
            self.backend.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        )

    def encode_text(self, text: str) -> np.ndarray:
        """``str -> int32 ids`` of text as it is (no template; special tokens read as such)."""
        ids = self.backend(text, add_special_tokens=False)["input_ids"]
        return np.asarray(ids, np.int32)

    def prompt_ids(self, messages: Messages | str) -> np.ndarray:
        """The ids of ``messages`` rendered with the generation prompt: what a model
        continues with the assistant's answer (``nnx-spmd-train generate`` on a chat run).

        ``messages`` may be a plain prompt: one user message."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self.encode_text(self.render(messages, generation_prompt=True))

    def encode(self, messages: Messages) -> ChatDocument:
        """The conversation's ids and its assistant mask (the module docstring says how)."""
        if self.markers:
            encoded = self.backend.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids, mask = encoded["input_ids"], encoded["assistant_masks"]
            return ChatDocument(np.asarray(ids, np.int32), np.asarray(mask, bool))
        text = self.render(messages)
        encoded = self.backend(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = np.asarray(encoded["offset_mapping"], np.int64).reshape(-1, 2)
        mask = np.zeros(len(offsets), bool)
        for start, end in self._assistant_spans(messages, text):
            mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
        return ChatDocument(np.asarray(encoded["input_ids"], np.int32), mask)

    def _assistant_spans(self, messages: Messages, text: str) -> list[tuple[int, int]]:
        """The characters of ``text`` (the whole conversation) each assistant turn writes."""
        spans = []
        for number, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:number], generation_prompt=True)
            if not text.startswith(prompt):
                raise ChatError(
                    f"The chat template renders message {number}'s generation prompt otherwise "
                    "than the conversation around it, so its assistant turn cannot be found; "
                    "add {% generation %} markers around the assistant's part of the template."
                )
            content_end = _common_prefix(text, self.render(_probed(messages, number)))
            alone = messages[: number + 1]
            alone_end = _common_prefix(self.render(alone), self.render(_probed(alone, number)))
            end_text = self.render(alone)[alone_end:].rstrip()
            if not text.startswith(end_text, content_end):
                raise ChatError(
                    f"The chat template ends assistant message {number} with {end_text!r} when "
                    "it ends the conversation and otherwise when more follows; add "
                    "{% generation %} markers around the assistant's part of the template."
                )
            spans.append((len(prompt), content_end + len(end_text)))
        return spans

    def __repr__(self) -> str:
        markers = "generation markers" if self.markers else "no generation markers"
        return f"ChatTokenizer(vocab_size={self.vocab_size}, {markers}, roles={self.roles})"


def _probed(messages: Messages, number: int) -> Messages:
    """``messages`` with a probe character after message ``number``'s content."""
    probed = dict(messages[number], content=messages[number]["content"] + _PROBE)
    return [*messages[:number], probed, *messages[number + 1 :]]


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of two strings.

    >>> _common_prefix("abcd", "abxd")
    2
    """
    return len(os.path.commonprefix([a, b]))


def load_chat_tokenizer(
    path: str | os.PathLike[str], *, template: str | None = None, add_tokens: bool = False
) -> ChatTokenizer:
    """The tokenizer in a ``tokenizer.json`` (or its folder) and the chat template in the
    ``tokenizer_config.json`` (or ``chat_template.jinja``) beside it.

    Args:
      path: a ``tokenizer.json`` or the folder holding it.
      template: ``None``: the tokenizer's own; ``"chatml"``: ``CHATML_TEMPLATE``; else
        the Jinja text of a template.
      add_tokens: add the template's special tokens the tokenizer lacks (``ChatTokenizer``).
    """
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    if not (folder / TOKENIZER_FILE).is_file():
        raise ChatError(f"No {TOKENIZER_FILE} in {folder} to render chat data with.")
    transformers = _transformers()
    try:
        backend = transformers.PreTrainedTokenizerFast.from_pretrained(os.fspath(folder))
    except (OSError, ValueError) as error:
        raise ChatError(f"The tokenizer in {folder} does not load ({error}).") from None
    if template is not None:
        backend.chat_template = _template_text(template)
    return ChatTokenizer(backend, add_tokens=add_tokens)


def _template_text(template: str) -> str:
    if template == "chatml":
        return CHATML_TEMPLATE
    if "{" not in template:
        raise ChatError(
            f"template={template!r} is neither 'chatml' (the library's default) nor the "
            "Jinja text of a chat template."
        )
    return template
