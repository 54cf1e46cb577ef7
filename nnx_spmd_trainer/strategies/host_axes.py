"""Where a mesh's axes lie on several hosts: per-layer traffic inside a host, the rest across.

On one host (one process, or one TPU slice) the mesh is ``jax.make_mesh``'s. On
several, each mesh axis is split into the hosts it spans and the devices it
spans inside each host (MaxText's DCN x ICI split,
``mesh_utils.create_hybrid_device_mesh``): the axes whose collectives run in
every layer stay inside a host, whatever the order the strategy lists them in.
From the outermost (first to span hosts) to the innermost, the order of
Megatron-LM and torchtitan: pipeline stages, data, fsdp, experts, sequence,
tensor (``ROLES_OUTSIDE_IN``). ``across_hosts`` (``Hybrid(...,
across_hosts={"data": 2})``) says it explicitly instead.

The hosts are the TPU slices where the devices carry several ``slice_index``
values, one TPU slice otherwise (its interconnect spans its hosts; JAX knows
its torus), and on every other platform the processes.
"""

from __future__ import annotations

import collections
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from nnx_spmd_trainer.sharding import ShardingError

#: Mesh axis roles (a strategy's ``usual_axis``) from the one that loses least by spanning
#: hosts to the one that loses most: pipeline stages pass activations once per microbatch,
#: data reduces gradients once per step, fsdp gathers weights every layer, experts and
#: sequence exchange activations every layer, tensor parallelism reduces them in every layer.
ROLES_OUTSIDE_IN = ("stage", "data", "fsdp", "expert", "seq", "model")
#: Roles warned about when they span hosts: their collectives sit inside every layer's
#: critical path. FSDP spanning hosts is usual (its gathers overlap the compute).
PER_LAYER_ROLES = ("expert", "seq", "model")
#: An axis of a role not listed (a user's own strategy) is placed as an fsdp axis.
_UNKNOWN_RANK = ROLES_OUTSIDE_IN.index("fsdp")


def role_rank(role: str) -> int:
    """How far inside a host an axis of ``role`` goes: 0 spans hosts first.

    >>> role_rank("data") < role_rank("fsdp") < role_rank("model")
    True
    """
    return ROLES_OUTSIDE_IN.index(role) if role in ROLES_OUTSIDE_IN else _UNKNOWN_RANK


def host_groups(devices: Sequence[jax.Device]) -> tuple[str, list[list[jax.Device]]]:
    """The devices grouped by host (``"slice"`` or ``"process"``, see the module docstring),
    hosts in index order, each host's devices in the order given."""
    slices = {getattr(d, "slice_index", 0) for d in devices}
    if len(slices) > 1:
        kind, key = "slice", lambda d: d.slice_index
    elif devices[0].platform == "tpu":
        return "slice", [list(devices)]  # one slice: its interconnect spans its hosts
    else:
        kind, key = "process", lambda d: d.process_index
    groups: dict[int, list[jax.Device]] = collections.defaultdict(list)
    for device in devices:
        groups[key(device)].append(device)
    return kind, [groups[k] for k in sorted(groups)]


def hosts_per_axis(
    sizes: Mapping[str, int],
    roles: Mapping[str, str],
    hosts: int,
    across_hosts: Mapping[str, int],
    *,
    owner: str,
    kind: str = "process",
) -> dict[str, int]:
    """How many hosts each axis spans: ``across_hosts`` as given (checked), else the hosts
    handed out from the outermost role in, each axis taking as many as divide it.

    >>> sizes = {"model": 2, "fsdp": 4}
    >>> hosts_per_axis(sizes, {"model": "model", "fsdp": "fsdp"}, 2, {}, owner="s")
    {'model': 1, 'fsdp': 2}
    >>> hosts_per_axis({"data": 2, "fsdp": 4}, {}, 2, {"fsdp": 2}, owner="s")
    {'data': 1, 'fsdp': 2}
    """
    if across_hosts:
        given = dict(across_hosts)
        where = f"{owner} across_hosts={given}"
        unknown = sorted(set(given) - set(sizes))
        if unknown:
            raise ShardingError(
                f"{where} names {unknown}, not axes of its mesh {dict(sizes)}. "
                "Name mesh axes, e.g. across_hosts={'data': 2}."
            )
        uneven = {n: (h, sizes[n]) for n, h in given.items() if sizes[n] % h}
        if uneven:
            raise ShardingError(
                f"{where}: the hosts an axis spans must divide its size ((hosts, size): "
                f"{uneven}). Give each axis a divisor of its size."
            )
        if math.prod(given.values()) != hosts:
            raise ShardingError(
                f"{where} spans {math.prod(given.values())} hosts in all, but the devices "
                f"are on {hosts} {kind}{'es' if kind == 'process' else 's'}. Give values "
                f"whose product is {hosts}."
            )
        return {name: given.get(name, 1) for name in sizes}
    spans, left = dict.fromkeys(sizes, 1), hosts
    for name in sorted(sizes, key=lambda n: role_rank(roles.get(n, n))):  # stable: ties keep order
        spans[name] = math.gcd(sizes[name], left)
        left //= spans[name]
    return spans  # ``left`` is 1: the hosts divide the product of the sizes


def arrange(
    devices: Sequence[jax.Device],
    sizes: Mapping[str, int],
    roles: Mapping[str, str],
    across_hosts: Mapping[str, int],
    *,
    owner: str,
) -> np.ndarray | None:
    """The mesh's devices, shaped as ``sizes`` (in its order), each axis spanning the hosts
    ``hosts_per_axis`` says; ``None`` on one host or hosts of unequal device counts
    (``jax.make_mesh``'s order then). ``across_hosts`` on one host is an error."""
    kind, groups = host_groups(devices)
    if len(groups) == 1 or len({len(g) for g in groups}) > 1:
        if math.prod(across_hosts.values()) > 1:
            plural = ("es" if kind == "process" else "s") if len(groups) > 1 else ""
            raise ShardingError(
                f"{owner} across_hosts={dict(across_hosts)} asks for "
                f"{math.prod(across_hosts.values())} hosts, but the {len(devices)} devices are "
                f"on {len(groups)} {kind}{plural} of "
                f"{sorted({len(g) for g in groups})} devices. Drop across_hosts, or run one "
                "process per host with the same devices each."
            )
        return None
    spans = hosts_per_axis(sizes, roles, len(groups), across_hosts, owner=owner, kind=kind)
    names = list(sizes)
    # create_hybrid_device_mesh takes the axes by increasing network intensity.
    order = sorted(range(len(names)), key=lambda i: role_rank(roles.get(names[i], names[i])))
    arranged = mesh_utils.create_hybrid_device_mesh(
        [sizes[names[i]] // spans[names[i]] for i in order],
        [spans[names[i]] for i in order],
        devices=[d for group in groups for d in group],
        process_is_granule=kind == "process",
    )
    return np.transpose(arranged, np.argsort(order))


def hosts_spanned(mesh: Mesh, axis: str, host: Any) -> int:
    """The most hosts (``host(device)`` apart) any line of devices along ``axis`` touches.

    >>> import jax
    >>> mesh = jax.make_mesh((2, 4), ("model", "fsdp"))
    >>> four_per_host = lambda d: d.id // 4
    >>> hosts_spanned(mesh, "model", four_per_host), hosts_spanned(mesh, "fsdp", four_per_host)
    (2, 1)
    """
    ids = np.vectorize(host, otypes=[int])(mesh.devices)
    lines = np.moveaxis(ids, mesh.axis_names.index(axis), -1).reshape(-1, mesh.shape[axis])
    return max(len(set(line.tolist())) for line in lines)


def batch_axes_outer_first(axes: Sequence[str], mesh: Mesh) -> tuple[str, ...]:
    """``axes`` (the batch's, in the strategy's order) with those spanning processes first:
    the axes each process holds one coordinate of, then one it holds part of, then those
    it holds whole, so every process holds one contiguous block of rows to feed
    (``data_shard``). On one process: ``axes`` as given.

    >>> import jax
    >>> batch_axes_outer_first(("fsdp", "data"), jax.make_mesh((4, 2), ("fsdp", "data")))
    ('fsdp', 'data')
    """

    def place(axis: str) -> int:
        spanned = hosts_spanned(mesh, axis, lambda d: d.process_index)
        return 2 if spanned == 1 else 0 if spanned == mesh.shape[axis] else 1

    return tuple(sorted(axes, key=place))


def warn_per_layer_axes_across_hosts(
    mesh: Mesh, roles: Mapping[str, str], across_hosts: Mapping[str, int], *, owner: str
) -> None:
    """One warning line per tensor, sequence or expert axis spanning hosts that the user did
    not place across them (``across_hosts``): its order or size could not hold inside."""
    kind, groups = host_groups(list(mesh.devices.flat))
    if len(groups) == 1:
        return
    host_of = {d.id: h for h, group in enumerate(groups) for d in group}
    for axis in mesh.axis_names:
        role = roles.get(axis, axis)
        if role not in PER_LAYER_ROLES or axis in across_hosts:
            continue
        spanned = hosts_spanned(mesh, axis, lambda d: host_of[d.id])
        if spanned > 1:
            warnings.warn(
                f"{owner}: mesh axis {axis!r} ({role}, size {mesh.shape[axis]}) spans "
                f"{spanned} {kind}{'es' if kind == 'process' else 's'} of {len(groups[0])} "
                "devices, so its per-layer collectives cross hosts; make it at most "
                f"{len(groups[0])}, or say so with Hybrid(..., across_hosts={{{axis!r}: "
                f"{spanned}}}).",
                UserWarning,
                stacklevel=3,
            )
