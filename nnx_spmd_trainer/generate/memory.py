"""What a ``generate`` call holds on each device, before it runs: the compiler's memory
analysis of its prefill and decode programs, and the key-value cache's bytes."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["DecodeMemory", "program_peak"]


def program_peak(compiled: Any) -> int | None:
    """A compiled program's peak bytes per device, as ``Plan.report`` counts a step's:
    arguments + outputs - aliased (donated) + temporaries + code; ``None`` where the
    program has no memory analysis (a strategy's own wrapper that does not lower)."""
    analyse = getattr(compiled, "memory_analysis", None)
    analysis = analyse() if analyse is not None else None
    if analysis is None:
        return None
    return int(
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
        + analysis.generated_code_size_in_bytes
    )


@dataclasses.dataclass(frozen=True)
class DecodeMemory:
    """Per device, for one bucket of ``Sampler.generate`` (``Sampler.memory``).

    Attributes:
      rows, columns, length: the bucket (rows, prompt columns, cache length).
      cache_bytes: the key-value cache (``Sampler.cache_bytes``).
      state_bytes: the model's arrays the programs read.
      prefill_peak: the prefill program's peak (the weights, the prompts, the cache it
        makes, its temporaries); ``None`` where not analysed.
      decode_peak: the decode loop's (the weights, the donated cache, the buffers).
      call_peak: the program a call without stop strings runs: prefill and the decode
        loop as one (``DecodePrograms.whole``); ``None`` where not analysed.
    """

    rows: int
    columns: int
    length: int
    cache_bytes: int
    state_bytes: int
    prefill_peak: int | None
    decode_peak: int | None
    call_peak: int | None = None

    def __str__(self) -> str:
        def mib(n: int | None) -> str:
            return "n/a" if n is None else f"{n / 2**20:,.2f} MiB"

        return (
            f"generate ({self.rows} rows x {self.columns} prompt columns, cache of "
            f"{self.length}), per device: prefill peak {mib(self.prefill_peak)}, decode "
            f"peak {mib(self.decode_peak)}, the two as one program {mib(self.call_peak)}, "
            f"of which the cache {mib(self.cache_bytes)} and the model {mib(self.state_bytes)}"
        )
