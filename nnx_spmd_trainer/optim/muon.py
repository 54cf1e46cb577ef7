"""Muon, sharded as its cost demands: ``optax.contrib.muon``'s update, Newton-Schulz once
per matrix across the mesh.

``muon(learning_rate, ...)`` takes ``optax.contrib.muon``'s settings and returns a
transformation with the same state (``optax.contrib.MuonState`` beside AdamW's, in
``optax.partition``), so it computes what optax's computes; what changes is where: under a
plan (``Trainer``, ``Plan``) its Newton-Schulz iterations run on each matrix once, on
the device that owns it (``muon_layout``), not on every device of the FSDP axis.

Which leaves Muon trains, and how a leaf of more than two axes is a batch of matrices,
is ``dimension_numbers`` (optax's ``muon_weight_dimension_numbers``). The default,
``matrix_dimension_numbers``, follows the reference recipe (Keller Jordan's Muon,
modded-nanogpt): the hidden layers' matrices; embeddings, biases and norms go to AdamW.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeAlias

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, MuonState
from optax.transforms import MaskedNode

from nnx_spmd_trainer.adapters.optax_private import (
    NS_COEFFS_PRESETS,
    orthogonalize_via_newton_schulz,
    scale_by_shape,
)
from nnx_spmd_trainer.optim import muon_layout
from nnx_spmd_trainer.optim.muon_layout import path_key

DimensionNumbers: TypeAlias = MuonDimensionNumbers | None
#: A tree like the parameters of ``MuonDimensionNumbers`` (None: AdamW), or a function
#: of the parameters returning one.
DimensionNumbersOrFn = Any

#: The last names of leaves AdamW trains whatever their shape: embeddings (``nnx.Embed``),
#: biases (an attention's are ``[heads, head_dim]``) and norms' scales.
ADAMW_NAMES = ("embedding", "bias", "scale")
#: nnx attention's input projections ``[..., in, heads, head_dim]`` and output one
#: ``[..., heads, head_dim, out]``: the heads are part of the matrix, not a batch.
_ATTENTION_IN, _ATTENTION_OUT = ("query", "key", "value"), ("out",)


def _names(path: Sequence[Any]) -> tuple[Any, ...]:
    return path_key(path)


def matrix_dimension_numbers(params: Any) -> Any:
    """The reference recipe's split: ``MuonDimensionNumbers`` for each hidden matrix,
    ``None`` (AdamW) for the rest.

    - fewer than two axes, and embeddings, biases and norms' scales whatever their
      shape (a last name in ``ADAMW_NAMES``): AdamW;
    - ``kernel`` of an attention's ``query``/``key``/``value`` (``[..., in, heads,
      head_dim]``): reduction over ``in``, output over heads x head_dim; of its ``out``
      (``[..., heads, head_dim, out]``): the reverse;
    - any other leaf: the last two axes (reduction, output), leading axes a batch of
      matrices (scanned layers ``[layers, in, out]``, experts ``[experts, in, out]``).

    >>> import numpy as np
    >>> tree = {"embed": {"embedding": np.zeros((8, 4))}, "w": np.zeros((2, 4, 6))}
    >>> matrix_dimension_numbers(tree)["w"]
    MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)
    >>> matrix_dimension_numbers(tree)["embed"]["embedding"] is None
    True
    """

    def rule(path: Sequence[Any], x: Any) -> DimensionNumbers:
        names = _names(path)
        last = names[-1] if names else None
        if x.ndim < 2 or last in ADAMW_NAMES:
            return None
        owner = names[-2] if len(names) > 1 else None
        if last == "kernel" and x.ndim >= 3 and owner in _ATTENTION_IN:
            return MuonDimensionNumbers(reduction_axis=-3, output_axis=(-2, -1))
        if last == "kernel" and x.ndim >= 3 and owner in _ATTENTION_OUT:
            return MuonDimensionNumbers(reduction_axis=(-3, -2), output_axis=-1)
        return MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)

    return jax.tree_util.tree_map_with_path(rule, params)


def _is_dims(x: Any) -> bool:
    return x is None or isinstance(x, (MuonDimensionNumbers, MaskedNode))


def scale_by_sharded_muon(
    ns_coeffs: Any,
    ns_steps: int,
    beta: float,
    eps: float,
    mu_dtype: Any,
    *,
    nesterov: bool,
    adaptive: bool,
    preconditioning: str,
    weight_dimension_numbers: Callable[[Any], Any],
) -> optax.GradientTransformation:
    """``optax.contrib.scale_by_muon`` (same state, same arithmetic) with its
    orthogonalization grouped and laid out by ``muon_layout.orthogonalize_tree``."""
    mu_dtype = None if mu_dtype is None else jax.dtypes.canonicalize_dtype(mu_dtype)

    def init_fn(params: Any) -> MuonState:
        coeffs = jnp.asarray(ns_coeffs)
        if coeffs.ndim > 2 or coeffs.shape[-1] != 3:
            raise ValueError(f"ns_coeffs must have shape (3,) or (n, 3), got {coeffs.shape}.")
        if coeffs.ndim == 2:
            if coeffs.shape[0] > ns_steps:
                raise ValueError(f"Not enough ns_coeffs for ns_steps={ns_steps}.")
            coeffs = coeffs[-ns_steps:]
        return MuonState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params, dtype=mu_dtype),
            ns_coeffs=coeffs,
        )

    def update_fn(updates: Any, state: MuonState, params: Any = None) -> tuple[Any, MuonState]:
        del params
        dims = weight_dimension_numbers(updates)
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count_inc = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(
                lambda m, g: beta * m + (1 - beta) * g,
                optax.tree.bias_correction(mu, beta, optax.safe_increment(count_inc)),
                optax.tree.bias_correction(updates, beta, count_inc),
            )
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count_inc)

        def ortho(x: jax.Array, d: MuonDimensionNumbers) -> jax.Array:
            coeffs: Any = state.ns_coeffs
            return orthogonalize_via_newton_schulz(x, coeffs, ns_steps, preconditioning, eps, d)

        new = muon_layout.orthogonalize_tree(mu_hat, dims, ortho)
        if adaptive:  # the dual norm of the momentum (arXiv 2409.20325), as optax
            new = jax.tree.map(lambda x, y: jnp.sum(x.conj() * y) * y, mu_hat, new)
        return new, MuonState(count_inc, optax.tree.cast(mu, mu_dtype), state.ns_coeffs)

    return optax.GradientTransformation(init_fn, update_fn)  # type: ignore[arg-type]


def muon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs: Any = "standard",
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Any = None,
    mu_dtype: Any = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: Literal["frobenius", "spectral", "aol", "schatten"] = "frobenius",
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps_root: float = 0.0,
    adam_weight_decay: float = 0.0,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    dimension_numbers: DimensionNumbersOrFn = matrix_dimension_numbers,
    consistent_rms: float | None = None,
) -> optax.GradientTransformation:
    """Muon for the hidden matrices, AdamW for the rest; Newton-Schulz once per matrix.

    Every argument is ``optax.contrib.muon``'s, with its default (``ns_steps=5``,
    ``beta=0.95``, Nesterov momentum, the quintic coefficients ``(3.4445, -4.7750,
    2.0315)``, the update scaled by ``sqrt(max(1, fan_out / fan_in))``, or
    ``sqrt(max(fan_in, fan_out)) * consistent_rms`` with ``consistent_rms=0.2`` for
    Moonlight's AdamW-matched RMS), except ``dimension_numbers`` (optax's
    ``muon_weight_dimension_numbers``), whose default ``matrix_dimension_numbers``
    leaves embeddings to AdamW as the reference recipe does and treats scanned layers'
    and experts' leading axes as batches of matrices. The state is optax's, so the two
    compute the same update (tests/test_muon.py: within 1e-5 of one-device
    ``optax.contrib.muon`` under DP, FSDP, FSDP x TP, scanned layers and experts).

    Under a plan the orthogonalization is laid out (``muon_layout``): each matrix is
    moved whole to one owner with one ``all_to_all``, orthogonalized there, and moved
    back with another.

    Example::

        from nnx_spmd_trainer.optim import muon
        trainer = Trainer(factory, muon(0.02, adam_learning_rate=3e-4), loss_fn=loss,
                          strategy=FSDP(8))
    """
    if isinstance(ns_coeffs, str):
        if ns_coeffs not in NS_COEFFS_PRESETS:
            raise ValueError(
                f"muon(ns_coeffs={ns_coeffs!r}): unknown preset; use one of "
                f"{sorted(NS_COEFFS_PRESETS)} or give the coefficients."
            )
        ns_coeffs = NS_COEFFS_PRESETS[ns_coeffs]
    adam_learning_rate = learning_rate if adam_learning_rate is None else adam_learning_rate

    def dims_of(params: Any) -> Any:
        return dimension_numbers(params) if callable(dimension_numbers) else dimension_numbers

    def labels(params: Any) -> Any:
        return jax.tree.map(
            lambda d, x: jax.tree.map(lambda _: "adam" if d is None else "muon", x),
            dims_of(params),
            params,
            is_leaf=_is_dims,
        )

    def muon_dims(params: Any) -> Any:
        # As optax: the Muon leaves' numbers, MaskedNode where AdamW's state is masked.
        mask = jax.tree.map(lambda label: label == "muon", labels(params))
        return jax.tree.map(
            lambda d, m: jax.tree.map(lambda k: d if k else MaskedNode(), m),
            dims_of(params),
            mask,
            is_leaf=_is_dims,
        )

    return optax.partition(
        transforms={
            "muon": optax.chain(
                scale_by_sharded_muon(
                    ns_coeffs,
                    ns_steps,
                    beta,
                    eps,
                    mu_dtype,
                    nesterov=nesterov,
                    adaptive=adaptive,
                    preconditioning=preconditioning,
                    weight_dimension_numbers=muon_dims,
                ),
                scale_by_shape(muon_dims, consistent_rms),
                optax.add_decayed_weights(weight_decay, weight_decay_mask),
                optax.scale_by_learning_rate(learning_rate),
            ),
            "adam": optax.adamw(
                learning_rate=adam_learning_rate,
                b1=adam_b1,
                b2=adam_b2,
                eps=eps,
                eps_root=adam_eps_root,
                weight_decay=adam_weight_decay,
                mu_dtype=mu_dtype,
                nesterov=nesterov,
            ),
        },
        param_labels=labels,
    )
