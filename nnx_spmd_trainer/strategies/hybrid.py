"""Hybrid: compose strategies like ``optax.chain``: axes joined, rules merged, all asked."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, final

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import data_shard as ds
from nnx_spmd_trainer import sharding as sh
from nnx_spmd_trainer.strategies import axis_types as modes
from nnx_spmd_trainer.strategies.base import Axes, Jit, Strategy


class _Call(NamedTuple):
    """How a Hybrid calls a member's answer to one question (placeholders for the values)."""

    args: tuple[str, ...]
    kwargs: tuple[str, ...]
    signature: str


#: Every question, and how a Hybrid asks it of a member (passing the answer so far).
QUESTIONS: dict[str, _Call] = {
    "state_shardings": _Call(
        ("abstract_state", "mesh"),
        ("proposed",),
        "state_shardings(self, abstract_state, mesh, proposed=None)",
    ),
    "batch_sharding": _Call(
        ("batch", "mesh"), ("proposed",), "batch_sharding(self, batch, mesh, proposed=None)"
    ),
    "compile_step": _Call(
        ("step_fn",),
        ("in_shardings", "out_shardings", "donate_argnums", "jit"),
        "compile_step(self, step_fn, *, in_shardings, out_shardings, donate_argnums=(), "
        "jit=jax.jit)",
    ),
    "data_shard": _Call(
        ("mesh", "process_index"),
        ("process_ids", "proposed"),
        "data_shard(self, mesh, process_index=None, *, process_ids=None, proposed=None)",
    ),
    "trace_context": _Call(("mesh",), (), "trace_context(self, mesh)"),
    "transform_step": _Call(("step_fn",), (), "transform_step(self, step_fn)"),
}


def _checked_across_hosts(
    hybrid: Strategy, across_hosts: Mapping[str, int] | None
) -> tuple[tuple[str, int], ...]:
    """``across_hosts`` as pairs, refused unless it maps the Hybrid's mesh axes to counts;
    not given, a nested Hybrid member's."""
    if across_hosts is None:
        return tuple(pair for m in getattr(hybrid, "members", ()) for pair in m.across_hosts)
    if not across_hosts:
        return ()
    names = [name for name, _ in hybrid.mesh_axes()]
    if not isinstance(across_hosts, Mapping):
        raise TypeError(
            f"across_hosts={across_hosts!r} must map mesh axes to the hosts each spans, "
            f"e.g. across_hosts={{{names[0]!r}: 2}}."
        )
    unknown = [name for name in across_hosts if name not in names]
    wrong = {n: h for n, h in across_hosts.items() if not isinstance(h, int) or h < 1}
    if unknown or wrong:
        raise ValueError(
            f"across_hosts={dict(across_hosts)!r}: "
            + (f"{unknown} are not mesh axes of these members ({names}); " if unknown else "")
            + (f"host counts {wrong} are not positive integers; " if wrong else "")
            + f"e.g. across_hosts={{{names[0]!r}: 2}} for a mesh axis over 2 hosts."
        )
    return tuple(across_hosts.items())


def _joint_axis_types(members: tuple[Strategy, ...], given: object) -> modes.AxisTypes:
    """The Hybrid's mesh axis types: ``given``, else the one its members agree on."""
    if given is not None:
        return modes.checked(given, "Hybrid")
    chosen = {member.axis_types for member in members}
    if len(chosen) > 1:
        each = ", ".join(f"{m!r}: {m.axis_types!r}" for m in members)
        raise ValueError(
            f"Hybrid members disagree on the mesh's axis types ({each}); one mesh has one "
            'mode. Give it once, on the Hybrid: Hybrid(..., axis_types="explicit"), which '
            "its members then follow."
        )
    return chosen.pop()


def _following(member: Strategy, axis_types: modes.AxisTypes) -> Strategy:
    """``member`` with the Hybrid's axis types, so its answers (FSDP's refinement) agree
    with the mesh; a member that cannot be rebuilt with them is refused."""
    if member.axis_types == axis_types:
        return member
    if isinstance(member, Hybrid):
        return Hybrid(
            *member.members,
            rules=member.rules,
            axis_types=axis_types,
            across_hosts=dict(member.across_hosts),
        )
    names = {f.name for f in dataclasses.fields(member)} if dataclasses.is_dataclass(member) else ()
    if "axis_types" not in names:
        raise TypeError(
            f"Hybrid(axis_types={axis_types!r}) cannot give its mode to member {member!r}, "
            f"whose axis_types is {member.axis_types!r} and not a dataclass field. Give the "
            "member the same axis_types."
        )
    return dataclasses.replace(member, axis_types=axis_types)  # type: ignore[type-var]


def _check_overrides(member: Strategy) -> None:
    """Raises TypeError if ``member`` overrides a question with parameters a Hybrid cannot pass."""
    for name, call in QUESTIONS.items():
        if getattr(type(member), name) is getattr(Strategy, name):
            continue  # the default answer: it takes what a Hybrid passes
        try:
            signature = inspect.signature(getattr(member, name))
        except (TypeError, ValueError):
            continue  # no readable signature (a builtin): the call itself will tell
        try:
            signature.bind(*call.args, **dict.fromkeys(call.kwargs))
        except TypeError as error:
            raise TypeError(
                f"Hybrid member {member!r} overrides {name}{signature}, which cannot take what a "
                f"Hybrid passes ({error}): a Hybrid gives every member the answer so far. "
                f"Define it as {call.signature} and start from super()'s answer."
            ) from None


@final
@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Hybrid(Strategy):
    """One mesh axis per member; every member answers every question, in order.

    The joint answer (all members' axes and rules; a logical axis two
    members map differently is an error) is proposed to the first member,
    whose answer is proposed to the next, and so on, for every question (see
    ``strategies.base``): ``state_shardings``, ``batch_sharding`` and
    ``data_shard`` pass ``proposed=``; ``compile_step`` nests the members as
    middleware through ``jit=``, ``trace_context`` nests their contexts and
    ``transform_step`` their wrappers, the first member outermost. A leaf whose
    annotation the joint resolution cannot read is proposed as
    ``sharding.Unresolved`` for a member to answer; unanswered, its error is raised. A member
    whose override cannot take the answer so far (no ``proposed=``, say) is
    refused here, at construction. To change one answer, subclass a member,
    not Hybrid (it is final).

    ``axis_types`` (``"auto"`` or ``"explicit"``, see ``strategies.axis_types``)
    is the mesh's mode: by default the one every member has (members that
    disagree are refused); given here, the Hybrid decides and its members are
    rebuilt with it.

    On several hosts the per-layer axes (tensor, sequence, experts, then fsdp)
    stay inside a host and the data axis spans the hosts, whatever the
    members' order (``strategies.host_axes``). ``across_hosts`` places them
    explicitly: ``{mesh axis: hosts it spans}``, the values multiplying to the
    number of hosts (MaxText's DCN parallelism; ``{"data": 2}`` over 2 hosts
    with ``FSDP`` inside each is torchtitan's HSDP).

    >>> from nnx_spmd_trainer import FSDP, DataParallel, TensorParallel
    >>> Hybrid(FSDP(4), TensorParallel(2)).mesh_axes()
    (('fsdp', 4), ('model', 2))
    >>> Hybrid(FSDP(4), TensorParallel(2), axis_types="explicit").members[0]
    FSDP(4, axis_types='explicit')
    >>> Hybrid(DataParallel(2), FSDP(4), across_hosts={"data": 2})
    Hybrid(DataParallel(2), FSDP(4), across_hosts={'data': 2})
    """

    members: tuple[Strategy, ...]
    rules: sh.Rules
    axis_types: modes.AxisTypes
    across_hosts: tuple[tuple[str, int], ...]

    def __init__(
        self,
        *members: Strategy,
        rules: sh.Rules = (),
        axis_types: modes.AxisTypes | None = None,
        across_hosts: Mapping[str, int] | None = None,
    ) -> None:
        if not members:
            raise ValueError(
                "Hybrid needs at least one strategy, e.g. Hybrid(FSDP(4), TensorParallel(2))."
            )
        strangers = [m for m in members if not isinstance(m, Strategy)]
        if strangers:
            raise TypeError(
                f"Hybrid members must be strategies, got {strangers!r}; "
                "e.g. Hybrid(FSDP(4), TensorParallel(2))."
            )
        for member in members:
            _check_overrides(member)
        mode = _joint_axis_types(members, axis_types)
        # Frozen: the dataclass way to set fields in a hand-written __init__.
        object.__setattr__(self, "members", tuple(_following(m, mode) for m in members))
        object.__setattr__(self, "rules", tuple(rules))
        object.__setattr__(self, "axis_types", mode)
        object.__setattr__(self, "across_hosts", _checked_across_hosts(self, across_hosts))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise TypeError(
            f"Hybrid is final; {cls.__name__} cannot subclass it. Subclass the member whose "
            "answer should change instead, e.g. class MyFSDP(FSDP) in "
            "Hybrid(MyFSDP(4), TensorParallel(2))."
        )

    # -- composition -----------------------------------------------------------
    def mesh_axes(self) -> Axes:
        return tuple(axis for m in self.members for axis in m.mesh_axes())

    def batch_axes(self) -> tuple[str, ...]:
        return tuple(axis for m in self.members for axis in m.batch_axes())

    def axis_roles(self) -> dict[str, str]:
        return {axis: role for m in self.members for axis, role in m.axis_roles().items()}

    def logical_rules(self) -> sh.Rules:
        user = dict(sh.merge_rules(self.rules))  # the Hybrid's own rules override members'
        members = ([(n, t) for n, t in m.logical_rules() if n not in user] for m in self.members)
        return sh.merge_rules(user.items(), *members)

    def refine_spec(self, spec: P, shape: tuple[int, ...], mesh: dict[str, int]) -> P:
        for member in self.members:
            spec = member.refine_spec(spec, shape, mesh)
        return spec

    # -- the questions, asked of every member ------------------------------------
    def state_shardings(
        self, abstract_state: nnx.State, mesh: Mesh, proposed: nnx.State | None = None
    ) -> nnx.State:
        # A leaf the joint resolution cannot read is proposed as sharding.Unresolved: a
        # member overriding state_shardings may answer it; if none does, its error is raised.
        if proposed is None:
            proposed = self.annotated_shardings(abstract_state, mesh, unresolved=True)
        shardings = proposed
        for member in self.members:
            shardings = member.state_shardings(abstract_state, mesh, proposed=shardings)
        left = [s for s in jax.tree.leaves(shardings) if isinstance(s, sh.Unresolved)]
        if left:
            error = left[0].error
            error.add_note(
                f"No member of {self!r} answered this leaf in state_shardings; a member "
                "that understands the annotation can, by replacing its "
                "sharding.Unresolved in the proposed answer."
            )
            raise error
        return shardings

    def batch_sharding(self, batch: Any, mesh: Mesh, proposed: Any = None) -> Any:
        shardings = super().batch_sharding(batch, mesh, proposed)
        for member in self.members:
            shardings = member.batch_sharding(batch, mesh, proposed=shardings)
        return shardings

    def compile_step(
        self,
        step_fn: Callable[..., Any],
        *,
        in_shardings: Any,
        out_shardings: Any,
        donate_argnums: tuple[int, ...] = (),
        jit: Jit = jax.jit,
    ) -> Callable[..., Any]:
        for member in reversed(self.members):  # built inside out: the first member outermost
            jit = functools.partial(member.compile_step, jit=jit)
        return jit(
            step_fn,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            donate_argnums=donate_argnums,
        )

    def data_shard(
        self,
        mesh: Mesh,
        process_index: int | None = None,
        *,
        process_ids: np.ndarray | None = None,
        proposed: ds.DataShard | None = None,
    ) -> ds.DataShard:
        # The joint default reads this Hybrid's batch_sharding: every member already asked.
        shard = super().data_shard(mesh, process_index, process_ids=process_ids, proposed=proposed)
        for member in self.members:
            shard = member.data_shard(mesh, process_index, process_ids=process_ids, proposed=shard)
        return shard

    @contextlib.contextmanager
    def trace_context(self, mesh: Mesh) -> Iterator[None]:
        with contextlib.ExitStack() as stack:  # the first member's context outermost
            stack.enter_context(super().trace_context(mesh))  # names the mode's switch
            for member in self.members:
                stack.enter_context(member.trace_context(mesh))
            yield

    def transform_step(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        for member in reversed(self.members):  # the first member's transform outermost
            step_fn = member.transform_step(step_fn)
        return step_fn

    def __repr__(self) -> str:
        rules = [f"rules={self.rules!r}"] if self.rules else []
        rules += [f"across_hosts={dict(self.across_hosts)!r}"] if self.across_hosts else []
        # The members show the mode: each follows the Hybrid's.
        return f"Hybrid({', '.join([*map(repr, self.members), *rules])})"
