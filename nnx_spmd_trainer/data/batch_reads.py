"""What a loss read of its batch: packed rows never trained as if unpacked, a missing key named.

The step hands ``loss_fn`` its batch as a ``ReadBatch`` while jax traces it (once per
compiled step: nothing of it runs per step). A batch that carries a packing field
(``segment_ids``, ``positions``, ``target_segment_ids``, ``loss_weights``, or any
``*_segment_ids`` / ``*_positions``, the names Grain's packers give) which the loss
never read would train its rows as if unpacked: documents attending to each other,
padding trained as targets, with no error. ``refuse_unread`` makes that one line
instead. A key the loss reads and the batch lacks raises ``MissingBatchKey``, naming
the keys the batch has.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax

from nnx_spmd_trainer.nn.packed import PACKING_FIELDS, packing_fields

__all__ = ["MissingBatchKey", "ReadBatch", "refuse_unread", "tracked"]

_GRAIN_HINT = (
    "Rows packed by Grain (grain.experimental.FirstFitPackIterDataset: <feature>_segment_ids, "
    "<feature>_positions) become the batch the models take through "
    "nnx_spmd_trainer.data.from_grain_packed (docs/topics/packing.md)."
)


def _hint(keys: Any) -> str:
    """Grain's converter, when ``keys`` look like its packed rows."""
    grain_like = [k for k in packing_fields(keys) if k not in PACKING_FIELDS]
    return f" {_GRAIN_HINT}" if grain_like else ""


class MissingBatchKey(KeyError, ValueError):
    """A key a loss reads that its batch lacks, with the keys the batch has.

    A ``KeyError`` (a loss that catches one still does) and a ``ValueError`` (bad input).
    """

    def __init__(self, key: Any, has: list[str], reader: str) -> None:
        super().__init__(key)
        self.message = (
            f"{reader} reads batch[{key!r}], which this batch lacks: it has {has}.{_hint(has)}"
        )

    def __str__(self) -> str:
        return self.message


class _Reads:
    """The keys read through one batch and every batch derived from it (``jax.tree.map``);
    compared by identity, so it can sit in a pytree's static data."""

    def __init__(self) -> None:
        self.keys: set[Any] = set()


class ReadBatch(dict[Any, Any]):
    """A batch (a plain ``dict`` to its reader) that records the keys read from it.

    ``batch[key]``, ``get`` and ``pop`` read one key (``in`` reads none); iterating, ``keys``,
    ``values``, ``items`` and ``copy`` read them all (the reader may use any). A
    ``jax.tree.map`` of it is a ``ReadBatch`` recording into the same set; flattening it
    reads nothing.
    """

    def __init__(self, items: Mapping[Any, Any], reads: _Reads, reader: str) -> None:
        super().__init__(items)
        self.reads, self.reader = reads, reader

    def _all(self) -> None:
        self.reads.keys.update(dict.keys(self))

    def __getitem__(self, key: Any) -> Any:
        self.reads.keys.add(key)
        if not dict.__contains__(self, key):
            raise MissingBatchKey(key, sorted(map(str, dict.keys(self))), self.reader)
        return dict.__getitem__(self, key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.reads.keys.add(key)
        return dict.get(self, key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        self.reads.keys.add(key)
        return dict.pop(self, key, *default)

    def __iter__(self) -> Iterator[Any]:
        self._all()
        return dict.__iter__(self)

    def keys(self) -> Any:
        self._all()
        return dict.keys(self)

    def values(self) -> Any:
        self._all()
        return dict.values(self)

    def items(self) -> Any:
        self._all()
        return dict.items(self)

    def copy(self) -> dict[Any, Any]:
        self._all()
        return dict(dict.items(self))


def _flatten(batch: ReadBatch) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
    keys = sorted(dict.keys(batch))
    children = [(jax.tree_util.DictKey(k), dict.__getitem__(batch, k)) for k in keys]
    return children, (tuple(keys), batch.reads, batch.reader)


def _unflatten(static: tuple[Any, ...], children: Any) -> ReadBatch:
    keys, reads, reader = static
    return ReadBatch(dict(zip(keys, children, strict=True)), reads, reader)


jax.tree_util.register_pytree_with_keys(ReadBatch, _flatten, _unflatten)


def tracked(batch: Any, reader: str) -> Any:
    """``batch`` as a ``ReadBatch`` when it is a ``dict``; any other batch as it is."""
    if type(batch) is dict:
        return ReadBatch(batch, _Reads(), reader)
    return batch


def refuse_unread(batch: Any) -> None:
    """Raises a ValueError when ``batch`` (from ``tracked``) carries packing fields its
    reader never read: trained anyway, its rows would count as unpacked."""
    if not isinstance(batch, ReadBatch):
        return
    unread = [k for k in packing_fields(dict.keys(batch)) if k not in batch.reads.keys]
    if unread:
        raise ValueError(
            f"{batch.reader} never read the batch's packing fields {unread}: trained so, the "
            "rows would count as unpacked (documents attending to each other, padding trained "
            "as targets). Pass segment_ids and positions to the model "
            "(nnx_spmd_trainer.nn.packed.packed_inputs) and weight the targets "
            "(nn.packed.token_weights), or drop the fields from the batch."
            f"{_hint(dict.keys(batch))}"
        )
