"""docs/topics/finetuning.md's commands run as written: its Python block (a tiny GPT-2
file), then its two ``gpt2_hf`` commands (LoRA from that safetensors folder with
``--config.lora.rank``, exported as a PEFT adapter, then merged), each read back: the
merged folder is one ``transformers`` reads (``config.json`` against its ``GPT2Config``),
the adapter names its base and loads into a model in one call, and both give the
logits of an independent NumPy GPT-2 on the merged weights."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import environment_for_own_devices

DOC = Path(__file__).resolve().parents[1] / "docs" / "topics" / "finetuning.md"

pytestmark = pytest.mark.serial  # a CLI story: three processes, one after the other


def blocks(language: str) -> list[str]:
    """The page's fenced blocks in ``language``, in order."""
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


def gpt2_commands() -> list[list[str]]:
    """The page's ``nnx-spmd-train --config=gpt2_hf ...`` commands, as argument lists."""
    found = []
    for block in blocks("bash"):
        text = block.replace("\\\n", " ")
        found += [shlex.split(line) for line in text.splitlines() if "--config=gpt2_hf" in line]
    return found


@pytest.fixture(scope="module")
def walked(tmp_path_factory) -> Path:
    """A folder where the page's Python block and commands ran, in order."""
    here = tmp_path_factory.mktemp("finetuning-doc")
    (python,) = [b for b in blocks("python") if "tiny-gpt2" in b]
    subprocess.run([sys.executable, "-c", python], cwd=here, check=True, timeout=300)
    commands = gpt2_commands()
    assert len(commands) == 2 and all(c[0] == "nnx-spmd-train" for c in commands)
    for command in commands:
        proc = subprocess.run(
            [sys.executable, "-m", "nnx_spmd_trainer", *command[1:]],
            cwd=here, env=environment_for_own_devices(), capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
    return here


def tiny_config():
    from nnx_spmd_trainer.app.models.gpt2_hf import GPT2Config

    return GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4)


def test_the_pages_commands_run_and_write_what_it_says(walked):
    assert sorted(p.name for p in (walked / "tiny-lora").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert sorted(p.name for p in (walked / "tiny-merged").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]  # gpt2_hf's byte tokens: no tokenizer.json to give
    assert not list(walked.glob("*.partial"))


def test_the_merged_folder_is_a_gpt2_transformers_reads(walked):
    import safetensors.numpy
    from transformers import AutoConfig, GPT2Config

    from nnx_spmd_trainer.app.models.gpt2_hf import gpt2_weight_map

    ours = tiny_config()
    theirs = GPT2Config.from_pretrained(walked / "tiny-merged")
    assert AutoConfig.from_pretrained(walked / "tiny-merged").model_type == "gpt2"
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        assert getattr(theirs, key) == getattr(ours, key), key
    assert theirs.activation_function == "gelu_new" and theirs.tie_word_embeddings
    assert theirs.layer_norm_epsilon == ours.layer_norm_epsilon
    assert theirs.architectures == ["GPT2LMHeadModel"]
    file = safetensors.numpy.load_file(str(walked / "tiny-merged" / "model.safetensors"))
    assert file.keys() == gpt2_weight_map(ours).sources().keys()  # GPT2Model's names


def test_the_adapter_names_its_base_and_loads_in_one_call(walked):
    """``load_peft_adapter`` on a plain GPT-2 of the base file gives the logits of an
    independent NumPy GPT-2 (float64) on the merged file: adapter, merge and loader agree."""
    import jax
    import safetensors.numpy
    from flax import nnx
    from test_weights_gpt2 import numpy_gpt2

    from nnx_spmd_trainer import path_str, weights
    from nnx_spmd_trainer.app.models.gpt2_hf import GPT2, gpt2_weight_map
    from nnx_spmd_trainer.weights.expr import full_index

    config = json.loads((walked / "tiny-lora" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((walked / "tiny-gpt2").absolute())
    gpt2 = tiny_config()
    weight_map = gpt2_weight_map(gpt2)
    base = safetensors.numpy.load_file(str(walked / "tiny-gpt2" / "model.safetensors"))
    with nnx.use_eager_sharding(False):
        model = GPT2(gpt2, nnx.Rngs(0))
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        expr = weight_map.targets[path_str(path)]
        variable.set_value(np.asarray(expr.read(full_index(expr.shape), base)))
    assert weights.load_peft_adapter(model, walked / "tiny-lora", weight_map) is model
    assert len(nnx.state(model, nnx.LoRAParam)) > 0
    model.eval()
    tokens = np.asarray(jax.random.randint(jax.random.key(0), (2, 16), 0, 256))
    got = np.asarray(model(tokens))[..., : gpt2.vocab_size]
    merged = safetensors.numpy.load_file(str(walked / "tiny-merged" / "model.safetensors"))
    want = numpy_gpt2(merged, tokens, gpt2)
    # The adapters' effect on the logits (small: 4 steps at the page's learning rate),
    # compared where float32's rounding of the logits is far below it.
    before = numpy_gpt2(base, tokens, gpt2)
    effect = np.abs(want - before).max()
    assert effect > 1e-6  # the adapters moved off their start (B = 0)
    np.testing.assert_allclose(got - before, want - before, rtol=0, atol=effect * 1e-2)
