"""lm-evaluation-harness through ``generate.harness.HarnessLM`` on the training mesh:
local tasks (YAML over JSONL, offline) scored by lm_eval itself, each example's
log-likelihood checked against the model's own teacher-forced forward pass, computed
here from the logits; and ``EvalHarnessCallback`` logging the scores during a run."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import optax
import pytest
from flax import nnx

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from nnx_spmd_trainer import FSDP, Hybrid, TensorParallel, Trainer  # noqa: E402
from nnx_spmd_trainer.app.models.gpt import GPT  # noqa: E402
from nnx_spmd_trainer.callbacks import CSVLogger, EvalHarnessCallback  # noqa: E402
from nnx_spmd_trainer.generate import Sampler  # noqa: E402
from nnx_spmd_trainer.generate.harness import HarnessLM  # noqa: E402

ALPHABET = "abcdefghij ."
EOS = 31
SEQ = 16


class Letters:
    """One token per character; ``eos_id`` the end-of-text token."""

    eos_id = EOS

    def encode(self, text: str) -> list[int]:
        return [ALPHABET.index(c) for c in text]

    def decode(self, ids: Any) -> str:
        return "".join(ALPHABET[i] if i < len(ALPHABET) else "" for i in ids)


def gpt(rngs: nnx.Rngs) -> nnx.Module:
    return GPT(
        vocab_size=32, seq_len=SEQ, embed_dim=32, num_heads=4, ff_dim=64, num_layers=2,
        dropout_rate=0.0, rngs=rngs,
    )  # fmt: skip


def zero_loss(model: nnx.Module, batch: Any) -> tuple[Any, dict[str, Any]]:
    return 0.0 * model(batch["x"]).mean(), {}


@pytest.fixture(scope="module")
def trainer() -> Trainer:
    return Trainer(
        gpt, optax.sgd(0.1), strategy=Hybrid(FSDP(4, min_size=16), TensorParallel(2)),
        loss_fn=zero_loss, metrics=None,
    )  # fmt: skip


DOCS = [
    {"question": "abc", "choices": [" d", " j"], "label": 0},
    {"question": "ha ha", "choices": [" ha", " hj.", " a"], "label": 2},
    {"question": "", "choices": ["jig", "bag"], "label": 1},
]
TEXTS = [{"text": "a bad cab"}, {"text": "fade a bead. a cafe. a big jade head"}]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tasks")
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (root / "texts.jsonl").write_text("".join(json.dumps(d) + "\n" for d in TEXTS))
    common = "dataset_path: json\ntest_split: test\n"
    (root / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root}/mc.jsonl\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n"
    )
    (root / "tiny_rolling.yaml").write_text(
        f"task: tiny_rolling\n{common}dataset_kwargs:\n  data_files:\n"
        f"    test: {root}/texts.jsonl\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: bits_per_byte\n"
    )
    return root


def forward_log_probs(t: Trainer, inputs: list[int], targets: list[int]) -> np.ndarray:
    """The log-probability of each target from the trainer's forward pass (its logits,
    ``Trainer.predict``), softmaxed here in float64."""
    tokens = np.zeros((8, SEQ), np.int32)
    tokens[0, : len(inputs)] = inputs
    (logits,) = t.predict([{"x": tokens}], to_numpy=True)
    row = np.asarray(logits[0, : len(inputs)], np.float64)
    shifted = row - row.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return log_probs[np.arange(len(targets)), targets]


def expected_choice(t: Trainer, context: str, choice: str) -> float:
    codec = Letters()
    context_ids = codec.encode(context) or [EOS]
    whole = context_ids + codec.encode(choice)
    return float(forward_log_probs(t, whole[:-1], whole[1:])[len(context_ids) - 1 :].sum())


def expected_rolling(t: Trainer, text: str) -> float:
    """lm_eval's rolling windows: the text in windows of SEQ targets, each predicted
    from the SEQ tokens before it at most (end-of-text first), so the last window keeps
    as much context as fits."""
    ids, total = Letters().encode(text), 0.0
    seq = [EOS, *ids]  # target ids[j] is predicted from seq[: j + 1]
    for start in range(0, len(ids), SEQ):
        window = ids[start : start + SEQ]
        end = start + len(window)
        inputs = seq[max(0, end - SEQ) : end]
        targets = [0] * (len(inputs) - len(window)) + window  # context positions unscored
        total += float(forward_log_probs(t, inputs, targets)[-len(window) :].sum())
    return total


def test_local_tasks_score_each_example_as_the_forward_pass(trainer: Trainer, tasks: Path) -> None:
    model = HarnessLM(trainer, Letters(), batch_size=4)
    results = lm_eval.simple_evaluate(
        model=model, tasks=["tiny_mc", "tiny_rolling"],
        task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
    )  # fmt: skip
    for sample in results["samples"]["tiny_mc"]:
        doc = sample["doc"]
        got = [resp[0][0] for resp in sample["resps"]]
        want = [expected_choice(trainer, doc["question"], c) for c in doc["choices"]]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        assert sample["acc"] == float(np.argmax(want) == doc["label"])
    rolling = results["samples"]["tiny_rolling"]
    assert len(Letters().encode(TEXTS[1]["text"])) > 2 * SEQ  # three windows
    for sample in rolling:
        got = sample["resps"][0][0]
        np.testing.assert_allclose(got, expected_rolling(trainer, sample["doc"]["text"]), atol=1e-5)
    assert results["results"]["tiny_rolling"]["bits_per_byte,none"] > 0.0


def test_generate_until_is_the_samplers_greedy_text_cut_at_until(trainer: Trainer) -> None:
    class Request:
        def __init__(self, *args: Any) -> None:
            self.args = args

    model = HarnessLM(trainer, Letters())
    (text,) = model.generate_until([Request("abc", {"max_gen_toks": 8})])
    greedy = Sampler(trainer.model, trainer.plan, tokenizer=Letters(), print_fn=None).generate(
        ["abc"], max_new_tokens=8
    )
    assert greedy.text is not None and text == greedy.text[0]
    assert text  # eight characters of the alphabet (no end token in it)
    stop = text[-1]  # cut at a string that occurs: it and everything after are dropped
    (cut,) = model.generate_until([Request("abc", {"max_gen_toks": 8, "until": [stop]})])
    assert cut == text[: text.index(stop)]


def test_a_request_without_context_needs_a_prefix_token(trainer: Trainer) -> None:
    class NoEos(Letters):
        eos_id = None  # type: ignore[assignment]

    class Request:
        args = ("", "abc")

    with pytest.raises(ValueError, match="prefix_token"):
        HarnessLM(trainer, NoEos()).loglikelihood([Request()])


def test_the_callback_logs_the_scores_to_the_run(tasks: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    harness = EvalHarnessCallback(
        ["tiny_mc"], every_n_steps=2, tokenizer=Letters(), include_path=tasks, print_fn=lines.append
    )
    trainer = Trainer(
        gpt, optax.sgd(0.1), loss_fn=zero_loss, metrics=None,
        callbacks=[harness, CSVLogger(tmp_path / "log.csv")],
    )  # fmt: skip
    tokens = np.random.default_rng(0).integers(0, 12, (8, SEQ)).astype(np.int32)
    trainer.fit([{"x": tokens}] * 3, max_steps=3)
    with open(tmp_path / "log.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("lm_eval/tiny_mc/acc")]
    logged = {int(r["step"]): float(r["lm_eval/tiny_mc/acc"]) for r in rows}
    computed = {step: scores["lm_eval/tiny_mc/acc"] for step, scores in harness.scores}
    assert logged == computed and len(computed) == 2  # step 2, and the end (step 3)
    assert all(v in (0.0, 1 / 3, 2 / 3, 1.0) for v in computed.values())
    assert lines and lines[0].startswith("lm_eval at step")
