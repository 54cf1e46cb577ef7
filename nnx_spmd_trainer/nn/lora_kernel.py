"""What an adaptable layer's kernel dimensions mean, for ``nn.lora``: which multiply the
layer's input and which make its output (einsum letters), read from the layer's kind
(``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``) and, for an einsum, its equation."""

from __future__ import annotations

import dataclasses
import string
from typing import Any

from flax import nnx

__all__ = [
    "ADAPTABLE",
    "Kernel",
    "call_specs",
    "einsum_parts",
    "fresh_letters",
    "kernel_of",
    "kernel_sizes",
]

#: The layer kinds ``nn.lora.apply`` can adapt (their subclasses too).
ADAPTABLE = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A kernel's dimensions as einsum letters (its stacked layer dimensions left out):
    ``inputs`` multiply the layer's input, ``outputs`` make its output."""

    letters: str
    inputs: str
    outputs: str


def einsum_parts(equation: str) -> tuple[str, str, str]:
    lhs, rest = equation.replace(" ", "").split(",")
    rhs, out = rest.split("->")
    return lhs, rhs, out


def kernel_of(module: nnx.Module, einsum_str: str | None = None) -> Kernel | str:
    """The kernel's dimensions, or why this layer cannot be adapted."""
    if isinstance(module, nnx.Einsum):
        lhs, rhs, out = einsum_parts(einsum_str or module.einsum_str)
        inputs = "".join(c for c in rhs if c in lhs and c not in out)
        outputs = "".join(c for c in rhs if c in out and c not in lhs)
        if len(inputs) + len(outputs) != len(rhs):
            return f"its kernel {rhs!r} has a dimension both in the input and the output"
        return Kernel(rhs, inputs, outputs)
    if isinstance(module, nnx.Linear):
        return Kernel("io", "i", "o")
    if isinstance(module, nnx.LinearGeneral):
        if module.batch_axis:
            return "it has batch_axis dimensions"
        n_in, n_out = len(module.in_features), len(module.out_features)
        letters = string.ascii_lowercase[: n_in + n_out]
        return Kernel(letters, letters[:n_in], letters[n_in:])
    return f"it is a {type(module).__name__}, not one of {', '.join(k.__name__ for k in ADAPTABLE)}"


def fresh_letters(used: str, n: int) -> str:
    return "".join([c for c in string.ascii_letters if c not in used][:n])


def call_specs(
    module: Any, kernel: Kernel, ndim: int, einsum_str: str | None
) -> tuple[str, str, str, str]:
    """``(x, rank letter, x A, y)`` einsum specs of the adapters' path for an input of ``ndim``."""
    if isinstance(module, nnx.Einsum):
        lhs, _, out = einsum_parts(einsum_str or module.einsum_str)
        rank = fresh_letters(lhs + out + kernel.letters, 1)
        return lhs, rank, "".join(c for c in lhs if c not in kernel.inputs) + rank, out
    axes = (-1,) if isinstance(module, nnx.Linear) else tuple(module.axis)
    where = {axis % ndim: letter for axis, letter in zip(axes, kernel.inputs, strict=True)}
    free = iter(fresh_letters(kernel.letters, ndim + 1))
    x = "".join(where[d] if d in where else next(free) for d in range(ndim))
    rank = next(free)
    kept = "".join(c for c in x if c not in kernel.inputs)
    return x, rank, kept + rank, kept + kernel.outputs


def kernel_sizes(module: Any, kernel: Kernel) -> tuple[tuple[int, ...], list[int], list[int]]:
    shape = tuple(module.kernel.get_value().shape)
    lead = len(shape) - len(kernel.letters)
    at = {c: shape[lead + i] for i, c in enumerate(kernel.letters)}
    return shape[:lead], [at[c] for c in kernel.inputs], [at[c] for c in kernel.outputs]
