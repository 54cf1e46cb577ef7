"""How many times each line of compiled HLO text runs in one execution of the program.

XLA's text lists a loop's body once: a ``lax.scan`` over 12 stacked layers is one
``while`` whose body (with each layer's all-gathers, under FSDP) runs 12 times, and the
TPU compiler's windowed matmuls are loops of collective-permutes inside it. XLA:CPU and
GPU write the count in the loop's backend config (``"known_trip_count"``); the TPU
compiler writes none, and it is read from the loop's condition (``counter < N``). The
collectives a report counts are each line's, times its runs.

Computations are printed callees first (XLA prints them in post order), the ``ENTRY``
one last, so one pass from the end gives every computation its runs: the sum, over the
instructions that call it, of their computation's runs times the loop's trip count (a
``while``'s body and condition) or 1 (a fusion, a call, a reducer, each branch of a
conditional: an upper bound there). A loop whose trip count is read neither way counts
once, as before.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator

__all__ = ["lines_with_runs"]

#: A computation's first line: ``%name (params) -> type {`` or ``ENTRY %name (...) ... {``.
_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
#: The computations an instruction runs: ``body=%b``, ``calls=%f``,
#: ``branch_computations={%a, %b}``.
_CALLEES = re.compile(
    r"\b(?P<role>body|condition|calls|to_apply|branch_computations|called_computations)="
    r"(?:\{(?P<many>[^}]*)\}|%?(?P<one>[\w.\-]+))"
)
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONDITION = re.compile(r"\bcondition=%?(?P<name>[\w.\-]+)")
#: A loop condition ``counter < N``, the form a ``lax.scan``/``fori_loop`` and XLA's own
#: windowed loops take: its root compares a tuple element with a constant.
_COUNTER_BELOW = re.compile(
    r"ROOT\s.*compare\(%?[\w.\-]+,\s*%?(?P<limit>[\w.\-]+)\),\s*direction=LT\b"
)
_CONSTANT = re.compile(r"^\s*%?(?P<name>[\w.\-]+)\s*=\s*[su]\d+\[\]\S*\s+constant\((?P<n>\d+)\)")


def _split(hlo_text: str) -> tuple[list[str], dict[str, list[str]], list[str], str | None]:
    """(lines outside any computation, each computation's lines, their names in order,
    the entry computation's name)."""
    outside: list[str] = []
    entry: str | None = None
    bodies: dict[str, list[str]] = {}
    order: list[str] = []
    current: list[str] | None = None
    for line in hlo_text.splitlines():
        if current is None and (header := _HEADER.match(line)) is not None:
            name = header["name"]
            entry = name if header["entry"] else entry
            order.append(name)
            current = bodies.setdefault(name, [])
            current.append(line)
        elif current is not None:
            current.append(line)
            if line.strip() == "}":
                current = None
        else:
            outside.append(line)
    return outside, bodies, order, entry


def _trip_count(line: str, bodies: dict[str, list[str]]) -> int | None:
    """The times the ``while`` on ``line`` runs its body: the compiler's
    ``known_trip_count`` (XLA:CPU and GPU write it), else ``N`` from a condition
    ``counter < N`` (the TPU compiler writes none), the counter taken to start at 0 and
    step by 1 as a scan's and XLA's windowed loops' do; ``None`` when neither is read."""
    if (known := _TRIP_COUNT.search(line)) is not None:
        return int(known.group(1))
    if (condition := _CONDITION.search(line)) is None:
        return None
    lines = bodies.get(condition["name"], [])
    limits = [m["limit"] for m in map(_COUNTER_BELOW.search, lines) if m is not None]
    constants = {m["name"]: int(m["n"]) for m in map(_CONSTANT.match, lines) if m is not None}
    return constants.get(limits[0].lstrip("%")) if len(limits) == 1 else None


def _runs(bodies: dict[str, list[str]], order: list[str], entry: str | None) -> dict[str, int]:
    runs: dict[str, int] = defaultdict(int)
    if entry is not None:
        runs[entry] = 1
    for name in reversed(order):  # callers after their callees in the text
        for line in bodies[name][1:]:
            trips = _trip_count(line, bodies) if " while(" in line else None
            for match in _CALLEES.finditer(line):
                times = runs[name]
                if trips is not None and match["role"] == "body":
                    times *= trips
                elif trips is not None and match["role"] == "condition":
                    times *= trips + 1  # once more, to end the loop
                names = [match["one"]] if match["one"] else match["many"].split(",")
                for callee in names:
                    runs[callee.strip().lstrip("%")] += times
    # A computation no line was read to call (a form of call not known here): once, as
    # every computation counted before loops were.
    return {name: runs[name] or 1 for name in order}


def lines_with_runs(hlo_text: str) -> Iterator[tuple[str, int]]:
    """Each line of ``hlo_text`` with the times it runs per execution of the program.

    >>> hlo = chr(10).join([
    ...     "%body (p: f32[4]) -> f32[4] {",
    ...     "  %ag = f32[4]{0} all-gather(%p), dimensions={0}",
    ...     "}",
    ...     "%cond (p: f32[4]) -> pred[] {",
    ...     "  %c = pred[] constant(true)",
    ...     "}",
    ...     "ENTRY %main (x: f32[4]) -> f32[4] {",
    ...     '  %w = f32[4]{0} while(%x), condition=%cond, body=%body, '
    ...     'backend_config={"known_trip_count":{"n":"12"}}',
    ...     "}",
    ... ])
    >>> [(line.split("=")[0].strip(), n) for line, n in lines_with_runs(hlo) if " = " in line]
    [('%ag', 12), ('%c', 13), ('%w', 1)]
    """
    outside, bodies, order, entry = _split(hlo_text)
    runs = _runs(bodies, order, entry)
    for line in outside:
        yield line, 1
    for name in order:
        for line in bodies[name]:
            yield line, runs[name]
