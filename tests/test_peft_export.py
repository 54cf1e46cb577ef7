"""weights.peft: LoRA adapters in PEFT's directory format, written, read and checked against
a fixture built by hand from PEFT's documented format (not by the writer)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.numpy

from nnx_spmd_trainer.app.models.gpt2_hf import GPT2Config, gpt2_weight_map
from nnx_spmd_trainer.weights import WeightMap, tensor, transpose
from nnx_spmd_trainer.weights.peft import (
    PeftAdapter,
    adapter_arrays,
    peft_adapter,
    read_peft_adapter,
    write_peft_adapter,
)

CONFIG = GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=2, n_head=2)
D, RANK, ALPHA = 8, 2, 6.0
ADAPTED = ("attn/q", "attn/k", "attn/v", "attn/c_proj", "mlp/c_fc")
SIZES = {"attn/q": (D, D), "attn/k": (D, D), "attn/v": (D, D), "attn/c_proj": (D, D)}
SIZES["mlp/c_fc"] = (D, 4 * D)


def library_adapters(seed: int = 0, stacked: bool = False) -> dict[str, tuple]:
    rng = np.random.default_rng(seed)
    out = {}
    for layer in range(CONFIG.n_layer):
        for name in ADAPTED:
            n_in, n_out = SIZES[name]
            a = rng.normal(size=(n_in, RANK)).astype(np.float32)
            b = rng.normal(size=(RANK, n_out)).astype(np.float32)
            out[f"h/{layer}/{name}/kernel"] = (a, b)
    if stacked:
        return {
            f"h/{name}/kernel": tuple(
                np.stack([out[f"h/{i}/{name}/kernel"][j] for i in range(CONFIG.n_layer)])
                for j in (0, 1)
            )
            for name in ADAPTED
        }
    return out


def peft_delta(adapter: PeftAdapter, module: str) -> np.ndarray:
    """PEFT's update in a Conv1D file's layout ``[in, out]``: ``(scaling * B @ A).T``
    (``peft.tuners.lora.layer.Linear.get_delta_weight`` with ``fan_in_fan_out``)."""
    a, b = adapter.pair(module)
    return (adapter.scaling(module) * b @ a).T


def test_gpt2_adapters_become_peft_modules_with_the_same_update():
    adapters = library_adapters()
    adapter = peft_adapter(
        adapters,
        gpt2_weight_map(CONFIG),
        rank=RANK,
        alpha=ALPHA,
        fan_in_fan_out=True,
        module_prefix="transformer.",
    )
    assert adapter.modules() == sorted(
        f"transformer.h.{i}.{m}"
        for i in range(2)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc")
    )
    assert adapter.tensors["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"].shape == (
        3 * RANK,
        D,
    )
    assert adapter.tensors["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"].shape == (
        3 * D,
        3 * RANK,
    )
    assert adapter.tensors["base_model.model.transformer.h.1.mlp.c_fc.lora_B.weight"].shape == (
        4 * D,
        RANK,
    )
    config = adapter.config
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", RANK, ALPHA)
    assert config["fan_in_fan_out"] is True and config["bias"] == "none"
    assert config["rank_pattern"]["transformer.h.0.attn.c_attn"] == 3 * RANK
    for i in range(2):
        fused = np.concatenate(
            [ALPHA / RANK * np.matmul(*adapters[f"h/{i}/attn/{p}/kernel"]) for p in "qkv"], axis=1
        )
        np.testing.assert_allclose(
            peft_delta(adapter, f"transformer.h.{i}.attn.c_attn"), fused, rtol=1e-6, atol=1e-6
        )
        mlp = ALPHA / RANK * np.matmul(*adapters[f"h/{i}/mlp/c_fc/kernel"])
        np.testing.assert_allclose(
            peft_delta(adapter, f"transformer.h.{i}.mlp.c_fc"), mlp, rtol=1e-6, atol=1e-6
        )


@pytest.mark.parametrize("scan", [False, True])
def test_written_directory_reads_back_to_the_same_adapters(tmp_path, scan):
    adapters = library_adapters(stacked=scan)
    weight_map = gpt2_weight_map(CONFIG, scan_layers=scan)
    adapter = peft_adapter(adapters, weight_map, rank=RANK, alpha=ALPHA, fan_in_fan_out=True)
    write_peft_adapter(adapter, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    again = read_peft_adapter(tmp_path / "out")
    assert again.config == adapter.config
    kernels = {p: (*a.shape[:-1], b.shape[-1]) for p, (a, b) in adapters.items()}
    back = adapter_arrays(again, weight_map, kernels, rank=RANK, alpha=ALPHA)
    assert back.keys() == adapters.keys()
    for path, (a, b) in adapters.items():
        np.testing.assert_array_equal(back[path][0], a)
        np.testing.assert_array_equal(back[path][1], b)


def hand_written_fixture(directory, rng) -> dict[str, np.ndarray]:
    """A PEFT LoRA directory for GPT2LMHeadModel as PEFT's docs describe it, built without
    the writer: ``adapter_config.json`` (``LoraConfig`` fields, ``fan_in_fan_out`` for
    Conv1D) and ``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight``
    ``[r, in]`` and ``lora_B.weight`` ``[out, r]``; PEFT's own c_attn is one rank-r module."""
    directory.mkdir()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "gpt2",
        "r": RANK,
        "lora_alpha": 4,
        "lora_dropout": 0.05,
        "target_modules": ["c_attn", "c_proj"],
        "fan_in_fan_out": True,
        "bias": "none",
        "use_rslora": False,
        "rank_pattern": {},
        "alpha_pattern": {"attn.c_proj": 8},
        "modules_to_save": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    tensors = {}
    for i in range(2):
        for module, n_out in (("attn.c_attn", 3 * D), ("attn.c_proj", D)):
            name = f"base_model.model.transformer.h.{i}.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(size=(RANK, D)).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = rng.normal(size=(n_out, RANK)).astype(np.float32)
    safetensors.numpy.save_file(tensors, str(directory / "adapter_model.safetensors"))
    return tensors


def test_a_hand_written_peft_directory_reads_into_the_library_and_back(tmp_path):
    tensors = hand_written_fixture(tmp_path / "fixture", np.random.default_rng(1))
    adapter = read_peft_adapter(tmp_path / "fixture")
    assert adapter.scaling("transformer.h.0.attn.c_attn") == 4 / RANK
    assert adapter.scaling("transformer.h.0.attn.c_proj") == 8 / RANK  # alpha_pattern
    weight_map = gpt2_weight_map(CONFIG)
    kernels = {
        f"h/{i}/attn/{p}/kernel": (D, D) for i in range(2) for p in ("q", "k", "v", "c_proj")
    }
    ours = adapter_arrays(
        adapter, weight_map, kernels, rank=RANK, alpha=ALPHA, module_prefix="transformer."
    )
    for i in range(2):  # each library kernel's update is its columns of PEFT's update
        name = f"base_model.model.transformer.h.{i}.attn"
        c_attn = (
            4
            / RANK
            * tensors[f"{name}.c_attn.lora_B.weight"]
            @ tensors[f"{name}.c_attn.lora_A.weight"]
        ).T
        c_proj = (
            8
            / RANK
            * tensors[f"{name}.c_proj.lora_B.weight"]
            @ tensors[f"{name}.c_proj.lora_A.weight"]
        ).T
        for j, p in enumerate("qkv"):
            got = ALPHA / RANK * np.matmul(*ours[f"h/{i}/attn/{p}/kernel"])
            np.testing.assert_allclose(got, c_attn[:, j * D : (j + 1) * D], rtol=1e-5, atol=1e-6)
        got = ALPHA / RANK * np.matmul(*ours[f"h/{i}/attn/c_proj/kernel"])
        np.testing.assert_allclose(got, c_proj, rtol=1e-5, atol=1e-6)
    # and written again: c_proj's tensors as they were (scale folded back), c_attn the same update
    again = peft_adapter(
        ours, weight_map, rank=RANK, alpha=ALPHA, fan_in_fan_out=True, module_prefix="transformer."
    )
    for i in range(2):
        module = f"transformer.h.{i}.attn.c_attn"
        expected = (
            4
            / RANK
            * tensors[f"base_model.model.{module}.lora_B.weight"]
            @ tensors[f"base_model.model.{module}.lora_A.weight"]
        ).T
        np.testing.assert_allclose(peft_delta(again, module), expected, rtol=1e-5, atol=1e-6)
        a, _ = again.pair(f"transformer.h.{i}.attn.c_proj")
        np.testing.assert_array_equal(
            a, tensors[f"base_model.model.transformer.h.{i}.attn.c_proj.lora_A.weight"]
        )


def test_a_linear_file_is_out_by_in():
    """A PyTorch Linear stores ``[out, in]`` (the map transposes it): A [r, in], B [out, r]."""
    weight_map = WeightMap({"proj/kernel": transpose(tensor("proj.weight", (5, 3)), (1, 0))})
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(3, RANK)), rng.normal(size=(RANK, 5))
    adapter = peft_adapter({"proj/kernel": (a, b)}, weight_map, rank=RANK, alpha=ALPHA)
    lora_A, lora_B = adapter.pair("proj")
    assert lora_A.shape == (RANK, 3) and lora_B.shape == (5, RANK)
    assert adapter.config["fan_in_fan_out"] is False
    np.testing.assert_allclose(
        adapter.scaling("proj") * lora_B @ lora_A, (ALPHA / RANK * a @ b).T, rtol=1e-6
    )


def test_bad_directories_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_peft_adapter(tmp_path)
    hand_written_fixture(tmp_path / "f", np.random.default_rng(0))
    config = json.loads((tmp_path / "f/adapter_config.json").read_text())
    (tmp_path / "f/adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    with pytest.raises(ValueError, match="only 'LORA'"):
        read_peft_adapter(tmp_path / "f")
    (tmp_path / "f/adapter_config.json").write_text(json.dumps({**config, "r": 3}))
    with pytest.raises(ValueError, match=r"\[r, in\] and \[out, r\] with r = 3"):
        read_peft_adapter(tmp_path / "f")
    with pytest.raises(FileExistsError):
        write_peft_adapter(PeftAdapter(config, {}), tmp_path / "f")


# -- from a model's nnx.LoRA layers: the adapters and the merged weights ---------------------
def adapted_gpt2(config: GPT2Config, seed: int = 0):
    """GPT-2 with nnx.LoRA (rank RANK) on q, v and mlp.c_fc, every adapter non-zero."""
    from flax import nnx

    from nnx_spmd_trainer.app.models.gpt2_hf import GPT2

    rngs = nnx.Rngs(seed)
    with nnx.use_eager_sharding(False):
        model = GPT2(config, rngs)
        for block in model.h:
            for owner, name in ((block.attn, "q"), (block.attn, "v"), (block.mlp, "c_fc")):
                base = getattr(owner, name)
                lora = nnx.LoRA(base.in_features, RANK, base.out_features, base_module=base,
                                b_initializer=nnx.initializers.normal(0.5), rngs=rngs)  # fmt: skip
                setattr(owner, name, lora)
    model.eval()
    return model


def test_the_merged_export_loads_as_the_plain_model_with_the_same_logits(tmp_path):
    from flax import nnx

    from nnx_spmd_trainer.app.models.gpt2_hf import GPT2
    from nnx_spmd_trainer.weights import save_safetensors
    from nnx_spmd_trainer.weights.merge import merged_params

    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=2, n_head=2, dropout=0.0)
    model = adapted_gpt2(config)
    tokens = np.random.default_rng(0).integers(0, 32, size=(2, 12)).astype(np.int32)
    adapted = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))
    path = save_safetensors(merged_params(model), tmp_path / "model.safetensors",
                            gpt2_weight_map(config))  # fmt: skip
    file = safetensors.numpy.load_file(str(path))
    with nnx.use_eager_sharding(False):
        plain = GPT2(config, nnx.Rngs(1))
    by_path = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(plain, nnx.Param))}
    for target, expr in gpt2_weight_map(config).targets.items():  # the file read by the map
        by_path[target].set_value(expr.read(tuple(slice(0, n) for n in expr.shape), file))
    plain.eval()
    logits = nnx.jit(lambda m, t: m(t))(plain, tokens)
    np.testing.assert_allclose(np.asarray(logits), adapted, rtol=1e-5, atol=1e-5)
    # and the adapters changed the weights: the merged q is not the base's
    base = model.h[0].attn.q.base_module.kernel[...]
    merged_q = file["h.0.attn.c_attn.weight"][:, : config.n_embd]
    assert not np.allclose(merged_q, np.asarray(base), atol=1e-4)


def test_a_models_lora_layers_export_as_peft_modules(tmp_path):
    from nnx_spmd_trainer.weights.merge import lora_pairs

    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=2, n_head=2, dropout=0.0)
    model = adapted_gpt2(config)
    pairs = lora_pairs(model)
    assert sorted(pairs) == sorted(
        f"h/{i}/{m}/kernel" for i in range(2) for m in ("attn/q", "attn/v", "mlp/c_fc")
    )
    # nnx.LoRA adds lora_a @ lora_b unscaled: alpha = rank makes PEFT's scaling 1
    adapter = peft_adapter(pairs, gpt2_weight_map(config), rank=RANK, alpha=RANK,
                           fan_in_fan_out=True, module_prefix="transformer.")  # fmt: skip
    d = config.n_embd
    for i in range(2):
        layer = model.h[i].attn
        delta = peft_delta(adapter, f"transformer.h.{i}.attn.c_attn")
        q = np.asarray(layer.q.lora_a[...] @ layer.q.lora_b[...])
        v = np.asarray(layer.v.lora_a[...] @ layer.v.lora_b[...])
        np.testing.assert_allclose(delta[:, :d], q, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(delta[:, d : 2 * d], 0)  # k has no adapter
        np.testing.assert_allclose(delta[:, 2 * d :], v, rtol=1e-5, atol=1e-6)
        assert adapter.rank(f"transformer.h.{i}.attn.c_attn") == 2 * RANK
    write_peft_adapter(adapter, tmp_path / "peft")
    assert read_peft_adapter(tmp_path / "peft").config["target_modules"] == adapter.modules()


def test_the_layout_and_module_names_are_read_from_the_weight_map():
    """Without ``fan_in_fan_out``/``module_prefix``, the map says: GPT-2's files hold its
    kernels ``[in, out]`` (Conv1D) and its first prefix names GPT2LMHeadModel's modules; a
    Linear map (transposed) is ``[out, in]``. (Before, GPT-2's map without the flags was
    refused: "not laid out ... as rows by columns".)"""
    from nnx_spmd_trainer.weights.peft import file_layout

    adapters, weight_map = library_adapters(), gpt2_weight_map(CONFIG)
    told = peft_adapter(adapters, weight_map, rank=RANK, alpha=ALPHA, fan_in_fan_out=True,
                        module_prefix="transformer.")  # fmt: skip
    read = peft_adapter(adapters, weight_map, rank=RANK, alpha=ALPHA)
    assert read.config == told.config and read.config["fan_in_fan_out"] is True
    assert read.tensors.keys() == told.tensors.keys()
    assert "transformer.h.0.attn.c_attn" in read.modules()
    for name, value in told.tensors.items():
        np.testing.assert_array_equal(read.tensors[name], value)

    linear = WeightMap({"proj/kernel": transpose(tensor("proj.weight", (5, 3)), (1, 0))})
    assert file_layout(linear, {"proj/kernel": (3, 5)}) is False
    mixed = WeightMap(
        {"proj/kernel": transpose(tensor("proj.weight", (5, 3)), (1, 0)),
         "conv/kernel": tensor("conv.weight", (3, 5))}
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"some adapted kernels \[in, out\] \(conv/kernel\)"):
        file_layout(mixed, {"proj/kernel": (3, 5), "conv/kernel": (3, 5)})


def test_an_adapter_of_the_model_with_or_without_its_head_reads_back_without_a_prefix():
    """``adapter_arrays`` looks a module up as it is, then with the map's prefixes: PEFT's
    adapter of GPT2LMHeadModel (``transformer.h.0...``) and of GPT2Model (``h.0...``)."""
    adapters, weight_map = library_adapters(seed=4), gpt2_weight_map(CONFIG)
    kernels = {p: (*a.shape[:-1], b.shape[-1]) for p, (a, b) in adapters.items()}
    for prefix in ("transformer.", ""):
        adapter = peft_adapter(adapters, weight_map, rank=RANK, alpha=ALPHA, module_prefix=prefix)
        assert f"{prefix}h.1.mlp.c_fc" in adapter.modules()
        back = adapter_arrays(adapter, weight_map, kernels, rank=RANK, alpha=ALPHA)
        for path, (a, b) in adapters.items():
            np.testing.assert_array_equal(back[path][0], a)
            np.testing.assert_array_equal(back[path][1], b)
