"""Weighted mixtures of named row sources, with weights that change at given steps.

Which source row ``k`` of the global batch at step ``s`` comes from is a
counter-based hash of ``(seed, s * global_batch_size + k)`` against the weights of
the stage ``s`` is in: nothing but the step decides it. A source's position (the
rows it has given) at step ``s`` is then the count of its rows before step
``s``, the same on every process, so:

- the data position a checkpoint saves is the step alone (``{"next_index": s}``,
  the form the library sets on another process count, ``data.BATCHES_TAKEN``);
  every source's position follows from it (``Mixture.positions``);
- a run stopped mid-stage resumes bitwise, on the same or another process count:
  process ``i`` of ``n`` feeds the global rows ``k = i, i + n, ...`` of each step,
  as ``grain_pipeline`` does, and reads only those rows of the sources.

A source is any random-access source of rows (``len`` and ``[i]``: a list, a
``grain.MapDataset``, a ``grain.sources`` source). Each is read in its own
seeded shuffle, a new permutation every epoch (Grain's ``shuffle`` then
``repeat``), so a small source repeats while a large one goes on.

>>> mix = Mixture({"a": [0] * 10, "b": [1] * 10}, {"a": 3, "b": 1}, global_batch_size=4)
>>> batches = iter(mix)
>>> sum(int(next(batches).sum()) for _ in range(1000)) / 4000  # the share of "b"
0.2575
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import grain
import numpy as np

from nnx_spmd_trainer.data_shard import DataShard

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
_REPLAY_ROWS = 1 << 20  # rows hashed at once when positions are replayed from a step


class MixtureError(ValueError):
    """Mixture weights that do not match the sources, are negative, or are all zero."""


class Stage(NamedTuple):
    """The weights from step ``start`` on (until the next stage's start)."""

    start: int
    weights: Mapping[str, float]


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A counter-based hash of ``uint64`` counters (SplitMix64's finaliser): uniform bits,
    no state."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return x ^ (x >> np.uint64(31))


def _stages(
    weights: Mapping[str, float] | Iterable[Stage | tuple[int, Mapping[str, float]]],
    names: list[str],
    max_steps: int | None = None,
) -> list[Stage]:
    """The stages in order, each checked against the sources' names (and, given the steps
    the run trains, refused where it would never start)."""
    stages = [Stage(0, weights)] if isinstance(weights, Mapping) else [Stage(*s) for s in weights]
    stages.sort(key=lambda stage: stage.start)
    if not stages or stages[0].start != 0:
        raise MixtureError("The first stage of a mixture must start at step 0.")
    if len({stage.start for stage in stages}) != len(stages):
        raise MixtureError(f"Two stages start at the same step: {[s.start for s in stages]}.")
    for stage in stages:
        missing, unknown = set(names) - set(stage.weights), set(stage.weights) - set(names)
        if missing or unknown:
            raise MixtureError(
                f"The weights of the stage from step {stage.start} do not match the sources "
                f"{names}: missing {sorted(missing)}, unknown {sorted(unknown)}. Give every "
                "source a weight (0 leaves it out of the stage)."
            )
        values = [float(stage.weights[name]) for name in names]
        if any(not math.isfinite(v) or v < 0 for v in values):
            raise MixtureError(
                f"Mixture weights must be finite and non-negative; the stage from step "
                f"{stage.start} has {dict(stage.weights)}."
            )
        if sum(values) == 0:
            raise MixtureError(f"The weights of the stage from step {stage.start} are all zero.")
    unreached = [stage.start for stage in stages if max_steps and stage.start >= max_steps]
    if unreached and max_steps:
        raise MixtureError(
            f"The stage from step {unreached[0]} ({dict(stages[-len(unreached)].weights)}) "
            f"never starts: the run trains steps 0 to {max_steps - 1} (max_steps={max_steps}); "
            f"start it before step {max_steps}, or train for more steps."
        )
    return stages


class Mixture(grain.IterDataset):  # type: ignore[type-arg]
    """Batches of this process's rows of a weighted mixture of sources.

    Args:
      sources: name -> random-access source of rows (arrays or dicts of arrays of one shape).
      weights: name -> weight (need not sum to 1), or ``Stage``s / ``(start_step, weights)``
        pairs, the first starting at step 0.
      global_batch_size: rows per step over all processes.
      shard: which rows this process feeds (``trainer.placement.data_shard``).
      seed: the seed of the row-to-source hash and of each source's shuffle.
      max_steps: the steps the run trains (``fit``'s ``max_steps``), when known: a stage
        starting at or after it would never be reached and is refused (``MixtureError``).
    """

    def __init__(
        self,
        sources: Mapping[str, Any],
        weights: Mapping[str, float] | Iterable[Stage | tuple[int, Mapping[str, float]]],
        *,
        global_batch_size: int,
        shard: DataShard | tuple[int, int] = (0, 1),
        seed: int = 0,
        max_steps: int | None = None,
    ) -> None:
        super().__init__()
        self.names = list(sources)
        if not self.names:
            raise MixtureError("A mixture needs at least one source.")
        empty = [name for name in self.names if len(sources[name]) == 0]
        if empty:
            raise MixtureError(f"The sources {empty} are empty.")
        self.stages = _stages(weights, self.names, max_steps)
        index, count = shard
        if global_batch_size % count:
            raise ValueError(
                f"A global batch of {global_batch_size} rows cannot be split between "
                f"{count} processes; use a multiple of {count}."
            )
        self.global_batch_size, self.shard, self.seed = (
            global_batch_size,
            DataShard(index, count),
            seed,
        )
        self.sources = {name: sources[name] for name in self.names}
        # each source its own shuffle, a new permutation every epoch; seeded by name, so
        # adding a source leaves the others' orders alone
        self._rows = {
            name: grain.MapDataset.source(source)
            .shuffle(seed=(seed + zlib.crc32(name.encode())) % (1 << 31))
            .repeat(None)
            for name, source in self.sources.items()
        }
        self._key = _splitmix64(np.array([seed], dtype=np.uint64))[0]
        self._cumulative = [
            np.cumsum([float(s.weights[n]) for n in self.names]) / sum(s.weights.values())
            for s in self.stages
        ]

    def _stage_at(self, step: int) -> int:
        return max(i for i, stage in enumerate(self.stages) if stage.start <= step)

    def _source_ids(self, rows: np.ndarray, stage: int) -> np.ndarray:
        """The source index of each global row number (all in one stage)."""
        uniform = (_splitmix64(rows.astype(np.uint64) ^ self._key) >> np.uint64(11)) * 2.0**-53
        ids = np.searchsorted(self._cumulative[stage], uniform, side="right")
        return np.minimum(ids, len(self.names) - 1)  # a cumulative sum short of 1.0 by rounding

    def source_ids(self, step: int) -> np.ndarray:
        """The source index (into ``names``) of every row of the global batch at ``step``."""
        first = step * self.global_batch_size
        return self._source_ids(
            np.arange(first, first + self.global_batch_size), self._stage_at(step)
        )

    def positions(self, step: int) -> dict[str, int]:
        """Rows each source has given before ``step`` (replayed from the hash, in bounded
        memory: a checkpoint needs only the step)."""
        counts = np.zeros(len(self.names), dtype=np.int64)
        bounds = [s.start for s in self.stages[1:]] + [math.inf]
        for stage, end in enumerate(bounds):
            start_row = self.stages[stage].start * self.global_batch_size
            end_row = min(end, step) * self.global_batch_size
            for first in range(start_row, int(end_row), _REPLAY_ROWS):
                rows = np.arange(first, min(first + _REPLAY_ROWS, int(end_row)))
                counts += np.bincount(self._source_ids(rows, stage), minlength=len(self.names))
            if end >= step:
                break
        return dict(zip(self.names, counts.tolist(), strict=True))

    def epochs(self, steps: int) -> dict[str, float]:
        """How many times each source is read through in ``steps`` steps (for a dry run)."""
        return {name: n / len(self.sources[name]) for name, n in self.positions(steps).items()}

    def _step_rows(self, step: int, counts: np.ndarray) -> tuple[list[Any], np.ndarray]:
        """This process's rows of ``step`` given the sources' positions ``counts`` before it,
        and the positions after it."""
        ids = self.source_ids(step)
        taken = np.zeros((len(ids), len(self.names)), dtype=np.int64)
        taken[np.arange(len(ids)), ids] = 1
        before = counts + np.cumsum(taken, axis=0) - taken  # each row's place in its source
        mine = range(self.shard.index, len(ids), self.shard.count)
        rows = [self._rows[self.names[ids[k]]][int(before[k, ids[k]])] for k in mine]
        return rows, counts + taken.sum(axis=0)

    def __iter__(self) -> MixtureIterator:
        return MixtureIterator(self)

    def __str__(self) -> str:
        return f"Mixture(names={self.names}, stages={len(self.stages)})"


def _stack(rows: list[Any]) -> Any:
    if isinstance(rows[0], Mapping):
        return {key: np.stack([row[key] for row in rows]) for key in rows[0]}
    return np.stack(rows)


class MixtureIterator(grain.DatasetIterator):  # type: ignore[type-arg]
    """A mixture's batches from a step on; its position is ``{"next_index": step}``."""

    def __init__(self, mixture: Mixture) -> None:
        super().__init__()
        self._mixture = mixture
        self._step = 0
        self._counts = np.zeros(len(mixture.names), dtype=np.int64)

    def __next__(self) -> Any:
        rows, self._counts = self._mixture._step_rows(self._step, self._counts)
        self._step += 1
        return _stack(rows)

    def get_state(self) -> dict[str, Any]:
        return {"next_index": self._step}

    def set_state(self, state: dict[str, Any]) -> None:
        self._step = int(state["next_index"])
        positions = self._mixture.positions(self._step)
        self._counts = np.array([positions[n] for n in self._mixture.names], dtype=np.int64)

    def positions(self) -> dict[str, int]:
        """Rows each source has given so far."""
        return dict(zip(self._mixture.names, self._counts.tolist(), strict=True))
