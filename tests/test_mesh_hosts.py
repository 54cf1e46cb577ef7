"""Meshes that follow the hosts (issue 41): on 2 processes of 4 devices, the tensor axis of
``Hybrid(TensorParallel(2), FSDP(4))`` lies inside each process, read from the compiled
step's collectives; the data axis spans the processes whatever the members' order; a
tensor axis that cannot fit in a process is named in a warning; losses equal one device's.

One launch of ``mesh_hosts_worker.py`` (2 processes) gives every check its data.
"""

from __future__ import annotations

import io
import math
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import optax
import pytest
from mp_runs import STEPS
from toy_models import Net, make_batches, train_reference

from nnx_spmd_trainer import FSDP, Hybrid, ShardingError, TensorParallel, distributed
from nnx_spmd_trainer.strategies import host_axes

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # starts its own processes
WORKER = Path(__file__).parent / "mesh_hosts_worker.py"
COLLECTIVE = re.compile(
    r"= .*?\b(all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\((.*)$"
)


def iota(dims: list[int], reshape: list[int], perm: list[int] | None) -> np.ndarray:
    """XLA's iota tile assignment: ``arange`` shaped ``reshape``, transposed, shaped ``dims``."""
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    return (ids if perm is None else ids.transpose(perm)).reshape(dims)


def ints(text: str) -> list[int]:
    return [int(n) for n in text.split(",")]


def replica_groups(attributes: str) -> list[list[int]]:
    """The device groups of one collective, from its HLO attributes, in each of the three
    spellings XLA prints: ``{{0,1},{2,3}}``, ``[4,2]<=[2,4]T(1,0)`` (iota: one group per
    row) and ``mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}`` (groups
    along the named axes of that mesh of ids)."""
    if m := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attributes):
        return [ints(g) for g in re.findall(r"\{([\d,]+)\}", m.group(1))]
    if m := re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attributes):
        perm = ints(m.group(3)) if m.group(3) else None
        return iota(ints(m.group(1)), ints(m.group(2)), perm).tolist()
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
        r" \{([^}]*)\}",
        attributes,
    )
    assert m, f"no replica groups read in: {attributes[:300]}"
    axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    reshape = ints(m.group(2)) if m.group(2) else [math.prod(sizes)]
    ids = iota(sizes, reshape, ints(m.group(3)) if m.group(3) else None)
    along = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
    ids = np.moveaxis(ids, along, list(range(len(names) - len(along), len(names))))
    return ids.reshape(-1, math.prod(sizes[i] for i in along)).tolist()


def collectives(hlo: str) -> list[tuple[str, list[list[int]]]]:
    """Every all-reduce, all-gather, reduce-scatter and all-to-all: (op, its groups)."""
    found = []
    for line in hlo.splitlines():
        if m := COLLECTIVE.search(line):
            found.append((m.group(1), replica_groups(m.group(2))))
    return found


def along_axis(groups: list[list[int]], process_ids: np.ndarray, axis: int) -> bool:
    """Whether each group is one line of the mesh along ``axis`` (a device id is its index
    in the mesh's devices, row-major): devices differing in that coordinate alone."""
    coords = np.array(np.unravel_index(np.arange(process_ids.size), process_ids.shape)).T
    others = [d for d in range(process_ids.ndim) if d != axis]
    return all(
        len(g) == process_ids.shape[axis] and len({tuple(coords[i][others]) for i in g}) == 1
        for g in groups
    )


def model_axis_groups(run: str, results) -> tuple[list[list[int]], np.ndarray]:
    """The groups of every model-axis collective of ``run``'s compiled step, and which
    process owns each mesh device."""
    process_ids = results[f"{run}/process_ids"]
    axis = list(results[f"{run}/axes"]).index("model")
    found = [
        g
        for _, groups in collectives(str(results[f"{run}/hlo"]))
        if along_axis(groups, process_ids, axis)
        for g in groups
    ]
    return found, process_ids.reshape(-1)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[str, np.ndarray]:
    out = tmp_path_factory.mktemp("mesh-hosts") / "results.npz"
    log = io.StringIO()
    status = distributed.Launch([sys.executable, str(WORKER), str(out)], 2, out=log).run()
    assert status == 0, log.getvalue()[-4000:]
    return dict(np.load(out))


def test_the_tensor_axis_collectives_stay_inside_a_process(two_processes):
    groups, process_of = model_axis_groups("trained/tp2_fsdp4", two_processes)
    assert groups  # the step reduces over the tensor axis
    assert all(len({int(process_of[i]) for i in g}) == 1 for g in groups), groups
    # The fsdp axis spans the two processes instead, so each feeds half the rows.
    assert two_processes["trained/tp2_fsdp4/process_ids"].tolist() == [[0, 0, 1, 1]] * 2
    assert two_processes["trained/tp2_fsdp4/shard"].tolist() in ([0, 2], [1, 2])


def test_the_tensor_axis_placed_across_the_processes_shows_in_its_collectives(two_processes):
    """across_hosts={"model": 2} puts it across on purpose: the same reading finds every
    tensor-axis group spanning both processes (the check above could fail)."""
    groups, process_of = model_axis_groups("compiled_only/tp2_fsdp4_model_across", two_processes)
    assert groups
    assert all(len({int(process_of[i]) for i in g}) == 2 for g in groups), groups


def test_the_data_axis_spans_the_processes_whatever_the_members_order(two_processes):
    run = "trained/fsdp4_dp2"  # Hybrid(FSDP(4), DataParallel(2)): data listed last
    assert list(two_processes[f"{run}/axes"]) == ["fsdp", "data"]
    assert two_processes[f"{run}/process_ids"].tolist() == [[0, 1]] * 4
    # The rows are split over data first, so each process feeds one block of them.
    assert str(two_processes[f"{run}/batch_spec"]) == "P(('data', 'fsdp'),)"
    assert two_processes[f"{run}/shard"].tolist() in ([0, 2], [1, 2])


@pytest.mark.parametrize("run", ["trained/tp2_fsdp4", "trained/fsdp4_dp2"])
def test_losses_equal_one_device(two_processes, run):
    _, losses = train_reference(Net, optax.adam(1e-2), make_batches(STEPS))
    np.testing.assert_allclose(two_processes[f"{run}/losses"], losses, rtol=1e-5)


def test_an_axis_that_cannot_fit_in_a_process_is_named_in_one_warning_line(two_processes):
    def said(name: str) -> list[str]:
        return list(two_processes[f"warned/{name}/warnings"])

    (tp8,) = said("tp8")
    assert "'model'" in tp8 and "spans 2 processes of 4 devices" in tp8 and "\n" not in tp8
    assert "make it at most 4" in tp8 and "across_hosts={'model': 2}" in tp8
    (seq8,) = said("seq8")
    assert "'seq'" in seq8
    # Silent where the tensor axis fits, for fsdp over both, and where the user said so.
    assert said("tp2_fsdp4") == said("fsdp8") == said("tp8_said") == []


# -- one process: the split of hosts between axes, and bad input -----------------------------


def test_hosts_go_to_the_outermost_roles_first():
    roles = {"model": "model", "fsdp": "fsdp", "data": "data", "stage": "stage"}
    spans = host_axes.hosts_per_axis
    assert spans({"model": 2, "fsdp": 4}, roles, 2, {}, owner="s") == {"model": 1, "fsdp": 2}
    assert spans({"fsdp": 4, "data": 2}, roles, 2, {}, owner="s") == {"fsdp": 1, "data": 2}
    # Four hosts: the data axis takes two, fsdp the other two; the tensor axis none.
    four = spans({"model": 2, "fsdp": 4, "data": 2}, roles, 4, {}, owner="s")
    assert four == {"model": 1, "fsdp": 2, "data": 2}
    assert spans({"data": 2, "stage": 4}, roles, 2, {}, owner="s") == {"data": 1, "stage": 2}
    assert spans({"model": 8}, roles, 2, {}, owner="s") == {"model": 2}


def test_across_hosts_that_cannot_hold_is_refused_naming_the_fix():
    spans = host_axes.hosts_per_axis
    with pytest.raises(ShardingError, match="product is 2"):
        spans({"data": 2, "fsdp": 4}, {}, 2, {"data": 2, "fsdp": 2}, owner="s")
    with pytest.raises(ShardingError, match="must divide its size"):
        spans({"data": 2, "fsdp": 4}, {}, 3, {"data": 3}, owner="s")
    with pytest.raises(ValueError, match=r"\['dat'\] are not mesh axes"):
        Hybrid(TensorParallel(2), FSDP(4), across_hosts={"dat": 2})
    with pytest.raises(ValueError, match="not positive integers"):
        Hybrid(TensorParallel(2), FSDP(4), across_hosts={"fsdp": 0})
    # One process holds every device here: there are no hosts to span.
    with pytest.raises(ShardingError, match="on 1 process"):
        Hybrid(TensorParallel(2), FSDP(4), across_hosts={"fsdp": 2}).make_mesh()


def test_one_process_keeps_jax_make_mesh_order_and_says_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mesh = Hybrid(TensorParallel(8)).make_mesh()
    assert [d.id for d in mesh.devices.flat] == list(range(8))
    assert repr(Hybrid(TensorParallel(8), across_hosts={"model": 1})).endswith(
        "across_hosts={'model': 1})"
    )
