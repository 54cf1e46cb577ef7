"""The story of issue 53 on the command line alone, each step a process of
``nnx-spmd-train`` reading the workdir the one before wrote (one tree of workdirs): the
default job's GPT (tiny) pretrained; ``generate`` on it (greedy, as a one-device argmax
loop written here; seeded sampling twice: the same); a LoRA chat SFT from it under
FSDP(4) x TP(2) with its merged export; ``generate`` on it with a plain prompt; DPO from
the LoRA run and from the merged export (each first loss log 2); ``generate`` and
``evaluate`` on the DPO run; GRPO from it with a stop string (completions end early);
``lm_eval`` on a local task from the DPO workdir (the score of the step read by Orbax and
scored here on one device, not the untrained model's); and a SIGTERM mid-DPO, then the
same command resumes and ends bitwise where the uninterrupted run did."""

from __future__ import annotations

import csv
import json
import math
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import environment_for_own_devices
from flax import nnx

from nnx_spmd_trainer import path_str

pytest.importorskip("transformers")  # chat templates
pytestmark = [pytest.mark.serial, pytest.mark.slow]

CLI = [sys.executable, "-m", "nnx_spmd_trainer"]
#: The default job's GPT (and the dpo and grpo configs', the same model) at small sizes.
SMALL = [
    "--config.gpt.seq_len=32", "--config.gpt.embed_dim=32", "--config.gpt.num_heads=4",
    "--config.gpt.ff_dim=64", "--config.gpt.num_layers=1", "--config.data.vocab_size=300",
    "--config.loggers=csv", "--config.log_every_n_steps=1",
]  # fmt: skip
RANK, ALPHA = 8, 8.0  # finetuning.md's rank
QUESTION = "1 and 2"
WORDS = ["red", "blue", "green", "gold", "pink", "gray", "teal", "navy"]
REWARD = '''
def longer(prompts, completions, word):
    """A completion's characters: more for a longer one, whatever was sampled."""
    return [float(len(c)) for c in completions]
'''
TEXTS = [{"text": "say red: red"}, {"text": "what is one and two"}, {"text": "say teal: no"}]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def conversation(i: int) -> dict[str, Any]:
    """A sum, short enough for a row of 32 tokens with ChatML's markers."""
    a, b = i % 6 + 1, i // 6 % 6 + 1
    return {"messages": [{"role": "user", "content": f"{a} and {b}"},
                         {"role": "assistant", "content": f"{a + b}"}]}  # fmt: skip


# -- running the CLI ---------------------------------------------------------------------------
class Tree:
    """The story's folder: its input files, and each step's workdir beside them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        write_jsonl(root / "chat.jsonl", [conversation(i) for i in range(36)])
        pairs = [{"prompt": f"say {w}:", "chosen": f" {w}", "rejected": " no"} for w in WORDS * 2]
        write_jsonl(root / "pairs.jsonl", pairs)
        write_jsonl(root / "prompts.jsonl", [{"prompt": f"say {w}:", "word": w} for w in WORDS])
        (root / "story_rewards.py").write_text(REWARD)
        tasks = root / "tasks"
        tasks.mkdir()
        write_jsonl(tasks / "texts.jsonl", TEXTS)
        (tasks / "story_rolling.yaml").write_text(
            f"task: story_rolling\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n"
            f"  data_files:\n    test: {tasks}/texts.jsonl\n"
            "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
            "metric_list:\n  - metric: bits_per_byte\n"
        )

    def __truediv__(self, name: str) -> Path:
        return self.root / name

    def env(self) -> dict[str, str]:
        return {**environment_for_own_devices(), "PYTHONPATH": str(self.root),
                "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip

    def cli(self, *args: str) -> str:
        """``nnx-spmd-train ARGS`` to its end: exit 0, its stdout."""
        proc = subprocess.run([*CLI, *args], env=self.env(), capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert proc.returncode == 0, f"{args}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout

    def generate(self, workdir: Path, *args: str) -> list[dict[str, Any]]:
        out = self.cli("generate", str(workdir), "--json", *args)
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    def doc(self, workdir: str) -> list[str]:
        """finetuning.md's command that writes ``workdir``, as written, its relative paths
        (workdirs and input files) made this tree's."""
        (command,) = [c for c in doc_commands() if f"--workdir={workdir}" in c]
        files = ("--workdir=", "--config.init_from=", "--config.data.chat=",
                 "--config.data.preferences=")  # fmt: skip
        here = [
            flag.split("=", 1)[0] + f"={self / flag.split('=', 1)[1]}"
            if flag.startswith(files) else flag
            for flag in command[1:]
        ]  # fmt: skip
        assert command[0] == "nnx-spmd-train"
        return here

    def dpo_command(self, workdir: Path, init_from: Path, steps: int) -> list[str]:
        """finetuning.md's DPO command with another workdir and start, at small sizes."""
        moved = {"--workdir": workdir, "--config.init_from": init_from}
        doc = [f"{f.split('=')[0]}={moved[f.split('=')[0]]}" if f.split("=")[0] in moved else f
               for f in self.doc("dpo")]  # fmt: skip
        return [*doc, *SMALL, f"--config.max_steps={steps}",
                f"--config.checkpoint_every_n_steps={steps}"]  # fmt: skip


def doc_commands() -> list[list[str]]:
    """docs/topics/finetuning.md's commands on the default job's GPT (not its gpt2_hf ones)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "topics" / "finetuning.md").read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", page, flags=re.S):
        lines = block.replace("\\\n", " ").splitlines()
        found += [shlex.split(line, comments=True) for line in lines
                  if line.startswith("nnx-spmd-train") and "gpt2_hf" not in line]  # fmt: skip
    return found


def logged(workdir: Path, key: str) -> list[tuple[int, str]]:
    """Every row of ``key`` in metrics.csv, in file order, as written."""
    with (workdir / "metrics.csv").open(newline="") as f:
        return [(int(r["step"]), r[key]) for r in csv.DictReader(f) if r.get(key)]


def steps(workdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def saved_params(workdir: Path, step: int | None = None) -> dict[str, np.ndarray]:
    """A step's model parameters as Orbax alone reads them (no trainer, no app code)."""
    step = steps(workdir)[-1] if step is None else step
    state = ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "state")
    leaves = jax.tree_util.tree_flatten_with_path(state["model"])[0]
    return {path_str(p): np.asarray(x) for p, x in leaves if "/rngs/" not in f"/{path_str(p)}"}


# -- the independent one-device model -----------------------------------------------------------
def one_device_gpt(params: dict[str, np.ndarray] | None) -> nnx.Module:
    """The GPT of the story's sizes on one device: ``params`` (a step's, read by Orbax)
    put in by name, or its initialization (None)."""
    from nnx_spmd_trainer.app.models.gpt import GPT

    with nnx.use_eager_sharding(False):
        model = GPT(vocab_size=304, seq_len=32, embed_dim=32, num_heads=4, ff_dim=64,
                    num_layers=1, dropout_rate=0.0, rngs=nnx.Rngs(0))  # fmt: skip
    model.eval()
    if params is not None:
        state = nnx.state(model, nnx.Param)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        assert sorted(path_str(p) for p, _ in leaves) == sorted(params)
        values = [jnp.asarray(params[path_str(p)]) for p, _ in leaves]
        nnx.update(model, jax.tree.unflatten(treedef, values))
    return model


def log_probs_of(model: nnx.Module, ids: list[int]) -> np.ndarray:
    logits = model(jnp.asarray([ids], jnp.int32))[0].astype(jnp.float32)
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def greedy_by_hand(model: nnx.Module, ids: list[int], new: int) -> list[int]:
    out: list[int] = []
    for _ in range(new):
        out.append(int(np.argmax(log_probs_of(model, [*ids, *out])[-1])))
    return out


def tokenizer_of(workdir: Path) -> Any:
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(workdir / "tokenizer.json"))


def bits_per_byte_by_hand(model: nnx.Module, tokenizer: Any) -> float:
    """lm_eval's bits per byte of TEXTS: each text from the end-of-text token on (one
    window), its log-probability summed, over the texts' UTF-8 bytes, in bits."""
    eos = tokenizer.token_to_id("<|endoftext|>")
    total, size = 0.0, 0
    for doc in TEXTS:
        ids = [eos, *tokenizer.encode(doc["text"], add_special_tokens=False).ids]
        total += float(log_probs_of(model, ids[:-1])[np.arange(len(ids) - 1), ids[1:]].sum())
        size += len(doc["text"].encode("utf-8"))
    return -total / size / math.log(2)


# -- the story's runs (module scope: each read by the steps after it) ---------------------------
@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Tree:
    return Tree(tmp_path_factory.mktemp("story"))


@pytest.fixture(scope="module")
def pretrain(tree: Tree) -> Path:
    """1. The default job (its config, the pydoc topics and its BPE), 4 steps."""
    out = tree.cli(*tree.doc("pretrain"), *SMALL, "--config.max_steps=4",
                   "--config.batch_size=8", "--config.eval_every_n_steps=0",
                   "--config.max_eval_batches=1")  # fmt: skip
    assert "mesh {'fsdp': 4, 'model': 2}" in out and "final after 4 steps" in out
    assert steps(tree / "pretrain")[-1] == 4
    return tree / "pretrain"


@pytest.fixture(scope="module")
def sft(tree: Tree, pretrain: Path) -> tuple[Path, str]:
    """3 + 5. LoRA chat SFT from the pretrained workdir under FSDP(4) x TP(2), exported
    merged as it ends."""
    out = tree.cli(
        *tree.doc("sft"), *SMALL, "--config.strategy=fsdp=4,model=2",
        f"--config.lora.alpha={ALPHA}", "--config.max_steps=6", "--config.batch_size=8",
        "--config.learning_rate=0.05", "--config.warmup_steps=0",
        "--config.eval_every_n_steps=0", "--config.max_eval_batches=1",
        f"--export={tree / 'merged'}", "--export_format=merged",
    )  # fmt: skip
    return tree / "sft", out


@pytest.fixture(scope="module")
def dpo(tree: Tree, sft: tuple[Path, str]) -> Path:
    """6. DPO from the LoRA run (its adapters merged first, the default), 6 steps."""
    tree.cli(*tree.dpo_command(tree / "dpo", sft[0], 6))
    return tree / "dpo"


# -- the steps ---------------------------------------------------------------------------------
def test_1_2_pretrain_then_generate_greedy_and_seeded(tree: Tree, pretrain: Path) -> None:
    (greedy,) = tree.generate(pretrain, "--prompt", "The ", "--max_new_tokens", "6")
    tokenizer = tokenizer_of(pretrain)
    prompt = tokenizer.encode("The ", add_special_tokens=False).ids
    want = greedy_by_hand(one_device_gpt(saved_params(pretrain)), prompt, 6)
    assert greedy["tokens"][: len(want)] == want[: len(greedy["tokens"])]
    assert len(greedy["tokens"]) == 6 or greedy["finish"] == "end"
    sampled = [
        tree.generate(pretrain, "--prompt", "The ", "--max_new_tokens", "6",
                      "--temperature", "1.0", "--seed", "7")[0]
        for _ in range(2)
    ]  # fmt: skip
    assert sampled[0]["tokens"] == sampled[1]["tokens"] and sampled[0]["tokens"]
    assert sampled[0]["text"] == sampled[1]["text"]


def test_3_5_lora_chat_sft_under_fsdp_tp_and_its_merged_export(
    tree: Tree, sft: tuple[Path, str], pretrain: Path
) -> None:
    import safetensors.numpy

    workdir, out = sft
    assert "mesh {'fsdp': 4, 'model': 2}" in out and "init_from: the model of" in out
    assert "final after 6 steps" in out
    saved = saved_params(workdir)
    assert any(k.endswith("lora_b") and np.abs(v).max() > 0 for k, v in saved.items())
    merged = safetensors.numpy.load_file(str(tree / "merged" / "model.safetensors"))
    assert not any("lora" in k for k in merged)
    folded = 0
    for name, value in merged.items():
        layer = name.removesuffix("/kernel")
        if name.endswith("/kernel") and f"{layer}/lora_a" in saved:
            a, b = saved[f"{layer}/lora_a"], saved[f"{layer}/lora_b"]
            delta = np.tensordot(a.astype(np.float64), b.astype(np.float64), axes=1)
            want = saved[name] + ALPHA / RANK * delta.reshape(value.shape)
            np.testing.assert_allclose(value, want, rtol=2e-5, atol=2e-6, err_msg=name)
            folded += 1
        else:
            np.testing.assert_array_equal(value, saved[name], err_msg=name)
    assert folded > 0


def test_4_generate_on_the_chat_run_with_a_plain_prompt(tree: Tree, sft: tuple[Path, str]) -> None:
    workdir = sft[0]
    (row,) = tree.generate(workdir, "--prompt", QUESTION, "--max_new_tokens", "8")
    end = tokenizer_of(workdir).token_to_id("<|im_end|>")
    # The end of turn ends a row, else the limit does.
    assert (row["finish"] == "end" and row["tokens"][-1] == end and len(row["tokens"]) <= 8) or (
        len(row["tokens"]) == 8 and end not in row["tokens"]
    ), row
    out = tree.cli("generate", str(workdir), "--prompt", QUESTION, "--max_new_tokens", "8")
    assert f"{QUESTION} >>> {row['text']}\n" in out  # the text may hold newlines itself


def test_6_dpo_from_the_lora_run_and_from_the_merged_export(
    tree: Tree, dpo: Path, sft: tuple[Path, str]
) -> None:
    # The reference is the start: h = 0 at the first step, the loss log 2.
    ((step, loss), *_) = logged(dpo, "train/loss")
    assert step == 1 and abs(float(loss) - math.log(2.0)) < 1e-5
    tree.cli(*tree.dpo_command(tree / "dpo-merged", tree / "merged", 1))
    ((step, loss),) = logged(tree / "dpo-merged", "train/loss")
    assert step == 1 and abs(float(loss) - math.log(2.0)) < 1e-5


def test_6_the_pages_other_starts_a_plain_run_and_dpo_keeping_the_adapters(
    tree: Tree, pretrain: Path, sft: tuple[Path, str]
) -> None:
    """finetuning.md's two other commands: a plain run from the pretrained one, and DPO
    that keeps training the SFT's adapters over its frozen base."""
    one_step = ["--config.max_steps=1", "--config.checkpoint_every_n_steps=1"]
    out = tree.cli(*tree.doc("more"), *SMALL, *one_step, "--config.batch_size=8",
                   "--config.eval_every_n_steps=0", "--config.max_eval_batches=1")  # fmt: skip
    assert "init_from: the model of" in out and steps(tree / "more") == [1]

    tree.cli(*tree.doc("dpo_keep"), *SMALL, *one_step)
    kept, started = saved_params(tree / "dpo_keep"), saved_params(sft[0])
    assert kept.keys() == started.keys()  # the same adapters, no new ones
    adapters = [k for k in kept if "lora_" in k]
    assert adapters and any(not np.array_equal(kept[k], started[k]) for k in adapters)
    for name in kept.keys() - set(adapters):  # the base stays frozen
        np.testing.assert_array_equal(kept[name], started[name], err_msg=name)


def test_7_generate_and_evaluate_on_the_dpo_run(tree: Tree, dpo: Path) -> None:
    (row,) = tree.generate(dpo, "--prompt", "say red:", "--max_new_tokens", "4")
    assert 1 <= len(row["tokens"]) <= 4
    out = tree.cli("evaluate", str(dpo))
    (line,) = [line for line in out.splitlines() if line.startswith("evaluated step ")]
    assert line.startswith(f"evaluated step 6 of {dpo}: "), out[-2000:]
    metrics = dict(item.split("=") for item in line.split(": ", 1)[1].split())
    assert 0 < float(metrics["eval/loss"]) < 10  # a DPO loss: log 2 at the start


def test_8_grpo_with_a_stop_string_ends_completions_early(tree: Tree, dpo: Path) -> None:
    tree.cli(
        "--config=grpo", f"--workdir={tree / 'grpo'}", *SMALL, f"--config.init_from={dpo}",
        f"--config.data.prompts={tree / 'prompts.jsonl'}",
        "--config.grpo.reward=story_rewards:longer", "--config.grpo.stop=('e',)",
        "--config.grpo.max_new_tokens=8", "--config.max_steps=2",
        "--config.checkpoint_every_n_steps=2", "--config.log_every_n_steps=2",
    )  # fmt: skip
    lengths = [float(v) for _, v in logged(tree / "grpo", "train/completion_length")]
    assert lengths and all(0 < length < 8 for length in lengths), lengths


def test_9_lm_eval_on_the_dpo_workdir_is_its_checkpoints_score(tree: Tree, dpo: Path) -> None:
    pytest.importorskip("lm_eval")
    out = tree.cli("lm_eval", str(dpo), "--tasks", "story_rolling",
                   "--include_path", str(tree / "tasks"), "--json")  # fmt: skip
    score = json.loads(out.strip().splitlines()[-1])["story_rolling"]["bits_per_byte,none"]
    tokenizer = tokenizer_of(dpo)
    by_hand = bits_per_byte_by_hand(one_device_gpt(saved_params(dpo)), tokenizer)
    untrained = bits_per_byte_by_hand(one_device_gpt(None), tokenizer)
    assert score == pytest.approx(by_hand, rel=1e-5)
    assert abs(score - untrained) > 1e-3


def test_10_sigterm_mid_dpo_then_the_same_command_resumes_bitwise(
    tree: Tree, dpo: Path, sft: tuple[Path, str]
) -> None:
    workdir = tree / "dpo-stopped"
    command = [*CLI, *tree.dpo_command(workdir, sft[0], 6)]
    unbuffered = {**tree.env(), "PYTHONUNBUFFERED": "1"}  # each line read as it is printed
    proc = subprocess.Popen(command, env=unbuffered, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: list[str] = []
    first_step = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 1:"):
                proc.send_signal(signal.SIGTERM)  # mid-run: after its first step
                first_step.set()

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 600
    while not first_step.is_set() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.wait(timeout=600)
    reader.join(timeout=60)
    output = "".join(lines)
    assert first_step.is_set() and proc.returncode == 0, output[-3000:]
    stopped = int(output.split("stopped by SIGTERM after step ")[1].split(",")[0])
    assert 1 <= stopped < 6 and steps(workdir) == [stopped]
    again = tree.cli(*command[len(CLI) :])
    assert f"resuming from checkpoint step {stopped}" in again and "final after 6 steps" in again
    assert logged(workdir, "train/loss") == logged(dpo, "train/loss")
    ours, theirs = saved_params(workdir, 6), saved_params(dpo, 6)
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
