"""``strategy="auto"``'s ranking as text: the table ``Trainer`` prints and TensorBoard's.

Formatting only: a row is anything with a ``Candidate``'s fields (``Row``), so this
module needs nothing of the planner's (``auto`` imports it, not the other way round).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from nnx_spmd_trainer.planner.plan_report import size

HEADER = ["layout", "mesh", "state/device", "peak/device", "step time", "vs best"]


class Row(Protocol):
    """What a ranking row shows (``auto.Candidate`` is one)."""

    @property
    def layout(self) -> str: ...

    mesh: dict[str, int]
    status: str
    reason: str
    state_bytes: int | None
    peak_bytes: int | None
    step_time_s: float | None
    ratio: float | None


def cells(row: Row) -> list[str]:
    """layout, mesh, state, peak, step time, ratio (or why it was not timed)."""
    mesh = " x ".join(f"{k}={v}" for k, v in row.mesh.items()) or "-"
    state = size(row.state_bytes) if row.state_bytes is not None else "-"
    peak = size(row.peak_bytes) if row.peak_bytes is not None else "-"
    if row.step_time_s is None:
        return [row.layout, mesh, state, peak, f"{row.status}: {row.reason}", ""]
    time_text, ratio = f"{row.step_time_s * 1e3:.3f} ms", f"{row.ratio or 1.0:.2f}x"
    return [row.layout, mesh, state, peak, time_text, ratio]


def title(layout: str, budget_bytes: int | None, steps: int, rounds: int, resumed: bool) -> str:
    """The line above the table: what was chosen, within what budget, timed how."""
    budget = f"{size(budget_bytes)} per device" if budget_bytes else "no memory limit"
    if resumed:
        return f'strategy="auto" kept {layout}, the resumed run\'s layout ({budget})'
    return f'strategy="auto" chose {layout} ({budget}; {steps} steps x {rounds} rounds, median)'


def text_table(heading: str, rows: Sequence[Row]) -> str:
    """``heading`` over the rows as aligned text, the first row marked as chosen."""
    lines = [HEADER, *(cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    text = [heading]
    for at, line in enumerate(lines):
        mark = "  <- chosen" if at == 1 else ""
        joined = "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True))
        text.append(f"  {joined.rstrip()}{mark}")
    return "\n".join(text)


def markdown_table(heading: str, rows: Sequence[Row]) -> str:
    """``heading`` over the rows as a Markdown table (TensorBoard's text tab)."""
    lines = [HEADER, ["---"] * len(HEADER), *(cells(row) for row in rows)]
    body = "\n".join("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in lines)
    return f"{heading}\n\n{body}"
