"""``nnx-spmd-train corpus``: text files into a tokenized corpus the trainer reads.

    nnx-spmd-train corpus notes/ more.txt --out corpora/notes --vocab_size 1024
    nnx-spmd-train corpus web.jsonl --out corpora/web --tokenizer corpora/notes
    python -m nnx_spmd_trainer.app.corpus IN... --out DIR [--tokenizer PATH | --vocab_size N]

Each file is a document, each line of a ``.jsonl`` file is one (its
``--jsonl_field``), and a folder stands for its files; a file that is not UTF-8
text (a binary file in a folder of documents) is skipped, named on a line, and
counted in the summary. Without ``--tokenizer`` a byte-level BPE of
``--vocab_size`` ids is trained on the inputs first (a line says so before it
starts; or the one a stopped write saved in ``--out`` is reused). The default
vocabulary is the default job's (``config.data.vocab_size``, 1024): the model's
embedding and output layer grow with the vocabulary, and so does each step's
time. ``data.write_corpus`` writes with a progress bar of the documents; run the
same command again after a stop and it continues. Train on it with
``--config.data.corpus=DIR`` (several: ``name=DIR,name=DIR`` and
``--config.data.weights``).

A bad input (no such file, no text file at all, a tokenizer that does not load, a
JSON line without the field) is one line on stderr and exit status 2, as every
refusal of ``nnx-spmd-train``, and leaves no half-written corpus behind.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from nnx_spmd_trainer.app.command_line import fail
from nnx_spmd_trainer.configs.default import data_config
from nnx_spmd_trainer.data import (
    CHATML_TOKENS,
    EOS_TOKEN,
    TOKENIZER_FILE,
    CorpusError,
    Tokenizer,
    TokenizerError,
    expand_inputs,
    load_tokenizer,
    read_documents,
    text_files,
    train_bpe,
    write_corpus,
)

__all__ = ["DEFAULT_VOCAB_SIZE", "main", "parser"]

#: ``--vocab_size``'s default: the default job's own (``config.data.vocab_size``), so a
#: corpus written with the defaults trains at the speed the docs' examples show.
DEFAULT_VOCAB_SIZE: int = data_config().vocab_size

_NAMED = 3  # skipped files named on their line; the rest counted


def parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    commands = argparse.ArgumentParser(
        prog="nnx-spmd-train corpus",
        description="Tokenize text files (one document each; a .jsonl line each) into a "
        "corpus folder for --config.data.corpus.",
    )
    commands.add_argument("inputs", nargs="+", help="text or .jsonl files, or folders of them")
    commands.add_argument("--out", required=True, help="the corpus folder to write")
    commands.add_argument("--tokenizer", help="a tokenizer.json (or its folder) to tokenize with")
    commands.add_argument(
        "--vocab_size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help="without --tokenizer: the BPE's ids (default: the default job's, "
        f"{DEFAULT_VOCAB_SIZE}; a larger one makes the model's embedding and output layer "
        "larger and each step slower)",
    )
    commands.add_argument("--jsonl_field", default="text", help="the field of a .jsonl line")
    commands.add_argument("--no_progress", action="store_true", help="no progress bar")
    return commands


def _files(inputs: Sequence[str]) -> tuple[list[Path], list[tuple[str, str]]]:
    """The UTF-8 text files of ``inputs`` (a folder stands for its files), and the files
    skipped, each with why; nothing to tokenize is a ``CorpusError``."""
    for item in map(Path, inputs):
        if not item.exists():
            raise FileNotFoundError(f"{item} does not exist")
    files = expand_inputs(inputs)
    if not files:
        raise CorpusError(
            f"no files in {' '.join(inputs)}: nothing to tokenize; give text or .jsonl "
            "files, or folders that hold them."
        )
    texts, skipped = text_files(files)
    if not texts:
        raise CorpusError(
            f"none of the {len(files)} files in {' '.join(inputs)} is UTF-8 text (e.g. "
            f"{skipped[0][0]}: {skipped[0][1]}): nothing to tokenize."
        )
    return [Path(p) for p in texts], skipped


def _skipped_line(skipped: Sequence[tuple[str, str]]) -> str:
    """``corpus: skipped 2 files that are not UTF-8 text: a.gz (byte 0x8b at offset 1), ...``"""
    named = ", ".join(f"{path} ({why})" for path, why in skipped[:_NAMED])
    more = f" and {len(skipped) - _NAMED} more" if len(skipped) > _NAMED else ""
    files = "file that is" if len(skipped) == 1 else "files that are"
    return f"corpus: skipped {len(skipped)} {files} not UTF-8 text: {named}{more}"


def _texts(files: Sequence[Path], field: str) -> Iterator[str]:
    """The documents' texts, for training the tokenizer (a bad JSON line named, as the
    writer names it)."""
    yield from (text for text, _ in read_documents([os.fspath(p) for p in files], field, [0, 0]))


def _tokenizer(args: argparse.Namespace, files: Sequence[Path]) -> Tokenizer:
    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    saved = Path(args.out) / TOKENIZER_FILE
    if saved.is_file():  # a stopped write: continue with the tokenizer it started with
        return load_tokenizer(saved)
    megabytes = sum(os.path.getsize(p) for p in files) / 1e6
    print(  # the Rust trainer says nothing while it works (seconds per 10 MB here)
        f"corpus: training a byte-level BPE of {args.vocab_size} ids on {len(files)} files "
        f"({megabytes:.1f} MB) ...",
        flush=True,
    )
    start = time.perf_counter()
    # ChatML's markers reserved too: a chat fine-tune of a model trained on this corpus
    # writes each as one token (docs/topics/chat.md)
    special = (EOS_TOKEN, *CHATML_TOKENS)
    texts = _texts(files, args.jsonl_field)
    tokenizer = train_bpe(texts=texts, vocab_size=args.vocab_size, special_tokens=special)
    print(f"corpus: BPE trained in {time.perf_counter() - start:.1f} s", flush=True)
    return tokenizer


def main(argv: Sequence[str] | None = None) -> int:
    """Writes the corpus; returns 0, or exits 2 with one line naming a bad input."""
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        files, skipped = _files(args.inputs)
        if skipped:
            print(_skipped_line(skipped), flush=True)
        tokenizer = _tokenizer(args, files)
        corpus = write_corpus(
            files,
            args.out,
            tokenizer,
            jsonl_field=args.jsonl_field,
            progress=not args.no_progress,
        )
    except (CorpusError, TokenizerError, OSError, ValueError) as error:
        fail(f"corpus: {error}")
    left_out = f" ({len(skipped)} files skipped: not UTF-8 text)" if skipped else ""
    print(
        f"corpus {corpus.directory}: {len(corpus)} documents{left_out}, {corpus.n_tokens} "
        f"tokens, vocabulary {corpus.vocab_size} ({corpus.directory / TOKENIZER_FILE}); "
        f"train on it with --config.data.corpus={corpus.directory}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
