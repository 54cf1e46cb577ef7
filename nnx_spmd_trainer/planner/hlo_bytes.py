"""The bytes a compiled program moves through memory that XLA's cost analysis leaves out:
a loop body's second and later runs.

``cost_analysis()["bytes accessed"]`` counts each instruction once, so a ``lax.scan``
over 12 stacked layers is charged for one layer's reads and writes (the FLOPs have the
same flaw; ``flop_count`` counts them from the jaxpr instead). ``repeated_loop_bytes``
estimates each instruction's bytes from the compiled HLO text, the way XLA's own
analysis charges them, and adds them once per further run of the loop it sits in
(``hlo_runs``): the step's bytes are then the compiler's count plus this.

What an instruction moves, as XLA's ``HloCostAnalysis`` reckons it: its operands read
and its result written. A fusion reads a parameter that only feeds slices by those
slices' bytes (a scan's body takes its layer from the stacked weights by a dynamic
slice: one layer read, not all), and a fusion whose root updates a slice in place writes
the update, not the buffer. Tuples, bitcasts, parameters and the like move nothing.
"""

from __future__ import annotations

import math
import re

from nnx_spmd_trainer.planner.hlo_runs import computations_with_runs

__all__ = ["array_bytes", "once_bytes", "repeated_loop_bytes"]

_ARRAY_TYPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1}
#: ``%name = type op(operands), attributes``; a tuple type may hold spaces.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>\([^=]*?\)|\S+)\s+"
    r"(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)(?P<attributes>.*)$"
)
_OPERAND = re.compile(r"%?([\w.\-]+)")
_CALLED = re.compile(r"\b(?P<role>body|condition|calls|to_apply|branch_computations)="
                     r"(?:\{(?P<many>[^}]*)\}|%?(?P<one>[\w.\-]+))")  # fmt: skip
#: Instructions that move no bytes of their own: names for buffers, or control whose
#: computations are counted themselves (a loop's body, a call's callee).
_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
    "conditional", "after-all", "partition-id", "replica-id", "add-dependency",
    "opt-barrier",
}  # fmt: skip
#: Readers that take part of their first operand, and updates that write part of it in
#: place (the operand they write: the update's position).
_SLICES = {"slice", "dynamic-slice", "gather"}
_UPDATE_OPERAND = {"dynamic-update-slice": 1, "scatter": 2}


def _itemsize(dtype: str) -> int:
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    bits = re.search(r"(\d+)$", dtype)
    return int(bits.group(1)) // 8 if bits else 4


def array_bytes(types: str) -> list[int]:
    """The bytes of each array in an HLO type: ``f32[4,8]{1,0}`` or a tuple of them.

    >>> array_bytes("(bf16[4,8]{1,0}, s32[])")
    [64, 4]
    """
    return [
        _itemsize(dtype) * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY_TYPE.findall(types)
    ]


class _Instruction:
    """One parsed line: its name, type's bytes, op, operand names and attributes."""

    def __init__(self, match: re.Match[str]) -> None:
        self.name = match["name"]
        self.bytes = sum(array_bytes(match["type"]))
        self.op = match["op"]
        inside = match["operands"]  # a parameter's and a constant's: its number, no names
        self.number = int(inside) if self.op == "parameter" and inside.isdigit() else None
        self.operands = [] if self.op in ("parameter", "constant") else _OPERAND.findall(inside)
        self.attributes = match["attributes"]


def _parse(lines: list[str]) -> tuple[list[_Instruction], _Instruction | None]:
    """A computation's instructions, and its root (the ``ROOT`` line)."""
    instructions, root = [], None
    for line in lines[1:]:
        if (match := _INSTRUCTION.match(line)) is None:
            continue
        instruction = _Instruction(match)
        instructions.append(instruction)
        if line.lstrip().startswith("ROOT"):
            root = instruction
    return instructions, root


def _through_bitcasts(name: str, users: dict[str, list[_Instruction]]) -> list[_Instruction]:
    """The instructions that read ``name``, looking through bitcasts."""
    found = []
    for user in users.get(name, []):
        found += _through_bitcasts(user.name, users) if user.op == "bitcast" else [user]
    return found


def _fusion_bytes(fusion: _Instruction, operand_bytes: list[int], lines: list[str]) -> int:
    """What a fusion moves: each operand by what its parameter's readers take (only
    slices: their bytes; only the root's in-place update: nothing), and its result (an
    in-place update: the update's bytes)."""
    instructions, root = _parse(lines)
    by_name = {i.name: i for i in instructions}
    users: dict[str, list[_Instruction]] = {}
    for instruction in instructions:
        for operand in instruction.operands:
            users.setdefault(operand, []).append(instruction)
    while root is not None and root.op == "bitcast" and root.operands[0] in by_name:
        root = by_name[root.operands[0]]
    in_place = root if root is not None and root.op in _UPDATE_OPERAND else None
    read = 0
    for parameter in (i for i in instructions if i.op == "parameter"):
        index = parameter.number if parameter.number is not None else len(operand_bytes)
        full = operand_bytes[index] if index < len(operand_bytes) else parameter.bytes
        readers = _through_bitcasts(parameter.name, users)
        taken = [r for r in readers if _first_operand(r, by_name) == parameter.name]
        if readers and taken == readers and all(r.op in _SLICES for r in readers):
            read += min(full, sum(r.bytes for r in readers))
        elif not (in_place is not None and taken == readers == [in_place]):
            read += full  # else: the buffer updated in place, not read
    if in_place is not None:
        update = in_place.operands[_UPDATE_OPERAND[in_place.op]:][:1]
        if update and update[0] in by_name:
            return read + by_name[update[0]].bytes
    return read + fusion.bytes


def _first_operand(user: _Instruction, by_name: dict[str, _Instruction]) -> str:
    """The name of ``user``'s first operand, looking through bitcasts: the buffer a slice
    reads or an update writes (its other operands are the update and the indices)."""
    name = user.operands[0] if user.operands else ""
    while name in by_name and by_name[name].op == "bitcast":
        name = by_name[name].operands[0]
    return name


def _instruction_bytes(
    instruction: _Instruction, types: dict[str, int], computations: dict[str, list[str]]
) -> int:
    op = instruction.op
    if op in _FREE or op.endswith("-done"):
        return 0
    operands = [types.get(name, 0) for name in instruction.operands]
    if op.endswith("-start"):  # its result holds the operands and the outputs
        return instruction.bytes
    if op == "dynamic-slice":
        return 2 * instruction.bytes
    if op == "dynamic-update-slice":
        return 2 * (operands[1] if len(operands) > 1 else 0)
    if op == "fusion" and (called := _CALLED.search(instruction.attributes)) is not None:
        return _fusion_bytes(instruction, operands, computations.get(called["one"] or "", []))
    return sum(operands) + instruction.bytes


def repeated_loop_bytes(hlo_text: str) -> int:
    """Bytes the loops of compiled ``hlo_text`` move on their runs after the first, which
    ``cost_analysis()`` leaves out: a body's instructions, each times its runs less one.

    A loop whose trip count is read neither way (``hlo_runs``) adds nothing: as before.
    """
    return sum((runs - 1) * moved for moved, runs in _computation_bytes(hlo_text))


def once_bytes(hlo_text: str) -> int:
    """Bytes one run of each computation of compiled ``hlo_text`` moves, a loop's body
    counted once: the estimate of what ``cost_analysis()`` reports."""
    return sum(moved for moved, _ in _computation_bytes(hlo_text))


def _computation_bytes(hlo_text: str) -> list[tuple[int, int]]:
    """(bytes one run moves, runs) of each computation whose instructions touch memory:
    the entry, and what its loops, branches and calls run, transitively (a fusion's or a
    reducer's inside is not: the fusion's operands and result are its traffic)."""
    hlo_text = re.sub(r"/\*.*?\*/", "", hlo_text)  # /*index=5*/ inside long tuple types
    found, entry = computations_with_runs(hlo_text)
    computations = {name: lines for name, (lines, _) in found.items()}
    control, todo = [], [entry] if entry is not None else []
    while todo:
        name = todo.pop()
        if name in control or name not in computations:
            continue
        control.append(name)
        for instruction in _parse(computations[name])[0]:
            if instruction.op not in ("while", "conditional", "call"):
                continue
            for called in _CALLED.finditer(instruction.attributes):
                names = [called["one"]] if called["one"] else called["many"].split(",")
                todo += [n.strip().lstrip("%") for n in names]
    counted = []
    for name in control:
        lines, runs = found[name]
        instructions = _parse(lines)[0]
        types = {i.name: i.bytes for i in instructions}
        moved = sum(_instruction_bytes(i, types, computations) for i in instructions)
        counted.append((moved, runs))
    return counted
