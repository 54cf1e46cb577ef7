"""``nnx-spmd-train corpus``: text files into a tokenized corpus the trainer reads.

    nnx-spmd-train corpus notes/ more.txt --out corpora/notes --vocab_size 8192
    nnx-spmd-train corpus web.jsonl --out corpora/web --tokenizer corpora/notes
    python -m nnx_spmd_trainer.app.corpus IN... --out DIR [--tokenizer PATH | --vocab_size N]

Each file is a document, each line of a ``.jsonl`` file is one (its
``--jsonl_field``), and a folder stands for its files. Without ``--tokenizer`` a
byte-level BPE of ``--vocab_size`` ids is trained on the inputs first (or the one
a stopped write saved in ``--out`` is reused). ``data.write_corpus`` writes with a
progress bar; run the same command again after a stop and it continues. Train on
it with ``--config.data.corpus=DIR`` (several: ``name=DIR,name=DIR`` and
``--config.data.weights``).

A bad input (no such file, a tokenizer that does not load) is one line on stderr
and exit status 2, as every refusal of ``nnx-spmd-train``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from nnx_spmd_trainer.app.command_line import fail
from nnx_spmd_trainer.data.corpus import CorpusError, write_corpus
from nnx_spmd_trainer.data.tokenizer import (
    TOKENIZER_FILE,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    train_bpe,
)

__all__ = ["main", "parser"]


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
        "--vocab_size", type=int, default=8192, help="without --tokenizer: the BPE's ids"
    )
    commands.add_argument("--jsonl_field", default="text", help="the field of a .jsonl line")
    commands.add_argument("--no_progress", action="store_true", help="no progress bar")
    return commands


def _files(inputs: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for item in map(Path, inputs):
        if not item.exists():
            raise FileNotFoundError(f"{item} does not exist")
        files += sorted(p for p in item.rglob("*") if p.is_file()) if item.is_dir() else [item]
    return files


def _texts(files: Sequence[Path], field: str) -> Iterator[str]:
    """The documents' texts, for training the tokenizer."""
    for path in files:
        if path.suffix != ".jsonl":
            yield path.read_text(encoding="utf-8")
            continue
        with path.open(encoding="utf-8") as lines:
            yield from (str(json.loads(line).get(field, "")) for line in lines if line.strip())


def _tokenizer(args: argparse.Namespace, files: Sequence[Path]) -> Tokenizer:
    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    saved = Path(args.out) / TOKENIZER_FILE
    if saved.is_file():  # a stopped write: continue with the tokenizer it started with
        return load_tokenizer(saved)
    return train_bpe(texts=_texts(files, args.jsonl_field), vocab_size=args.vocab_size)


def main(argv: Sequence[str] | None = None) -> int:
    """Writes the corpus; returns 0, or exits 2 with one line naming a bad input."""
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        files = _files(args.inputs)
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
    print(
        f"corpus {corpus.directory}: {len(corpus)} documents, {corpus.n_tokens} tokens, "
        f"vocabulary {corpus.vocab_size} ({corpus.directory / TOKENIZER_FILE}); train on it "
        f"with --config.data.corpus={corpus.directory}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
