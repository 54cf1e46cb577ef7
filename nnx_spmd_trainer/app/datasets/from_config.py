"""A GPT job's text from ``config.data``: the tokenizer, the corpora, the mixture, packing;
every bad input refused as a ``ConfigError`` naming its key, before anything is built.

``config.data`` keys (``configs/default.py``):

- ``tokenizer``: ``""`` trains a byte-level BPE of ``vocab_size`` ids on the pydoc
  topics (or takes the corpus's own ``tokenizer.json``); ``"char"``: one id a
  character (``configs/char.py``); else a ``tokenizer.json`` path or its folder.
- ``corpus``: ``""`` (the pydoc topics), a corpus folder, or ``name=folder,...``.
- ``weights``: ``name=weight,...`` over the corpora (``""``: one corpus, no mixture).
- ``stages``: weights from given steps, ``step:name=w,name=w;step:...``.
- ``packed``: documents packed into rows (``True``), or one document's piece a row.
- ``seq_len``: tokens a row; 0: the model's positions (``config.gpt.seq_len``).
- ``verify``: check every chunk's checksum before training (reads the whole corpus).
- ``chat``, ``chat_template``, ``chat_too_long``: conversations from a JSONL file, the loss
  on the assistant's tokens (``app/datasets/chat.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

import ml_collections

from nnx_spmd_trainer.app.datasets.base import Splits
from nnx_spmd_trainer.app.datasets.chat import chat_splits
from nnx_spmd_trainer.app.datasets.corpora import corpus_splits
from nnx_spmd_trainer.app.datasets.documents import bpe_lm_splits, pydoc_tokenizer
from nnx_spmd_trainer.app.datasets.text import SplitOptions, char_lm_splits
from nnx_spmd_trainer.app.run_config import ConfigError
from nnx_spmd_trainer.data import (
    TOKENIZER_FILE,
    Corpus,
    CorpusError,
    MixtureError,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
)

__all__ = [
    "parse_corpora",
    "parse_stages",
    "run_tokenizer_config",
    "save_run_tokenizer",
    "text_splits",
]


def parse_corpora(spec: str) -> dict[str, str]:
    """``"dir"`` or ``"name=dir,name=dir"`` -> ``{name: dir}`` (a lone folder is named by
    its base name).

    >>> parse_corpora("web=/c/web, code=/c/code")
    {'web': '/c/web', 'code': '/c/code'}
    >>> parse_corpora("/data/wiki/")
    {'wiki': '/data/wiki/'}
    """
    sources: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, equals, path = part.partition("=")
        if not equals:
            name, path = Path(part).name, part
        if name.strip() in sources:
            raise ConfigError(f"config.data.corpus={spec!r} names {name.strip()!r} twice.")
        sources[name.strip()] = path.strip()
    return sources


def _weights(spec: str, key: str) -> dict[str, float]:
    weights: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition("=")
        try:
            weights[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(
                f"{key}: {part!r} is not name=weight (e.g. 'web=3,code=1')."
            ) from None
    return weights


def parse_stages(weights: str, stages: str) -> list[tuple[int, dict[str, float]]]:
    """``config.data.weights`` (from step 0) and ``config.data.stages`` (``step:weights;...``)
    as ``(start_step, weights)`` pairs.

    >>> parse_stages("a=3,b=1", "1000:a=1,b=1")
    [(0, {'a': 3.0, 'b': 1.0}), (1000, {'a': 1.0, 'b': 1.0})]
    """
    pairs = [(0, _weights(weights, f"config.data.weights={weights!r}"))] if weights else []
    for part in filter(None, (p.strip() for p in stages.split(";"))):
        step, colon, rest = part.partition(":")
        if not colon or not step.strip().isdigit():
            raise ConfigError(
                f"config.data.stages={stages!r}: {part!r} is not step:name=weight,... "
                "(e.g. '1000:web=1,code=1')."
            )
        pairs.append((int(step), _weights(rest, f"config.data.stages={stages!r}")))
    return pairs


def _tokenizer(data: ml_collections.ConfigDict, corpora: dict[str, Corpus]) -> Tokenizer:
    """The tokenizer ``config.data.tokenizer`` names, or the corpora's own, or a BPE trained
    on the pydoc topics."""
    path = data.get("tokenizer", "")
    try:
        if path:
            return load_tokenizer(path)
        if corpora:
            return next(iter(corpora.values())).tokenizer()
    except TokenizerError as error:
        raise ConfigError(f"config.data.tokenizer={path!r}: {error}") from None
    try:
        return pydoc_tokenizer(data.get("vocab_size", 1024))
    except ValueError as error:
        raise ConfigError(f"config.data.vocab_size={data.get('vocab_size')!r}: {error}") from None


def _open_corpora(data: ml_collections.ConfigDict) -> dict[str, Corpus]:
    spec = data.get("corpus", "")
    corpora: dict[str, Corpus] = {}
    for name, path in parse_corpora(spec).items():
        try:
            corpora[name] = Corpus(path)
            if data.get("verify", False):
                corpora[name].verify()
        except (CorpusError, OSError, ValueError, KeyError) as error:
            detail = error if isinstance(error, CorpusError | OSError) else f"{path}: {error!r}"
            raise ConfigError(f"config.data.corpus={spec!r}: {detail}") from None
        if len(corpora[name]) < 2:
            raise ConfigError(
                f"config.data.corpus={spec!r}: {path} holds {len(corpora[name])} document(s); "
                "a corpus needs one to train on and one to hold out."
            )
    return corpora


def text_splits(
    config: ml_collections.ConfigDict, options: SplitOptions, model_positions: int
) -> tuple[int, Splits]:
    """``(the vocabulary the ids use, the splits)`` of a GPT job's text.

    Without ``config.data`` (older configs, the GPU benchmark configs) the text is
    characters. Checked here, before the model is built, each a ``ConfigError``:
    a tokenizer file that does not load, a corpus that is truncated or damaged or
    holds ids beyond the model's vocabulary (``config.gpt.vocab_size``), weights
    that do not fit the corpora, a row longer than the model's positions.
    """
    data = config.get("data")
    if data is None or data.get("tokenizer", "") == "char":
        characters, splits = char_lm_splits(**options)
        return characters.vocab_size, splits
    seq_len = data.get("seq_len", 0) or model_positions
    if seq_len > model_positions:
        raise ConfigError(
            f"config.data.seq_len={seq_len} is longer than the model's positions "
            f"(config.gpt.seq_len={model_positions}); use at most that, or 0 for the model's."
        )
    options = SplitOptions(**{**options, "seq_len": seq_len})
    if data.get("chat", ""):  # conversations, the loss on the assistant's tokens
        if data.get("corpus", ""):
            raise ConfigError("config.data.chat and config.data.corpus: give one of them.")
        return chat_splits(config, options, config.gpt.get("vocab_size", 0))
    corpora = _open_corpora(data)
    tokenizer = _tokenizer(data, corpora)
    model_vocab = config.gpt.get("vocab_size", 0) or _padded(tokenizer.vocab_size)
    for name, corpus in corpora.items():
        if corpus.header.get("tokenizer_sha256", tokenizer.sha256) != tokenizer.sha256:
            raise ConfigError(
                f"config.data.corpus ({name}): {corpus.directory} was tokenized with another "
                f"tokenizer than config.data.tokenizer={data.get('tokenizer', '')!r} (its own "
                f"is {corpus.directory}/tokenizer.json); pass --config.data.tokenizer='' to "
                "use it, or write the corpus again with this tokenizer."
            )
        try:
            corpus.check_vocab(model_vocab)
        except CorpusError as error:
            raise ConfigError(f"config.data.corpus ({name}): {error}") from None
    weights, stage_spec = data.get("weights", ""), data.get("stages", "")
    if not corpora:
        if weights or stage_spec:
            raise ConfigError(
                f"config.data.weights={weights!r} / stages={stage_spec!r} weigh corpora, and "
                "config.data.corpus names none; give config.data.corpus=name=dir,..."
            )
        packed = data.get("packed", True)
        splits = bpe_lm_splits(tokenizer, packed=packed, max_steps=config.max_steps, **options)
        return tokenizer.vocab_size, splits
    pairs = parse_stages(weights, stage_spec)
    if not pairs and len(corpora) > 1:
        pairs = [(0, dict.fromkeys(corpora, 1.0))]  # equal weights
    try:
        splits = corpus_splits(
            corpora,
            tokenizer,
            stages=pairs or None,
            max_steps=config.max_steps,
            seq_len=seq_len,
            batch_size=options["batch_size"],
            seed=options["seed"],
            eval_fraction=options.get("eval_fraction", 0.1),
            max_eval_batches=options.get("max_eval_batches"),
            shard=options.get("shard", (0, 1)),
            packed=data.get("packed", True),
        )
    except MixtureError as error:
        raise ConfigError(
            f"config.data.weights={weights!r}, stages={stage_spec!r} over the corpora "
            f"{list(corpora)}: {error}"
        ) from None
    except ValueError as error:
        raise ConfigError(f"config.data: {error}") from None
    return tokenizer.vocab_size, splits


def _padded(vocab_size: int, multiple: int = 8) -> int:
    """The model's vocabulary for a tokenizer's: rounded up so a model axis splits it."""
    return -(-vocab_size // multiple) * multiple


def run_tokenizer_config(
    config: ml_collections.ConfigDict, workdir: str | os.PathLike[str]
) -> ml_collections.ConfigDict:
    """``config`` with ``config.data.tokenizer`` pointing at the run's own
    ``workdir/tokenizer.json`` when the job trains its BPE and resumes a run that saved
    one: a rerun and a resume tokenize with the file the run started with. Otherwise
    ``config`` itself."""
    data = config.get("data")
    saved = Path(workdir) / TOKENIZER_FILE
    if data is None or data.get("tokenizer", "") or data.get("corpus", ""):
        return config
    if not config.get("resume", True) or not saved.is_file():
        return config
    try:
        if load_tokenizer(saved).vocab_size != data.get("vocab_size", 1024):
            return config  # another vocabulary asked for: trained afresh (and the model differs)
    except TokenizerError:
        return config
    copy = ml_collections.ConfigDict(config.to_dict())
    copy.data.tokenizer = os.fspath(saved)
    return copy


def save_run_tokenizer(splits: Splits, workdir: str | os.PathLike[str]) -> None:
    """The tokenizer the run's text was tokenized with, saved as ``workdir/tokenizer.json``,
    so evaluation and prediction decode with the same one."""
    if splits.tokenizer is not None:
        splits.tokenizer.save(workdir)
