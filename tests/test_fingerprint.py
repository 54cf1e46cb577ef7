"""Leaf fingerprints: equal to a NumPy computation, layout-independent, sensitive to any bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer.callbacks.checkpoint.fingerprint import fingerprints, mismatches


def numpy_fingerprint(array: np.ndarray) -> int:
    """The definition, written out: wrapping uint32 sum of bits[i] * ((2i + 1) * 2654435761)."""
    words = array.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[array.itemsize])
    bits = words.reshape(-1).astype(np.uint64)
    weights = (np.arange(bits.size, dtype=np.uint64) * 2 + 1) * 2654435761 % 2**32
    return int((bits * weights % 2**32).sum() % 2**32)


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint8, jnp.bfloat16, np.float16])
def test_fingerprint_is_the_numpy_definition(dtype):
    array = (np.random.default_rng(0).normal(size=(6, 10)) * 50).astype(dtype)
    assert fingerprints({"a": array}) == {"a": numpy_fingerprint(np.asarray(array))}


def test_fingerprint_is_the_same_sharded_replicated_and_on_the_host():
    mesh = jax.make_mesh((4, 2), ("fsdp", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    host = np.random.default_rng(1).normal(size=(16, 8)).astype(np.float32)
    sharded = jax.device_put(host, NamedSharding(mesh, P("fsdp", "model")))
    replicated = jax.device_put(host, NamedSharding(mesh, P()))
    values = {fingerprints({"w": x})["w"] for x in (host, sharded, replicated)}
    assert len(values) == 1


def test_any_one_bit_flip_changes_the_fingerprint_and_keys_are_covered():
    array = np.random.default_rng(2).normal(size=(5, 7)).astype(np.float32)
    expected = fingerprints({"w": array, "key": jax.random.key(0)})
    words = array.view(np.uint32).copy()
    for index in [(0, 0), (2, 3), (4, 6)]:
        for bit in (0, 17, 31):
            flipped = words.copy()
            flipped[index] ^= np.uint32(1 << bit)
            tree = {"w": flipped.view(np.float32), "key": jax.random.key(0)}
            assert mismatches(expected, tree) == ["w"], (index, bit)
    assert mismatches(expected, {"w": array, "key": jax.random.key(1)}) == ["key"]
