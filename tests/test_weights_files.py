"""Which safetensors files a source reads, and the headers it refuses: a directory read
through ``model.safetensors.index.json``; offsets that overlap or leave a gap named as
damage (the ``safetensors`` package's own verdict), here and through ``config.init_from``."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import jax
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from test_cli import load, shrink
from test_cli_pretrained import gpt2_config
from test_weights_gpt2 import hf_weights

from nnx_spmd_trainer.app import job, tasks
from nnx_spmd_trainer.weights import (
    SafetensorsSource,
    WeightMap,
    WeightsMismatch,
    load_weights,
    tensor,
)

RNG = np.random.default_rng(0)
SHARDS = {
    "model-00001-of-00002.safetensors": {"a": RNG.normal(size=(4, 3)).astype(np.float32)},
    "model-00002-of-00002.safetensors": {
        "b": RNG.normal(size=(5,)).astype(np.float32),
        "c": RNG.normal(size=(2, 2)).astype(np.float32),
    },
}
TENSORS = {name: array for shard in SHARDS.values() for name, array in shard.items()}


def sharded_checkpoint(directory: Path, consolidated: bool = True) -> None:
    """Hugging Face's layout: the shards, their index, and (as some repositories keep it)
    the consolidated file beside them, here with other values so a read of it shows."""
    for file, shard in SHARDS.items():
        safetensors.numpy.save_file(shard, str(directory / file))
    weight_map = {name: file for file, shard in SHARDS.items() for name in shard}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    if consolidated:
        stale = {name: array + 100 for name, array in TENSORS.items()}
        safetensors.numpy.save_file(stale, str(directory / "model.safetensors"))


def identity_state() -> tuple[nnx.State, WeightMap]:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state = nnx.State(
        {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for n, a in TENSORS.items()}
    )
    return state, WeightMap({n: tensor(n, a.shape) for n, a in TENSORS.items()})


def test_a_directory_with_an_index_reads_the_files_it_names_each_tensor_once(tmp_path):
    sharded_checkpoint(tmp_path)
    source = SafetensorsSource(tmp_path)
    assert source.problems() == []  # without the index: every tensor "also in" the other file
    assert sorted(source.tensors()) == ["a", "b", "c"]
    state, weight_map = identity_state()
    for through in (tmp_path, tmp_path / "model.safetensors.index.json"):
        loaded = load_weights(state, through, weight_map)
        for name, want in TENSORS.items():
            np.testing.assert_array_equal(np.asarray(loaded[name]), want, err_msg=name)


def test_a_tensor_the_index_lists_that_its_file_lacks_and_a_shard_not_there_are_damage(tmp_path):
    sharded_checkpoint(tmp_path, consolidated=False)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["d"] = "model-00002-of-00002.safetensors"  # not in that shard
    index["weight_map"]["e"] = "model-00003-of-00002.safetensors"  # a shard not downloaded
    index_path.write_text(json.dumps(index))
    problems = SafetensorsSource(tmp_path).problems()
    assert problems == [
        f"{index_path} names model-00003-of-00002.safetensors, which is not there: download "
        "the checkpoint's every shard",
        f"{index_path}: d: listed in model-00002-of-00002.safetensors, which lacks it; the "
        "file is damaged: download or export it again",
    ]


def write_raw(path: Path, header: dict, data: bytes) -> None:
    """A safetensors file written by hand: 8 bytes of little-endian length, the JSON, data."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def read_raw(path: Path) -> tuple[dict, bytes]:
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + length]), blob[8 + length :]


def move_smallest_into(path: Path, host: str) -> str:
    """The smallest tensor's offsets moved into the middle of ``host``'s bytes (its own
    bytes left behind, a gap): every size still agrees with its shape and the file."""
    header, data = read_raw(path)
    sizes = {n: e["data_offsets"][1] - e["data_offsets"][0] for n, e in header.items()
             if n != "__metadata__"}  # fmt: skip
    smallest = min(sizes, key=lambda n: (sizes[n], n))
    begin = header[host]["data_offsets"][0] + sizes[host] // 2
    header[smallest]["data_offsets"] = [begin, begin + sizes[smallest]]
    write_raw(path, header, data)
    return smallest


def test_overlapping_or_gapped_offsets_are_named_as_damage_and_nothing_is_loaded(tmp_path):
    safetensors.numpy.save_file(TENSORS, str(tmp_path / "w.safetensors"))
    moved = move_smallest_into(tmp_path / "w.safetensors", host="a")
    assert moved == "c"
    state, weight_map = identity_state()
    with pytest.raises(WeightsMismatch) as raised:
        load_weights(state, tmp_path / "w.safetensors", weight_map)
    assert list(raised.value.problems) == ["damaged"]
    (line,) = raised.value.problems["damaged"]
    # a (bytes 0-48), b (48-68), c (68-84): c moved to 24-40, its own bytes left behind.
    assert line.startswith(
        f"{tmp_path / 'w.safetensors'}: c: its bytes 24-40 overlap a's, up to 48; "
        "bytes 68-84 after b belong to no tensor: "
    ), line
    assert "safetensors refuses the file" in line and "invalid offset" in line, line
    assert line.endswith("the file is damaged: download or export it again"), line

    # A gap: b's bytes start 4 bytes after a's end, the 4 bytes belonging to no tensor.
    a, b = TENSORS["a"], TENSORS["b"]
    header = {"a": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]},
              "b": {"dtype": "F32", "shape": [5], "data_offsets": [52, 72]}}  # fmt: skip
    write_raw(tmp_path / "gap.safetensors", header, a.tobytes() + bytes(4) + b.tobytes())
    (line,) = SafetensorsSource(tmp_path / "gap.safetensors").problems()
    assert line.startswith(
        f"{tmp_path / 'gap.safetensors'}: bytes 48-52 before b belong to no tensor: "
    ), line


def test_init_from_a_gpt2_file_with_a_tensor_moved_into_wte_is_refused(tmp_path):
    """The issue's run: the smallest tensor's offsets in the middle of ``wte.weight`` used
    to load through ``--config.init_from`` without a word, and train on those bytes."""
    config = shrink(load("gpt2_hf"))
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(hf_weights(gpt2_config(config)), str(path))
    moved = move_smallest_into(path, host="wte.weight")
    config.update(init_from=str(path), max_steps=1)
    # refused before the run writes anything, naming the key (the CLI: one line, exit 2)
    with pytest.raises(tasks.ConfigError, match=rf"config\.init_from=.*{moved}: its bytes .* "
                       "overlap wte") as refused:  # fmt: skip
        job.run(config, tmp_path / "run")
    assert isinstance(refused.value.__cause__, WeightsMismatch)
    assert not (tmp_path / "run").exists()
