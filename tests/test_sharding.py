"""Spec resolution is pure: tested against plain {axis: size} meshes, no devices."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer.data_shard import (
    DataShard,
    FedDimension,
    data_shard_of,
    fed_dimension,
    global_batch_shape,
)
from nnx_spmd_trainer.sharding import (
    ShardingError,
    dimension_axes,
    merge_rules,
    resolve_spec,
    shard_largest_dim,
    shard_shape,
)

MESH = {"fsdp": 4, "model": 2}


def test_physical_names_kept_or_replicated_when_absent():
    assert resolve_spec((None, "model"), shape=(8, 16), mesh=MESH) == P(None, "model")
    assert resolve_spec((None, "model"), shape=(8, 16), mesh={"data": 8}) == P()
    assert resolve_spec(("model",), shape=(8, 3), mesh=MESH) == P("model")


def test_leaf_rules_win_over_strategy_rules():
    leaf = (("embed", None), ("hidden", "model"))
    spec = resolve_spec(
        ("embed", "hidden"), shape=(8, 8), mesh=MESH, rules=(("embed", "fsdp"),), leaf_rules=leaf
    )
    assert spec == P(None, "model")
    assert resolve_spec(
        ("embed", "hidden"), shape=(8, 8), mesh=MESH, rules=(("embed", "fsdp"), ("hidden", "model"))
    ) == P("fsdp", "model")


def test_rule_to_several_axes_and_axis_used_once():
    spec = resolve_spec(
        ("batch", None),
        shape=(16, 3),
        mesh={"data": 2, "fsdp": 4},
        rules=(("batch", ("data", "fsdp")),),
    )
    assert spec == P(("data", "fsdp"))
    # the second dimension may not reuse an axis the first already took
    assert resolve_spec(("model", "model"), shape=(4, 4), mesh=MESH) == P("model")


def test_unknown_logical_axis_is_named():
    with pytest.raises(ShardingError, match=r"l1/kernel.*unknown axis name 'embd'.*rules="):
        resolve_spec(
            ("embd", None), shape=(8, 8), mesh=MESH, rules=(("embed", "fsdp"),), path="l1/kernel"
        )


def test_indivisible_dimension_names_path_shape_and_mesh():
    with pytest.raises(ShardingError) as err:
        resolve_spec((None, "model"), shape=(8, 3), mesh=MESH, path="head/kernel")
    message = str(err.value)
    for part in ("head/kernel", "(8, 3)", "'model': 2", "not divisible"):
        assert part in message


def test_too_many_annotation_entries():
    with pytest.raises(ShardingError, match="more entries"):
        resolve_spec(("model", None, None), shape=(8, 8), mesh=MESH)


def test_merge_rules_conflict_and_none_gives_way():
    assert merge_rules([("embed", None)], [("embed", "fsdp")]) == (("embed", "fsdp"),)
    with pytest.raises(ShardingError, match="'mlp' is mapped to 'model' and to 'fsdp'"):
        merge_rules([("mlp", "model")], [("mlp", "fsdp")])


def test_shard_largest_dim():
    assert shard_largest_dim(P(), (3, 64, 32), "fsdp", 4) == P(None, "fsdp")
    assert shard_largest_dim(P(None, "model"), (64, 32), "fsdp", 4) == P("fsdp", "model")
    assert shard_largest_dim(P(), (3, 5), "fsdp", 4) == P()  # nothing divides
    assert shard_largest_dim(P("fsdp"), (8, 8), "fsdp", 4) == P("fsdp")


def test_shard_shape():
    assert shard_shape((16, 8), P("fsdp", "model"), MESH) == (4, 4)
    assert shard_shape((16, 8), P(("fsdp", "model")), MESH) == (2, 8)


def test_context_rules_between_leaf_rules_and_strategy_rules():
    strategy = (("embed", "fsdp"),)
    context = (("embed", "model"), ("my_hidden", "model"))
    resolve = lambda a, **kw: resolve_spec(a, shape=(8, 8), mesh=MESH, rules=strategy, **kw)
    assert resolve(("embed",)) == P("fsdp")
    assert resolve(("embed",), context_rules=context) == P("model")  # context over strategy
    assert resolve(("embed",), context_rules=context, leaf_rules=(("embed", None),)) == P()
    assert resolve(("my_hidden", "embed"), context_rules=context) == P("model")  # axis used once
    # Like Flax's own rules, the context may rename a mesh axis name too.
    assert resolve(("model",), context_rules=(("model", "fsdp"),)) == P("fsdp")
    with pytest.raises(ShardingError, match=r"'my_hidden'.*nnx.logical_axis_rules"):
        resolve(("my_hidden",))


def _ids(rows):
    return np.array(rows)


@pytest.mark.parametrize(
    ("ids", "names", "batch_axes", "expected"),
    [
        # DataParallel over 8 devices, devices 0-3 on process 0
        (np.arange(8) // 4, ("data",), ("data",), [(0, 2), (1, 2)]),
        (np.arange(8) // 2, ("data",), ("data",), [(0, 4), (1, 4), (2, 4), (3, 4)]),
        # fsdp=4 x model=2: a process's devices cover whole fsdp rows
        (_ids([[0, 0], [0, 0], [1, 1], [1, 1]]), ("fsdp", "model"), ("fsdp",), [(0, 2), (1, 2)]),
        (
            _ids([[0, 0], [1, 1], [2, 2], [3, 3]]),
            ("fsdp", "model"),
            ("fsdp",),
            [(0, 4), (1, 4), (2, 4), (3, 4)],
        ),
        # data=2 x model=4, model axis spanning two processes: they feed the same rows
        (
            _ids([[0, 0, 1, 1], [2, 2, 3, 3]]),
            ("data", "model"),
            ("data",),
            [(0, 2), (0, 2), (1, 2), (1, 2)],
        ),
        # no batch axis: every process feeds everything
        (np.arange(8) // 4, ("model",), (), [(0, 1), (0, 1)]),
        # batch over two axes, in the spec's order (not the mesh's)
        (_ids([[0, 1], [0, 1]]), ("fsdp", "model"), ("model", "fsdp"), [(0, 2), (1, 2)]),
    ],
)
def test_data_shard_of(ids, names, batch_axes, expected):
    got = [data_shard_of(ids, names, batch_axes, p) for p in range(len(expected))]
    assert got == [DataShard(*e) for e in expected]


def test_data_shard_of_refuses_layouts_no_slice_fits():
    with pytest.raises(ShardingError, match=r"process 0 holds batch shards \[0, 2, 4, 6\]"):
        data_shard_of(np.arange(8) % 2, ("data",), ("data",), 0)
    # contiguous but misaligned: shards 1-2 on one process
    with pytest.raises(ShardingError, match=r"\[1, 2\] of 4, not one contiguous, aligned"):
        data_shard_of(_ids([0, 1, 1, 2]), ("data",), ("data",), 1)
    with pytest.raises(ShardingError, match=r"unequal numbers of batch shards \(\{0: 6, 1: 2\}\)"):
        data_shard_of(_ids([0] * 6 + [1] * 2), ("data",), ("data",), 0)
    with pytest.raises(ShardingError, match="process 5 owns no device"):
        data_shard_of(np.arange(8) // 4, ("data",), ("data",), 5)
    with pytest.raises(ShardingError, match=r"batch axes \['fsdp'\] are not mesh axes"):
        data_shard_of(np.arange(8) // 4, ("data",), ("fsdp",), 0)


@pytest.mark.parametrize(
    ("spec", "fed"),
    [
        (P(), (0, ())),
        (P("data"), (0, ("data",))),
        (P(("fsdp", "model")), (0, ("fsdp", "model"))),
        (P(None, "data"), (1, ("data",))),
        (P(None, None, ("data", "model"), "fsdp"), (2, ("data", "model"))),
    ],
)
def test_fed_dimension_is_the_first_split_one(spec, fed):
    assert fed_dimension(spec) == FedDimension(*fed)


def test_dimension_axes_and_global_batch_shape():
    assert dimension_axes(P(None, "data"), 3) == ((), ("data",), ())
    assert dimension_axes(P(("fsdp", "model"))) == (("fsdp", "model"),)
    assert global_batch_shape((4, 6, 2), P(None, "data"), 3) == (4, 18, 2)
    assert global_batch_shape((4, 6), P("data", "model"), 2) == (8, 6)
    assert global_batch_shape((4, 6), P(), 2) == (8, 6)  # nothing split: the rows are fed
