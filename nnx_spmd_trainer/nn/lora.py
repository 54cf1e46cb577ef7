"""LoRA: low-rank adapters beside the layers a regex names, in any NNX model.

``LoRA(rank=..., targets=...)`` says which layers get adapters; ``apply`` adds them to a
built model, in place; ``merge`` folds them back into the base kernels. The ``Trainer``
takes the same object (``Trainer(..., lora=LoRA(...))``): it adds the adapters inside the
sharded initialisation, after ``init_from`` has loaded the base, trains them alone
(``wrt=nnx.LoRAParam``) and lays each out from its base (``nn.lora_layout``).

An adapted layer keeps its path, its class's behaviour and its parameters; it gains
``lora_a`` ``[(layers,) *inputs, rank]`` and ``lora_b`` ``[(layers,) rank, *outputs]``
(``nnx.LoRAParam``, float32) and computes ``base(x) + alpha / rank * (x A) B``:
``h/0/attn/q/kernel`` stays where a weight map or a checkpoint of the base expects it,
beside ``h/0/attn/q/lora_a``. ``A`` starts uniform in ``±1/sqrt(fan_in)`` (PEFT's
default), ``B`` at zero, so an adapted model starts as its base. ``nnx.Linear``,
``nnx.LinearGeneral`` (GPT's attention projections) and ``nnx.Einsum`` (and their
subclasses) can be adapted; a stacked layer (``nn.stack.stacked``: a kernel with a
leading layer dimension) gets stacked adapters with the same leading dimension.

>>> with nnx.use_eager_sharding(False):
...     model = nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)),
...                            nnx.Linear(16, 4, rngs=nnx.Rngs(1)))
>>> apply(model, LoRA(rank=2, targets=r"layers/\\d"), rngs=nnx.Rngs(2))  # doctest: +ELLIPSIS
Sequential(...)
>>> model.layers[0].lora_a.shape, model.layers[0].lora_b.shape, sorted(adapters(model))
((8, 2), (2, 16), ['layers/0/kernel', 'layers/1/kernel'])
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import math
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from nnx_spmd_trainer.nn.lora_kernel import ADAPTABLE
from nnx_spmd_trainer.nn.lora_kernel import Kernel as _Kernel
from nnx_spmd_trainer.nn.lora_kernel import call_specs as _call_specs
from nnx_spmd_trainer.nn.lora_kernel import kernel_of as _kernel_of
from nnx_spmd_trainer.nn.lora_kernel import kernel_sizes as _sizes
from nnx_spmd_trainer.nn.lora_layout import BASE, DIMS, RANK
from nnx_spmd_trainer.nn.lora_merge import Model, adapted_layers, delta, merge
from nnx_spmd_trainer.nn.lora_merge import layers_by_path as _layers

__all__ = [
    "LoRA",
    "Adapter",
    "Model",
    "adapted_layers",
    "adapters",
    "adapters_off",
    "apply",
    "delta",
    "initializer",
    "merge",
    "targeted",
]

#: Folded into the plan's seed for the adapters' draws ("LoRA" in ASCII).
_SEED_STREAM = 0x4C6F5241
#: What ``base_dtype`` casts by default: the parameters that are not adapters.
FROZEN = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
#: Whether adapted layers compute their base alone (``adapters_off``); read at each call.
_ADAPTERS_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "lora_adapters_off", default=False
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRA:
    """Low-rank adapters for the layers whose paths match ``targets``.

    Args:
      rank: the adapters' rank ``r``; at most the smaller of a target's input and
        output sizes.
      targets: a regex matched against each layer's whole NNX path (``"/".join(path)``:
        ``"h/0/attn/q"``, ``"blocks/linear1"`` in a stack), or a sequence of them; each
        must match at least one adaptable layer (``nnx.Linear``, ``nnx.LinearGeneral``,
        ``nnx.Einsum``). ``r".*attn/(q|k|v)"``, ``[r"blocks/\\d+/mha/(query|value)"]``.
      alpha: the update is scaled by ``alpha / rank``; default ``rank`` (a scale of 1).
      dropout: dropout on the adapters' input while training (``model.train()``).
      base_dtype: the frozen base parameters held in this dtype (``jnp.bfloat16``),
        the adapters and their optimizer state staying float32; ``None``: as built.

    Example::

        trainer = Trainer(factory, optax.adamw(1e-3), loss_fn=loss,
                          lora=LoRA(rank=8, alpha=16, targets=r".*attn/(q|v)"))
    """

    rank: int
    targets: str | tuple[str, ...]
    alpha: float | None = None
    dropout: float = 0.0
    base_dtype: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA(rank={self.rank!r}): the rank must be an integer >= 1.")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(
                f"LoRA(targets={self.targets!r}): give a regex over layer paths, or a list "
                'of them (targets=r".*attn/(q|v)").'
            )
        for target in targets:
            try:
                re.compile(target)
            except re.error as error:
                raise ValueError(
                    f"LoRA(targets=...): {target!r} is not a regex: {error}."
                ) from None
        object.__setattr__(self, "targets", targets[0] if len(targets) == 1 else targets)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA(dropout={self.dropout!r}): give a rate in [0, 1).")

    @property
    def scale(self) -> float:
        """``alpha / rank``: what ``(x A) B`` is multiplied by."""
        return (self.rank if self.alpha is None else self.alpha) / self.rank

    @property
    def patterns(self) -> tuple[str, ...]:
        """``targets`` as a tuple of regexes."""
        return (self.targets,) if isinstance(self.targets, str) else self.targets


class Adapter(NamedTuple):
    """One layer's adapters: the update to its kernel is ``scale * A @ B``."""

    a: jax.Array
    b: jax.Array
    scale: float


# -- the adapted layer -------------------------------------------------------------
class _Adapted(nnx.Module):
    """Mixed into an adapted layer's class: its output plus the adapters' update."""

    lora_scale: float
    lora_a: nnx.LoRAParam[jax.Array]
    lora_b: nnx.LoRAParam[jax.Array]

    def __call__(self, inputs: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        out = cast(Any, super()).__call__(inputs, *args, **kwargs)
        if _ADAPTERS_OFF.get():  # the base alone: no update, no dropout draw
            return out
        einsum_str = None
        if isinstance(self, nnx.Einsum):  # its call may name another equation
            einsum_str = args[0] if args else kwargs.get("einsum_str")
        return out + self.lora_update(inputs, einsum_str).astype(out.dtype)

    def lora_update(self, x: jax.Array, einsum_str: str | None = None) -> jax.Array:
        """``alpha / rank * (x A) B``, shaped as the layer's output."""
        kernel = _kernel_of(self, einsum_str)
        assert isinstance(kernel, _Kernel)
        x_spec, rank, mid, y_spec = _call_specs(self, kernel, x.ndim, einsum_str)
        if getattr(self, "lora_dropout", None) is not None:
            x = cast(Any, self).lora_dropout(x)
        x, a, b = dtypes.promote_dtype(
            (x, self.lora_a[...], self.lora_b[...]), dtype=getattr(self, "dtype", None)
        )
        precision = getattr(self, "precision", None)
        h = jnp.einsum(f"{x_spec},{kernel.inputs}{rank}->{mid}", x, a, precision=precision)
        out = jnp.einsum(f"{mid},{rank}{kernel.outputs}->{y_spec}", h, b, precision=precision)
        return out * jnp.asarray(self.lora_scale, out.dtype)


class LoRALinear(_Adapted, nnx.Linear):
    """An ``nnx.Linear`` with adapters."""

    lora_base_class = nnx.Linear


class LoRALinearGeneral(_Adapted, nnx.LinearGeneral):
    """An ``nnx.LinearGeneral`` (GPT's attention projections) with adapters."""

    lora_base_class = nnx.LinearGeneral


class LoRAEinsum(_Adapted, nnx.Einsum):
    """An ``nnx.Einsum`` with adapters."""

    lora_base_class = nnx.Einsum


#: The adapted class of each base class: the three kinds above, written here; a subclass
#: of one of them (a user's ``nnx.Linear`` subclass) gets its own the first time it is
#: adapted (``_adapted_class``).
_CLASSES: dict[type, type] = {
    nnx.Linear: LoRALinear,
    nnx.LinearGeneral: LoRALinearGeneral,
    nnx.Einsum: LoRAEinsum,
}


def _adapted_class(cls: type) -> type:
    """``cls`` with adapters: one class per base class. A subclass of an adaptable kind is
    made once, named ``LoRA<its name>`` in this module so that it pickles by name as the
    three written above do."""
    if cls not in _CLASSES:
        name = f"LoRA{cls.__name__}"
        while hasattr(sys.modules[__name__], name):
            name += "_"
        adapted = type(name, (_Adapted, cls), {"__module__": __name__, "lora_base_class": cls})
        setattr(sys.modules[__name__], name, adapted)  # pickled by name, as any class
        _CLASSES[cls] = adapted
    return _CLASSES[cls]


# -- finding the targets -------------------------------------------------------------
def targeted(model: nnx.Module, config: LoRA) -> dict[str, nnx.Module]:
    """The layers of ``model`` whose paths match ``config.targets``, by path.

    Raises ``ValueError`` (one line) for a regex matching no adaptable layer (naming
    the closest layer paths), a match that cannot be adapted, or a layer with adapters.
    """
    layers = _layers(model)
    adaptable = [p for p, m in layers.items() if isinstance(m, ADAPTABLE)]
    found: dict[str, nnx.Module] = {}
    for pattern in config.patterns:
        matched = {p: m for p, m in layers.items() if re.fullmatch(pattern, p)}
        usable = {p: m for p, m in matched.items() if isinstance(m, ADAPTABLE)}
        if not usable:
            close = difflib.get_close_matches(pattern, adaptable, n=3, cutoff=0.0)
            raise ValueError(
                f"LoRA(targets={pattern!r}) matches no Linear, LinearGeneral or Einsum "
                f"layer ({len(matched)} other module(s)); the closest layer paths: "
                f"{', '.join(close) or 'none'} (a regex matched against the whole path)."
            )
        found.update(usable)
    for path, module in found.items():
        if isinstance(module, _Adapted):
            raise ValueError(f"LoRA: {path} already has adapters; merge(model) them first.")
        reason = _kernel_of(module)
        if isinstance(reason, str):
            raise ValueError(f"LoRA: {path} cannot be adapted: {reason}.")
    return found


def _check_rank(path: str, module: nnx.Module, rank: int) -> None:
    kernel = _kernel_of(module)
    assert isinstance(kernel, _Kernel)
    _, inputs, outputs = _sizes(module, kernel)
    largest = min(math.prod(inputs), math.prod(outputs))
    if rank > largest:
        raise ValueError(
            f"LoRA(rank={rank}): {path} ({type(module).__name__}) has {math.prod(inputs)} "
            f"input and {math.prod(outputs)} output features; give a rank <= {largest} "
            "or leave it out of targets."
        )


# -- adding, reading and folding adapters ------------------------------------------------
def _metadata(kernel: nnx.Variable[Any], dims: tuple[int, ...]) -> dict[str, Any]:
    """The adapter's metadata: its base and dimensions, the base's annotation followed."""
    base = kernel.get_metadata()
    metadata: dict[str, Any] = {BASE: "kernel", DIMS: dims, "eager_sharding": False}
    annotation = base.get("out_sharding")
    if annotation is not None:
        ndim = kernel.get_value().ndim
        padded = (*tuple(annotation), *([None] * (ndim - len(annotation))))
        metadata["out_sharding"] = tuple(None if d == RANK else padded[d] for d in dims)
    if base.get("sharding_rules"):
        metadata["sharding_rules"] = base["sharding_rules"]
    return metadata


def _add(module: Any, config: LoRA, rngs: nnx.Rngs) -> None:
    kernel = _kernel_of(module)
    assert isinstance(kernel, _Kernel)
    lead, inputs, outputs = _sizes(module, kernel)
    n, r = len(lead), config.rank
    where = {c: n + i for i, c in enumerate(kernel.letters)}
    a_dims = (*range(n), *(where[c] for c in kernel.inputs), RANK)
    b_dims = (*range(n), RANK, *(where[c] for c in kernel.outputs))
    bound = 1.0 / math.sqrt(math.prod(inputs))
    a = jax.random.uniform(rngs.params(), (*lead, *inputs, r), jnp.float32, -bound, bound)
    b = jnp.zeros((*lead, r, *outputs), jnp.float32)
    module.__class__ = _adapted_class(type(module))
    module.lora_scale = config.scale
    module.lora_a = nnx.LoRAParam(a, **_metadata(module.kernel, a_dims))
    module.lora_b = nnx.LoRAParam(b, **_metadata(module.kernel, b_dims))
    if config.dropout:
        module.lora_dropout = _dropout(config.dropout, lead, rngs)


def _dropout(rate: float, lead: tuple[int, ...], rngs: nnx.Rngs) -> nnx.Dropout:
    if not lead:
        return nnx.Dropout(rate, rngs=rngs)
    if len(lead) > 1:
        raise ValueError(f"LoRA(dropout={rate}): layers stacked over {lead} take dropout=0.")

    @nnx.split_rngs(splits=lead[0])
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(layer_rngs: nnx.Rngs) -> nnx.Dropout:  # one stream per layer, as the blocks'
        return nnx.Dropout(rate, rngs=layer_rngs)

    return cast(nnx.Dropout, stacked(rngs))


def apply(
    model: Model,
    config: LoRA,
    *,
    rngs: nnx.Rngs | int = 0,
    frozen: nnx.filterlib.Filter = FROZEN,
) -> Model:
    """Adds ``config``'s adapters to ``model``'s target layers, in place; returns ``model``.

    Nothing changes unless every target is valid (``targeted``, and a rank no larger
    than a target's input or output size). With ``config.base_dtype``, the ``frozen``
    parameters (default: every ``nnx.Param`` but the adapters) are cast to it.

    Args:
      model: any NNX model, built (outside a mesh: ``nnx.use_eager_sharding(False)``,
        or inside the jitted initialisation, as the ``Trainer`` does).
      config: which layers, which rank.
      rngs: draws ``A`` (``rngs.params()``) and the adapters' dropout streams.
      frozen: what ``base_dtype`` casts.
    """
    layers = targeted(model, config)
    for path, module in layers.items():
        _check_rank(path, module, config.rank)
    rngs = nnx.Rngs(rngs) if isinstance(rngs, int) else rngs
    for module in layers.values():
        _add(module, config, rngs)
    if config.base_dtype is not None:
        dtype = jnp.dtype(config.base_dtype)
        state = nnx.state(model, frozen)
        floats = jax.tree.map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state
        )
        nnx.update(model, floats)
    return model


def initializer(
    config: LoRA, seed: int, *, trained: nnx.filterlib.Filter
) -> Callable[[Model], Model]:
    """``apply`` as a plan runs it on the model it builds: ``A`` drawn from ``seed`` (a
    stream of its own: the base's initialisation is unchanged), ``base_dtype`` casting
    every parameter that is not ``trained``."""

    def adapt(model: Model) -> Model:
        rngs = nnx.Rngs(jax.random.fold_in(jax.random.key(seed), _SEED_STREAM))
        return apply(model, config, rngs=rngs, frozen=nnx.All(nnx.Param, nnx.Not(trained)))

    return adapt


@contextlib.contextmanager
def adapters_off() -> Iterator[None]:
    """Within the block, every adapted layer computes its base layer's output alone: a
    LoRA model is its base, with no second copy of the weights (a DPO reference model).

    The switch is read when a layer is called, so under ``jax.jit`` it is read while
    tracing: trace a function inside the block (its own ``jit``, as
    ``post_training.ReferenceModel`` compiles its program), and do not call, inside the
    block, a jitted function already traced outside it (its cached program keeps the
    adapters). Nesting is allowed; the setting is per thread and per ``asyncio`` task.

    >>> with nnx.use_eager_sharding(False):
    ...     model = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    >>> x = jnp.ones((1, 4))
    >>> base = model(x)
    >>> _ = apply(model, LoRA(rank=2, targets="layers/0"), rngs=nnx.Rngs(1))
    >>> model.layers[0].lora_b[...] = jnp.ones((2, 4))  # adapters that change the output
    >>> bool(jnp.allclose(model(x), base))
    False
    >>> with adapters_off():
    ...     bool(jnp.array_equal(model(x), base))
    True
    """
    token = _ADAPTERS_OFF.set(True)
    try:
        yield
    finally:
        _ADAPTERS_OFF.reset(token)


def adapters(model: nnx.Module) -> dict[str, Adapter]:
    """Each adapted layer's ``Adapter(a, b, scale)``, by its kernel's path
    (``"h/0/attn/q/kernel"``: the key a ``WeightMap`` of the base uses)."""
    return {
        f"{path}/kernel" if path else "kernel": Adapter(
            m.lora_a.get_value(), m.lora_b.get_value(), float(m.lora_scale)
        )
        for path, m in adapted_layers(model).items()
    }
