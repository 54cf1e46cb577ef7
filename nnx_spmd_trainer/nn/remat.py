"""Activation checkpointing (rematerialisation): named policies and a per-block helper.

A policy says which intermediate values of the forward pass are kept for the
backward pass; the rest are recomputed there, trading compute for memory.
``Trainer(..., remat="dots_saveable")`` (or ``Plan(remat=...)``) checkpoints
the whole ``loss_fn`` with no change to the model; ``remat(Block, policy)``
checkpoints each block of a model the user writes. Saving nothing (``"full"``)
pays per block: over the whole loss the forward pass is recomputed in one
piece before the backward pass, and the peak is that of ``"none"``.

>>> sorted(POLICIES)  # doctest: +NORMALIZE_WHITESPACE
['dots_saveable', 'dots_with_no_batch_dims_saveable', 'everything_saveable', 'full',
 'none', 'nothing_saveable', 'offload_dot_with_no_batch_dims']
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import jax
from flax import nnx

__all__ = ["OFFLOADING", "POLICIES", "ModuleOrClass", "Policy", "checkpoint_policy", "remat"]

#: ``jax.checkpoint``'s policy: ``(primitive, *avals, **params) -> bool`` (keep it?).
Policy = Callable[..., Any]

_saves = jax.checkpoint_policies

#: Every policy by name. ``None`` (``"none"``) is no checkpointing at all: every
#: intermediate the backward pass needs is kept, as without ``jax.checkpoint``.
POLICIES: Mapping[str, Policy | None] = MappingProxyType(
    {
        "none": None,
        # Keeps only the block's inputs and recomputes the whole forward pass.
        "full": _saves.nothing_saveable,
        "nothing_saveable": _saves.nothing_saveable,
        # Keeps the matmul outputs; recomputes the cheap elementwise work around them.
        "dots_saveable": _saves.dots_saveable,
        # As dots_saveable, but not batched matmuls (attention's q @ k, weights @ v).
        "dots_with_no_batch_dims_saveable": _saves.dots_with_no_batch_dims_saveable,
        # Keeps everything, recomputes nothing: what the jax.checkpoint wiring alone costs.
        "everything_saveable": _saves.everything_saveable,
        # Keeps what dots_with_no_batch_dims_saveable keeps, in pinned host memory.
        "offload_dot_with_no_batch_dims": _saves.offload_dot_with_no_batch_dims(
            "device", "pinned_host"
        ),
    }
)

#: The policies that move saved values to host memory: JAX lowers that transfer for
#: GPUs and TPUs only (on the CPU it is dropped, and ``checkpoint_policy`` refuses them).
OFFLOADING = frozenset({"offload_dot_with_no_batch_dims"})


def checkpoint_policy(name: str, *, platform: str | None = None) -> Policy | None:
    """The ``jax.checkpoint`` policy named ``name``; ``None`` for ``"none"`` (no checkpointing).

    Args:
      name: a key of ``POLICIES``.
      platform: where the policy runs (``"cpu"``, ``"gpu"``, ``"tpu"``); default
        ``jax.default_backend()``. Read only for the offloading policies.

    Raises:
      ValueError: an unknown name (the message lists the valid ones), or an
        offloading policy on the CPU. JAX lowers the CPU's host transfers to
        nothing, so the saved values would silently stay in device memory.

    >>> checkpoint_policy("none") is None
    True
    >>> checkpoint_policy("full") is jax.checkpoint_policies.nothing_saveable
    True
    """
    if name not in POLICIES:
        raise ValueError(f"Unknown remat policy {name!r}; choose one of {', '.join(POLICIES)}.")
    if name in OFFLOADING and (platform or jax.default_backend()) == "cpu":
        raise ValueError(
            f"remat policy {name!r} offloads saved activations to pinned host memory, which "
            "the CPU backend does not have: JAX drops the transfer there and the values stay "
            "in device memory. Use remat='dots_with_no_batch_dims_saveable' (what it amounts "
            "to on the CPU), or run on a GPU or TPU."
        )
    return POLICIES[name]


#: What ``remat`` takes and gives back: an ``nnx.Module`` subclass, or an instance.
ModuleOrClass = TypeVar("ModuleOrClass", bound="nnx.Module | type[nnx.Module]")


def remat(module_or_class: ModuleOrClass, policy: str) -> ModuleOrClass:
    """``module_or_class`` with its ``__call__`` checkpointed by ``nnx.remat`` under ``policy``.

    For checkpointing each block of a model the user writes: a class gives a
    subclass (build it as the class); an instance gives a copy of it of that
    subclass holding the same Variables, so the state's paths (checkpoints,
    sharding rules) do not change when it replaces the original. ``"none"``
    gives ``module_or_class`` back unchanged. The arguments of ``__call__``
    other than the module are traced: give Python flags (``deterministic=``)
    as module attributes, not arguments.

    Args:
      module_or_class: an ``nnx.Module`` subclass or instance.
      policy: a name in ``POLICIES`` (``checkpoint_policy``).

    Example: a user's block, checkpointed with nothing saved.

    >>> class Block(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.linear = nnx.Linear(4, 4, rngs=rngs)
    ...     def __call__(self, x):
    ...         return jax.nn.gelu(self.linear(x))
    >>> RematBlock = remat(Block, "full")
    >>> blocks = [RematBlock(nnx.Rngs(i)) for i in range(2)]
    >>> isinstance(blocks[0], Block), blocks[0](jax.numpy.ones((2, 4))).shape
    (True, (2, 4))
    >>> remat(Block, "none") is Block
    True
    """
    checkpoint_policy(policy)  # unknown names and the CPU's offloading fail here
    if policy == "none":
        return module_or_class
    if isinstance(module_or_class, type):
        if not issubclass(module_or_class, nnx.Module):
            raise TypeError(f"remat takes an nnx.Module class or instance; got {module_or_class}.")
        return _rematted_class(module_or_class, policy)  # type: ignore[return-value]
    if not isinstance(module_or_class, nnx.Module):
        raise TypeError(
            f"remat takes an nnx.Module class or instance; got {type(module_or_class).__name__}."
        )
    rematted = copy.copy(module_or_class)  # shallow: the same Variables and submodules
    object.__setattr__(rematted, "__class__", _rematted_class(type(module_or_class), policy))
    return rematted  # type: ignore[return-value]


@functools.cache
def _rematted_class(cls: type[nnx.Module], policy: str) -> type[nnx.Module]:
    """One subclass per (class, policy): equal graph definitions, so no recompiles."""
    checkpointed = nnx.remat(cls.__call__, policy=POLICIES[policy])  # type: ignore[operator]

    def __call__(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpointed(self, *args, **kwargs)

    name = f"Remat{cls.__name__}"
    namespace = {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": name,
        "__doc__": f"{cls.__name__} with ``__call__`` checkpointed (remat policy {policy!r}).",
    }
    # The class's own metaclass, keeping its pytree mode (class B(nnx.Module, pytree=False)).
    pytree = getattr(cls, "_pytree__is_pytree", True)
    metaclass: Any = type(cls)
    return metaclass(name, (cls,), namespace, pytree=pytree)  # type: ignore[no-any-return]
