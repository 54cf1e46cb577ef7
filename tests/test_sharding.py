"""Spec resolution is pure: tested against plain {axis: size} meshes, no devices."""

import pytest
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer.sharding import (
    ShardingError,
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
