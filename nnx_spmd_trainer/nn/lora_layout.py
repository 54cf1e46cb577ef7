"""Where LoRA adapters live: each adapter dimension follows a dimension of its base kernel.

An adapter Variable carries two pieces of metadata (``nn.lora.apply`` writes them):
``lora_base``, the name of its base kernel beside it (``"kernel"``), and ``lora_dims``,
for each of its dimensions the base kernel's dimension it follows, or ``RANK`` (-1).
``lora_a`` ``[(layers,) *inputs, rank]`` follows the kernel's layer and input dimensions,
``lora_b`` ``[(layers,) rank, *outputs]`` its layer and output dimensions; the rank is
never split. So an adapter is split exactly as the part of its base it multiplies, under
any strategy: A like the base's input dimension, B like its output dimension.

``adapter_spec`` is the rule on one spec; ``follow_bases`` applies it to a whole answer of
``state_shardings`` (the model's adapters and the optimizer's copies of them), after the
strategy has laid out the bases (FSDP's fallback included).

>>> from jax.sharding import PartitionSpec as P
>>> adapter_spec(P("fsdp", "model"), (0, -1))   # lora_a of a Linear: [in, rank]
P('fsdp', None)
>>> adapter_spec(P("stage", None, "model"), (0, -1, 2))   # stacked lora_b: [L, rank, out]
P('stage', None, 'model')
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer.sharding import path_str

__all__ = ["BASE", "DIMS", "RANK", "adapter_spec", "follow_bases"]

#: The metadata naming an adapter's base kernel (its sibling attribute).
BASE = "lora_base"
#: The metadata giving, per adapter dimension, the base kernel dimension it follows.
DIMS = "lora_dims"
#: ``lora_dims``'s entry for the rank dimension: never split.
RANK = -1


def adapter_spec(base: P, dims: Sequence[int]) -> P:
    """The spec of an adapter whose dimensions follow ``dims`` of a base laid out ``base``."""
    entries = tuple(base)
    return P(*(None if d == RANK or d >= len(entries) else entries[d] for d in dims))


def _adapter_metadata(variable: Any) -> tuple[str, tuple[int, ...]] | None:
    if not isinstance(variable, nnx.Variable):
        return None
    metadata = variable.get_metadata()
    if BASE not in metadata or DIMS not in metadata:
        return None
    return str(metadata[BASE]), tuple(metadata[DIMS])


def follow_bases(abstract_state: Any, shardings: Any) -> Any:
    """``shardings`` (one ``NamedSharding`` per Variable of ``abstract_state``) with every
    adapter laid out from its base kernel's sharding (``adapter_spec``).

    An adapter in the model finds its base beside it; a copy in the optimizer's state
    (``opt_state/0/mu/<model path>``) takes the layout of the adapter whose path ends as
    its own does. A state without adapters comes back as it is.
    """
    variables = dict(jax.tree_util.tree_flatten_with_path(abstract_state, is_leaf=_is_variable)[0])
    if not any(_adapter_metadata(v) for v in variables.values()):
        return shardings
    given = {path_str(path): s for path, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}
    names = {path_str(path): v for path, v in variables.items()}
    laid_out: dict[str, NamedSharding] = {}
    for name, variable in names.items():
        found = _adapter_metadata(variable)
        base = name.rsplit("/", 1)[0] + "/" + found[0] if found else None
        if found and base in given and isinstance(given[base], NamedSharding):
            spec = adapter_spec(given[base].spec, found[1])
            laid_out[name] = NamedSharding(given[base].mesh, spec)

    def one(path: Sequence[Any], sharding: Any) -> Any:
        name = path_str(path)
        if name in laid_out:
            return laid_out[name]
        if _adapter_metadata(names.get(name)) is None:
            return sharding
        # The optimizer's copy of an adapter: the adapter whose path ends as its own does
        # (``optimizer/opt_state/0/mu/blocks/0/q/lora_a`` and ``model/blocks/0/q/lora_a``).
        owner = max(laid_out, key=lambda a: _common_tail(a, name), default=None)
        return laid_out[owner] if owner and _common_tail(owner, name) > 1 else sharding

    return jax.tree_util.tree_map_with_path(one, shardings)


def _common_tail(a: str, b: str) -> int:
    """How many trailing path components ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(reversed(a.split("/")), reversed(b.split("/")), strict=False):
        if x != y:
            break
        n += 1
    return n


def _is_variable(x: object) -> bool:
    return isinstance(x, nnx.Variable)
