"""Hugging Face GPT-2 weights into a sharded GPT2 and back out, on 8 simulated devices.

The file is written here with HF's names and shapes (no download); the logits are
compared with a NumPy GPT-2 written from the published architecture, independent of
the model's code.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import safetensors.numpy
from flax import nnx

from nnx_spmd_trainer import FSDP, Hybrid, Plan, TensorParallel, Trainer
from nnx_spmd_trainer.app.models.gpt2_hf import GPT2, GPT2Config, gpt2_weight_map, loss_fn
from nnx_spmd_trainer.sharding import path_str
from nnx_spmd_trainer.weights import (
    Pretrained,
    SafetensorsSource,
    load_weights,
    pretrained_state,
    save_safetensors,
)

CONFIG = GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4, dropout=0.0,
                    pad_vocab_to=8)  # fmt: skip


def hf_weights(config: GPT2Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under HF GPT2Model's names and shapes (Conv1D: (in, out))."""
    rng = np.random.default_rng(seed)
    d = config.n_embd
    shapes = {"wte.weight": (config.vocab_size, d), "wpe.weight": (config.n_positions, d)}
    for i in range(config.n_layer):
        for name, shape in {
            "ln_1.weight": (d,), "ln_1.bias": (d,), "ln_2.weight": (d,), "ln_2.bias": (d,),
            "attn.c_attn.weight": (d, 3 * d), "attn.c_attn.bias": (3 * d,),
            "attn.c_proj.weight": (d, d), "attn.c_proj.bias": (d,),
            "mlp.c_fc.weight": (d, 4 * d), "mlp.c_fc.bias": (4 * d,),
            "mlp.c_proj.weight": (4 * d, d), "mlp.c_proj.bias": (d,),
        }.items():  # fmt: skip
            shapes[f"h.{i}.{name}"] = shape
    shapes |= {"ln_f.weight": (d,), "ln_f.bias": (d,)}
    weights = {k: rng.normal(0, 0.2, s).astype(np.float32) for k, s in shapes.items()}
    for k in weights:
        if k.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            weights[k] += 1.0
    return weights


def numpy_gpt2(w: dict[str, np.ndarray], tokens: np.ndarray, config: GPT2Config) -> np.ndarray:
    """GPT-2's forward pass as HF computes it, in float64."""
    w = {k: v.astype(np.float64) for k, v in w.items()}

    def ln(x: np.ndarray, p: str) -> np.ndarray:
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * w[p + ".weight"] + w[p + ".bias"]

    def gelu_new(x: np.ndarray) -> np.ndarray:
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

    b, t = tokens.shape
    heads, hd = config.n_head, config.n_embd // config.n_head
    x = w["wte.weight"][tokens] + w["wpe.weight"][:t]
    causal = np.tril(np.ones((t, t), bool))
    for i in range(config.n_layer):
        h = f"h.{i}."
        qkv = ln(x, h + "ln_1") @ w[h + "attn.c_attn.weight"] + w[h + "attn.c_attn.bias"]
        q, k, v = (a.reshape(b, t, heads, hd).transpose(0, 2, 1, 3) for a in np.split(qkv, 3, -1))
        scores = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        merged = (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, config.n_embd)
        x = x + merged @ w[h + "attn.c_proj.weight"] + w[h + "attn.c_proj.bias"]
        m = gelu_new(ln(x, h + "ln_2") @ w[h + "mlp.c_fc.weight"] + w[h + "mlp.c_fc.bias"])
        x = x + m @ w[h + "mlp.c_proj.weight"] + w[h + "mlp.c_proj.bias"]
    return ln(x, "ln_f") @ w["wte.weight"].T


def expected_params(w: dict[str, np.ndarray], config: GPT2Config, scan: bool) -> dict:
    """The model's arrays made from HF's by plain NumPy: what every shard must equal."""
    d, vocab = config.n_embd, config.vocab_size
    wte = np.zeros((config.padded_vocab_size, d), np.float32)
    wte[:vocab] = w["wte.weight"]
    out = {"wte/embedding": wte, "wpe/embedding": w["wpe.weight"]}
    out |= {"ln_f/scale": w["ln_f.weight"], "ln_f/bias": w["ln_f.bias"]}
    layers = []
    for i in range(config.n_layer):
        h, one = f"h.{i}.", {}
        for j, part in enumerate("qkv"):
            one[f"attn/{part}/kernel"] = w[h + "attn.c_attn.weight"][:, j * d : (j + 1) * d]
            one[f"attn/{part}/bias"] = w[h + "attn.c_attn.bias"][j * d : (j + 1) * d]
        for m in ("attn/c_proj", "mlp/c_fc", "mlp/c_proj"):
            hf = h + m.replace("/", ".")
            one[m + "/kernel"], one[m + "/bias"] = w[hf + ".weight"], w[hf + ".bias"]
        for n in ("ln_1", "ln_2"):
            one[n + "/scale"], one[n + "/bias"] = w[h + n + ".weight"], w[h + n + ".bias"]
        layers.append(one)
    for key in layers[0]:
        if scan:
            out[f"h/{key}"] = np.stack([one[key] for one in layers])
        else:
            out |= {f"h/{i}/{key}": one[key] for i, one in enumerate(layers)}
    return out


class CountingSource(SafetensorsSource):
    """Samples each device's bytes of live arrays at every read of a file tensor."""

    def __getitem__(self, name: str) -> np.ndarray:
        self.peak = getattr(self, "peak", {})
        for device, used in device_bytes().items():
            self.peak[device] = max(self.peak.get(device, 0), used)
        return super().__getitem__(name)


def device_bytes() -> dict[int, int]:
    """Each device's bytes of distinct live buffers (a shard's ``data`` aliases its array's)."""
    buffers = {}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            buffers[(shard.device.id, shard.data.unsafe_buffer_pointer())] = shard.data.nbytes
    used: dict[int, int] = {}
    for (device, _), n in buffers.items():
        used[device] = used.get(device, 0) + n
    return used


def plan_for(strategy, scan: bool = False) -> Plan:
    return Plan(lambda rngs: GPT2(CONFIG, rngs, scan_layers=scan), optax.adam(1e-3),
                strategy=strategy, loss_fn=loss_fn)  # fmt: skip


def flat(params) -> dict[str, jax.Array]:
    return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def logits_of(plan: Plan, params, tokens: np.ndarray) -> np.ndarray:
    model = nnx.merge(plan.graphdef, pretrained_state(plan, params))["model"]
    model.eval()
    with jax.set_mesh(plan.mesh):
        return np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))


def load_and_check(plan: Plan, path: Path, scan: bool, w: dict[str, np.ndarray], monkeypatch):
    source = CountingSource(path)
    handed: list[int] = []  # per array built: the bytes of the host blocks given to devices
    build = jax.make_array_from_callback

    def counting(shape, sharding, callback):
        blocks: dict[int, int] = {}

        def counted(index):
            block = callback(index)
            blocks[id(block)] = block.nbytes  # the same block for replicated devices, once
            return block

        array = build(shape, sharding, counted)
        handed.append(sum(blocks.values()))
        return array

    monkeypatch.setattr(jax, "make_array_from_callback", counting)
    before = device_bytes()
    params = load_weights(plan, source, gpt2_weight_map(CONFIG, scan_layers=scan))
    monkeypatch.undo()
    expected = expected_params(w, CONFIG, scan)
    arrays = flat(params)
    assert set(arrays) == set(expected)
    for name, array in arrays.items():
        assert array.sharding == flat(plan.state_targets()["model"])[name].sharding, name
        for shard in array.addressable_shards:  # every device's block is its NumPy slice
            np.testing.assert_array_equal(np.asarray(shard.data), expected[name][shard.index])
    # Device memory: each device's live bytes, sampled at every file read and at the end,
    # minus what it held before, against the model's bytes / 8.
    model_bytes = sum(x.nbytes for x in expected.values())
    after = device_bytes()
    peak = max(max(source.peak.get(d, 0), after[d]) - before.get(d, 0) for d in after)
    assert peak <= model_bytes / 8 * 1.1, (peak, model_bytes)
    # Host: the blocks handed to the devices for one array are at most that array's bytes
    # (a replicated block is read once; each array's blocks are dropped before the next).
    assert len(handed) == len(expected)
    assert max(handed) <= max(x.nbytes for x in expected.values())
    return params


@pytest.fixture
def hf_file(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    w = hf_weights(CONFIG)
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(w, str(path))
    return path, w


TOKENS = np.random.default_rng(1).integers(0, CONFIG.vocab_size, (2, CONFIG.n_positions))


@pytest.mark.parametrize(
    "strategy,scan",
    [
        (FSDP(8, min_size=1), False),
        (Hybrid(FSDP(4, min_size=1), TensorParallel(2)), False),
        (Hybrid(FSDP(4, min_size=1), TensorParallel(2)), True),
    ],
    ids=["fsdp8", "fsdp4xtp2", "fsdp4xtp2-scan"],
)
def test_hf_gpt2_loads_sharded_and_gives_hfs_logits(hf_file, strategy, scan, monkeypatch):
    path, w = hf_file
    plan = plan_for(strategy, scan)
    params = load_and_check(plan, path, scan, w, monkeypatch)
    if isinstance(strategy, Hybrid):  # whole heads per device: q split on its outputs
        q = flat(params)["h/attn/q/kernel" if scan else "h/0/attn/q/kernel"]
        assert "model" in str(q.sharding.spec)
    logits = logits_of(plan, params, TOKENS)
    reference = numpy_gpt2(w, TOKENS, CONFIG)
    np.testing.assert_allclose(logits[..., : CONFIG.vocab_size], reference, rtol=1e-5, atol=1e-5)
    assert (logits[..., CONFIG.vocab_size :] == np.finfo(np.float32).min).all()


def test_an_lm_head_file_with_prefix_and_mask_buffers_loads(tmp_path, hf_file):
    _, w = hf_file
    lm = {"transformer." + k: v for k, v in w.items()}
    lm["lm_head.weight"] = w["wte.weight"]
    lm["transformer.h.0.attn.bias"] = np.tril(np.ones((1, 1, 16, 16), np.float32))
    safetensors.numpy.save_file(lm, str(tmp_path / "lm.safetensors"))
    plan = plan_for(FSDP(8, min_size=1), scan=True)
    params = load_weights(
        plan, tmp_path / "lm.safetensors", gpt2_weight_map(CONFIG, scan_layers=True)
    )
    np.testing.assert_array_equal(np.asarray(flat(params)["ln_f/bias"]), w["ln_f.bias"])


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_export_is_hfs_file_and_reimports_bitwise(tmp_path, hf_file, scan):
    path, w = hf_file
    plan = plan_for(Hybrid(FSDP(4, min_size=1), TensorParallel(2)), scan)
    weight_map = gpt2_weight_map(CONFIG, scan_layers=scan)
    params = load_weights(plan, path, weight_map)
    out = save_safetensors(params, tmp_path / "out.safetensors", weight_map)
    written = safetensors.numpy.load_file(str(out))  # safetensors alone reads it
    assert written.keys() == w.keys()
    for name in w:
        assert written[name].shape == w[name].shape and written[name].dtype == w[name].dtype
        assert written[name].tobytes() == w[name].tobytes(), name
    other = plan_for(FSDP(8, min_size=1), scan)  # into another layout, bitwise
    again = flat(load_weights(other, out, weight_map))
    for name, array in flat(params).items():
        assert np.asarray(again[name]).tobytes() == np.asarray(array).tobytes(), name


def test_a_trainer_starts_from_the_file_and_a_resume_from_its_checkpoints_wins(hf_file, tmp_path):
    from nnx_spmd_trainer.callbacks import OrbaxCheckpoint

    path, w = hf_file
    weight_map = gpt2_weight_map(CONFIG)

    def trainer(**kwargs) -> Trainer:
        plan = plan_for(Hybrid(FSDP(4, min_size=1), TensorParallel(2)))
        return Trainer(plan, init_from=Pretrained(path, weight_map), **kwargs)

    first = trainer()
    np.testing.assert_array_equal(
        np.asarray(first.model.h[1].mlp.c_fc.kernel[...]), w["h.1.mlp.c_fc.weight"]
    )
    assert first.step == 0  # the optimizer starts fresh from the loaded parameters
    for moment in jax.tree.leaves(first.optimizer.opt_state):
        assert not np.asarray(moment).any()

    rows = np.random.default_rng(2).integers(0, CONFIG.vocab_size, (8, CONFIG.n_positions + 1))
    batches = [{"inputs": rows[:, :-1], "targets": rows[:, 1:]}] * 2
    checkpoints = tmp_path / "checkpoints"
    trained = trainer(callbacks=[OrbaxCheckpoint(checkpoints, save_every_n_steps=2)])
    trained.fit(batches, max_steps=2)
    kernel = np.asarray(trained.model.h[1].mlp.c_fc.kernel[...])
    assert not np.array_equal(kernel, w["h.1.mlp.c_fc.weight"])  # it trained

    path.unlink()  # a resumed run never reads the pretrained file
    resumed = trainer(callbacks=[OrbaxCheckpoint(checkpoints, save_every_n_steps=2)])
    with pytest.warns(UserWarning, match="trains no step"):  # step 2 restored at the start
        resumed.fit(batches, max_steps=2)
    assert resumed.step == 2
    np.testing.assert_array_equal(np.asarray(resumed.model.h[1].mlp.c_fc.kernel[...]), kernel)

    out = resumed.export(tmp_path / "out.safetensors", weight_map=weight_map)
    written = safetensors.numpy.load_file(str(out))
    assert written.keys() == w.keys()
    np.testing.assert_array_equal(written["h.1.mlp.c_fc.weight"], kernel)
