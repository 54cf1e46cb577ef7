"""``nnx_spmd_trainer.data``: the data-facing names a user imports, from one place.

The data room: the path a batch takes, from text to the devices (tokenizer ->
corpus -> packing -> mixture -> batches -> placement -> prefetch; the data position
and its checkpoint item). This package's own namespace is public: each name lives in
the module of its job and is re-exported here. The core imports from the homes:

- ``batches.py``: ``place_batch`` (``check_batch`` then ``transfer_batch``),
  ``rows_multiple``, ``pad_batch``;
- ``batch_errors.py``: ``BatchMismatch`` (also ``nnx_spmd_trainer.BatchMismatch``);
- ``position.py``: ``BATCHES_TAKEN``, the ``RunState.data`` of a Grain
  position saved under another process count;
- ``tokenizer.py``: ``Tokenizer``, ``train_bpe``, ``load_tokenizer``, ``TokenizerError``,
  ``EOS_TOKEN`` (the end of a document), ``TOKENIZER_FILE`` (its name in a corpus or run);
- ``corpus.py``: ``write_corpus``, ``Corpus``, ``CorpusError`` (whose home is
  ``corpus_inputs.py``: the files a corpus is written from, a binary one named:
  ``expand_inputs``, ``text_files``, ``read_documents``), ``TOKENS_FILE``;
- ``reads.py``: ``bytes_read_in_process``, what this process read from corpora on disk;
- ``packing.py``: ``pack_documents``, ``packed_pipeline``, ``padding_share``,
  ``ContiguousRows``;
- ``packed_blocks.py``: ``PackedBlocks``, documents packed block by block into the same
  global rows on any process count (each process reading its rows' documents only);
- ``grain_packed.py``: ``from_grain_packed``, rows packed by Grain's own packers as the
  batch the models take;
- ``mixture.py``: ``Mixture``, ``Stage``, ``MixtureError``
  (docs/topics/corpora.md: from text files to packed, mixed rows);
- ``chat.py``: ``load_chat_tokenizer``, ``ChatTokenizer``, ``ChatDocument``,
  ``ChatError``, ``CHATML_TEMPLATE``, ``CHATML_TOKENS``: a conversation to ids and
  per-token loss weights through the model's chat template (docs/topics/chat.md).
- ``conversations.py``: ``read_conversations``, ``chat_documents``, ``ChatCounts``: a
  JSONL chat file to training documents that fit a row.
- ``jsonl.py``: ``jsonl_rows``, JSONL rows with their ``FILE:LINE`` (the chat, preference
  and prompt readers);
- ``to_host.py``: ``gather_to_host``, arrays gathered whole to every host (a sampler's
  tokens, an export's weights).

The rest is internal (``position.seek`` and ``DataPosition``: a resumed run's data), a line
each:

- ``placement.py``: ``Placement``, batches onto the mesh by the plan's shardings; ``InFlight``
- ``prefetch.py``: ``Prefetch``, batches placed ahead in a thread, the position kept exact
- ``same_rows.py``: processes feeding the same rows, checked by batch fingerprints
- ``to_host.py``: ``delete_arrays``, a candidate's buffers freed at once
- ``grain_input.py``: ``grain_pipeline``, one process's Grain input pipeline
- ``corpus_inputs.py``: ``CorpusError``'s home
- ``batch_reads.py``: the fields a loss read of its batch (unread packing fields refused)
- ``written.py``: ``written_whole``, a file or folder written beside its path and renamed
"""

from nnx_spmd_trainer.data.batch_errors import BatchMismatch
from nnx_spmd_trainer.data.batches import (
    check_batch,
    pad_batch,
    place_batch,
    rows_multiple,
    transfer_batch,
)
from nnx_spmd_trainer.data.chat import (
    CHATML_TEMPLATE,
    CHATML_TOKENS,
    ChatDocument,
    ChatError,
    ChatTokenizer,
    load_chat_tokenizer,
)
from nnx_spmd_trainer.data.conversations import ChatCounts, chat_documents, read_conversations
from nnx_spmd_trainer.data.corpus import TOKENS_FILE, Corpus, CorpusError, write_corpus
from nnx_spmd_trainer.data.corpus_inputs import expand_inputs, read_documents, text_files
from nnx_spmd_trainer.data.grain_packed import from_grain_packed
from nnx_spmd_trainer.data.jsonl import jsonl_rows
from nnx_spmd_trainer.data.mixture import Mixture, MixtureError, Stage
from nnx_spmd_trainer.data.packed_blocks import PackedBlocks
from nnx_spmd_trainer.data.packing import (
    ContiguousRows,
    pack_documents,
    packed_pipeline,
    padding_share,
)
from nnx_spmd_trainer.data.position import BATCHES_TAKEN
from nnx_spmd_trainer.data.reads import bytes_read_in_process
from nnx_spmd_trainer.data.to_host import gather_to_host
from nnx_spmd_trainer.data.tokenizer import (
    EOS_TOKEN,
    TOKENIZER_FILE,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    train_bpe,
)

__all__ = [
    "BATCHES_TAKEN",
    "BatchMismatch",
    "bytes_read_in_process",
    "CHATML_TEMPLATE",
    "CHATML_TOKENS",
    "ChatCounts",
    "ChatDocument",
    "ChatError",
    "ChatTokenizer",
    "ContiguousRows",
    "Corpus",
    "CorpusError",
    "EOS_TOKEN",
    "Mixture",
    "MixtureError",
    "PackedBlocks",
    "Stage",
    "TOKENIZER_FILE",
    "TOKENS_FILE",
    "Tokenizer",
    "TokenizerError",
    "chat_documents",
    "check_batch",
    "expand_inputs",
    "from_grain_packed",
    "gather_to_host",
    "jsonl_rows",
    "load_chat_tokenizer",
    "load_tokenizer",
    "pack_documents",
    "packed_pipeline",
    "pad_batch",
    "padding_share",
    "place_batch",
    "read_conversations",
    "read_documents",
    "rows_multiple",
    "text_files",
    "train_bpe",
    "transfer_batch",
    "write_corpus",
]
