"""The weights package without a model: transforms read blocks and invert exactly; sources;
one error naming every problem, before anything is built."""

from __future__ import annotations

import itertools
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import safetensors.numpy
from flax import nnx
from test_weights_gpt2 import CONFIG, hf_weights

from nnx_spmd_trainer import FSDP, Plan, export_params
from nnx_spmd_trainer.app.models.gpt2_hf import GPT2, gpt2_weight_map
from nnx_spmd_trainer.weights import (
    OrbaxSource,
    Pretrained,
    SafetensorsSource,
    TreeSource,
    WeightMap,
    WeightsMismatch,
    cast,
    concat,
    load_weights,
    pad,
    param_targets,
    reshape,
    save_safetensors,
    split,
    stack,
    take,
    tensor,
    transpose,
)

RNG = np.random.default_rng(0)
SOURCE = {
    "a": RNG.normal(size=(4, 6)).astype(np.float32),
    "b": RNG.normal(size=(4, 6)).astype(np.float32),
    "qkv": RNG.normal(size=(3, 12)).astype(np.float32),
    "v": RNG.normal(size=(5, 2)).astype(np.float32),
}


def t(name: str):
    return tensor(name, SOURCE[name].shape)


# name -> (map targets, the same targets computed by NumPy); each case rebuilds its sources
def halves(j: int):
    return {f"h{j}": stack([transpose(split(t(n), 1, 2, j), (1, 0)) for n in "ab"])}


CASES = {
    "transpose": ({"x": transpose(t("a"), (1, 0))}, lambda s: {"x": s["a"].T}),
    "reshape, leading dimension kept": (
        {"x": reshape(t("a"), (4, 2, 3))},
        lambda s: {"x": s["a"].reshape(4, 2, 3)},
    ),
    "reshape, merged": ({"x": reshape(t("a"), (24,))}, lambda s: {"x": s["a"].reshape(24)}),
    "split into parts": (
        {f"p{i}": split(t("qkv"), 1, 3, i) for i in range(3)},
        lambda s: {f"p{i}": s["qkv"][:, 4 * i : 4 * i + 4] for i in range(3)},
    ),
    "stack of transposed halves": (
        halves(0) | halves(1),
        lambda s: {f"h{j}": np.stack([s[n][:, 3 * j : 3 * j + 3].T for n in "ab"]) for j in (0, 1)},
    ),
    "concat": (
        {"x": concat([t("a"), t("b")], 1)},
        lambda s: {"x": np.concatenate([s["a"], s["b"]], 1)},
    ),
    "take from a stack": (
        {"x": take(stack([t("a"), t("b")], axis=1), 1, 1), "y": take(stack([t("a")]), 0, 0)},
        lambda s: {"x": s["b"], "y": s["a"]},
    ),
    "pad": (
        {"x": pad(t("v"), 0, 8, value=-1.0)},
        lambda s: {"x": np.pad(s["v"], ((0, 3), (0, 0)), constant_values=-1)},
    ),
    "cast and back": ({"x": cast(cast(t("a"), np.float64), np.float32)}, lambda s: {"x": s["a"]}),
}


def blocks(shape: tuple[int, ...]):
    """Every block whose bounds are 0, a middle point or the end in each dimension."""
    cuts = [sorted({0, n // 2, n - n // 3, n}) for n in shape]
    per_dim = [[slice(a, b) for a, b in itertools.combinations(c, 2)] for c in cuts]
    return itertools.product(*per_dim)


@pytest.mark.parametrize("case", CASES)
def test_every_block_reads_as_numpy_slices_it(case):
    targets, numpy = CASES[case]
    expected = numpy(SOURCE)
    for name, expr in targets.items():
        assert expr.shape == expected[name].shape and expr.dtype == expected[name].dtype
        for index in blocks(expr.shape):
            np.testing.assert_array_equal(expr.read(index, SOURCE), expected[name][index])


@pytest.mark.parametrize("case", CASES)
def test_saved_backwards_the_sources_come_back_bitwise(tmp_path, case):
    targets, numpy = CASES[case]
    weight_map = WeightMap(targets)
    path = save_safetensors(numpy(SOURCE), tmp_path / "w.safetensors", weight_map)
    written = safetensors.numpy.load_file(str(path))
    assert written.keys() == weight_map.sources().keys()
    for name, array in written.items():
        assert array.tobytes() == SOURCE[name].tobytes(), name


def test_a_source_the_model_fills_only_in_part_is_refused_before_writing(tmp_path):
    weight_map = WeightMap({"q": split(t("qkv"), 1, 3, 0)})
    with pytest.raises(
        WeightsMismatch, match=r"qkv cannot be rebuilt: the model fills 12 of its 36"
    ):
        save_safetensors({"q": SOURCE["qkv"][:, :4]}, tmp_path / "w.safetensors", weight_map)
    assert not list(tmp_path.iterdir())


def test_every_problem_is_named_in_one_error_and_nothing_is_built(tmp_path, monkeypatch):
    w = hf_weights(CONFIG)
    del w["h.1.mlp.c_fc.bias"]  # missing
    w["extra.weight"] = np.zeros(3, np.float32)  # unexpected
    w["wpe.weight"] = w["wpe.weight"][:8]  # wrong shape
    w["ln_f.weight"] = w["ln_f.weight"].astype(np.float16)  # wrong dtype
    cut = {"h.0.mlp.c_fc.weight": w.pop("h.0.mlp.c_fc.weight")}
    safetensors.numpy.save_file(w, str(tmp_path / "a.safetensors"))
    safetensors.numpy.save_file(cut, str(tmp_path / "b.safetensors"))
    data = (tmp_path / "b.safetensors").read_bytes()
    (tmp_path / "b.safetensors").write_bytes(data[:-100])  # truncated

    plan = Plan(lambda rngs: GPT2(CONFIG, rngs), optax.sgd(0.1), strategy=FSDP(8, min_size=1))
    monkeypatch.setattr(jax, "make_array_from_callback", lambda *a: pytest.fail("built"))
    live = len(jax.live_arrays())
    with pytest.raises(WeightsMismatch) as raised:
        load_weights(plan, tmp_path, gpt2_weight_map(CONFIG))
    message = str(raised.value)
    assert message.startswith("6 problem(s)"), message
    for line in [
        "h.1.mlp.c_fc.bias (128,) float32",  # missing
        "extra.weight (3,) float32",  # unexpected
        "wpe.weight: (8, 32), expected (16, 32)",
        "ln_f.weight: float16, expected float32",
        "b.safetensors: h.0.mlp.c_fc.weight: truncated",
        "h.0.mlp.c_fc.weight (32, 128) float32",  # so missing as well
    ]:
        assert line in message, (line, message)
    assert set(raised.value.problems) == {"damaged", "missing", "unexpected", "shape", "dtype"}
    assert len(jax.live_arrays()) == live


def test_a_map_that_does_not_fit_the_model_is_named_too(tmp_path):
    plan = Plan(lambda rngs: GPT2(CONFIG, rngs), optax.sgd(0.1), strategy=FSDP(8, min_size=1))
    targets = dict(gpt2_weight_map(CONFIG).targets)
    del targets["ln_f/bias"]
    targets["ln_f/gain"] = tensor("ln_f.gain", (32,))
    targets["wpe/embedding"] = tensor("wpe.weight", (8, 32))
    safetensors.numpy.save_file(hf_weights(CONFIG), str(tmp_path / "w.safetensors"))
    with pytest.raises(WeightsMismatch) as raised:
        load_weights(plan, tmp_path / "w.safetensors", WeightMap(targets))
    assert raised.value.problems["map"] == [
        "model array ln_f/bias (32,) has no entry in the map (one the source lacks by "
        "design, a LoRA adapter: Pretrained(..., fresh=nnx.LoRAParam))",
        "wpe/embedding: the model has (16, 32) float32, the map makes (8, 32) float32",
        "ln_f/gain: in the map, not an array of the model",
    ]


class TwoLayers(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(16, 8, rngs=rngs), nnx.Linear(8, 4, rngs=rngs)])


def test_export_params_checkpoint_and_a_numpy_tree_load_by_their_names(tmp_path):
    plan = Plan(TwoLayers, optax.sgd(0.1), strategy=FSDP(8, min_size=1))
    with nnx.use_eager_sharding(False):
        model = TwoLayers(nnx.Rngs(3))
    saved = export_params(model, tmp_path / "export")
    identity = WeightMap.identity(param_targets(plan))
    expected = nnx.to_flat_state(nnx.state(model, nnx.Param))
    targets = dict(nnx.to_flat_state(param_targets(plan)))
    for source in (OrbaxSource(saved), TreeSource(nnx.to_pure_dict(nnx.state(model, nnx.Param)))):
        loaded = nnx.to_flat_state(load_weights(plan, source, identity))
        for (path, want), (path2, got) in zip(expected, loaded, strict=True):
            assert path == path2
            np.testing.assert_array_equal(np.asarray(got[...]), np.asarray(want[...]))
            assert got.get_value().sharding == targets[path].get_value().sharding


class Adapted(nnx.Module):
    """A pretrained layer wrapped in a LoRA adapter the file does not have."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        base = nnx.Linear(16, 8, rngs=rngs)
        self.fc = nnx.LoRA(16, 2, 8, base_module=base, rngs=rngs)


def test_fresh_parameters_come_from_the_initializer_and_the_rest_from_the_file(tmp_path):
    file = {"fc.weight": RNG.normal(size=(16, 8)).astype(np.float32),
            "fc.bias": RNG.normal(size=(8,)).astype(np.float32)}  # fmt: skip
    safetensors.numpy.save_file(file, str(tmp_path / "w.safetensors"))
    weight_map = WeightMap(
        {
            "fc/base_module/kernel": tensor("fc.weight", (16, 8)),
            "fc/base_module/bias": tensor("fc.bias", (8,)),
        }  # fmt: skip
    )

    def plan() -> Plan:
        return Plan(Adapted, optax.sgd(0.1), strategy=FSDP(8, min_size=1), wrt=nnx.LoRAParam)

    state = Pretrained(tmp_path / "w.safetensors", weight_map, fresh=nnx.LoRAParam).state(plan())
    fc = state["model"]["fc"]
    np.testing.assert_array_equal(np.asarray(fc["base_module"]["kernel"][...]), file["fc.weight"])
    np.testing.assert_array_equal(np.asarray(fc["base_module"]["bias"][...]), file["fc.bias"])
    random = plan().materialize()["model"]["fc"]  # what the initializer makes, same seed
    for name in ("lora_a", "lora_b"):
        np.testing.assert_array_equal(np.asarray(fc[name][...]), np.asarray(random[name][...]))
    # Without fresh=, the adapters are model arrays the map lacks: named, with the fix.
    with pytest.raises(WeightsMismatch, match=r"fc/lora_a .* fresh=nnx\.LoRAParam"):
        Pretrained(tmp_path / "w.safetensors", weight_map).state(plan())


def test_a_second_source_file_with_a_name_already_seen_is_damage(tmp_path: Path):
    for name in ("a", "b"):
        safetensors.numpy.save_file(
            {"x": np.zeros(2, np.float32)}, str(tmp_path / f"{name}.safetensors")
        )
    with pytest.raises(WeightsMismatch, match=r"b.safetensors: x: also in .*a.safetensors"):
        state = nnx.State({"x": jax.ShapeDtypeStruct((2,), np.float32, sharding=_one_device())})
        load_weights(state, tmp_path, WeightMap({"x": tensor("x", (2,))}))


def test_a_path_with_no_file_is_named_at_once_not_as_every_tensor_missing(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"no weights file at .*nope.safetensors"):
        SafetensorsSource(tmp_path / "nope.safetensors")
    empty = tmp_path / "empty"
    empty.mkdir()
    state = nnx.State({"x": jax.ShapeDtypeStruct((2,), np.float32, sharding=_one_device())})
    with pytest.raises(WeightsMismatch, match=r"empty: no .safetensors file there"):
        load_weights(state, empty, WeightMap({"x": tensor("x", (2,))}))


def _one_device() -> jax.sharding.NamedSharding:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
