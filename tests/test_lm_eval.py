"""lm-evaluation-harness through ``generate.harness.HarnessLM`` on the training mesh:
local tasks (YAML over JSONL, offline) scored by lm_eval itself, each example's
log-likelihood checked against the model's own teacher-forced forward pass, computed
here by the model on one device; and ``EvalHarnessCallback`` logging the scores during a run."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
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


@pytest.fixture(scope="module")
def one_device(trainer: Trainer) -> nnx.Module:
    """The trainer's model, its weights gathered to the host and put on one device: the
    independent forward pass the harness's scores are checked against."""
    graphdef, state = nnx.split(trainer.model)
    return nnx.merge(graphdef, jax.device_put(jax.device_get(state), jax.devices()[0]))


# The forward pass jitted: a program a row length, not every op dispatched (and compiled) alone.
one_program = nnx.jit(lambda model, tokens: model(tokens))


def forward_log_probs(model: nnx.Module, inputs: list[int], targets: list[int]) -> np.ndarray:
    """Each target's log-probability: ``jax.nn.log_softmax`` of the one-device model's
    logits over the unpadded row, gathered at the targets."""
    logits = one_program(model, jnp.asarray([inputs], jnp.int32))[0].astype(jnp.float32)
    log_probs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return log_probs[np.arange(len(targets)), targets]


def expected_choice(model: nnx.Module, context: str, choice: str) -> float:
    codec = Letters()
    context_ids = codec.encode(context) or [EOS]
    whole = context_ids + codec.encode(choice)
    return float(forward_log_probs(model, whole[:-1], whole[1:])[len(context_ids) - 1 :].sum())


def expected_rolling(model: nnx.Module, text: str) -> float:
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
        total += float(forward_log_probs(model, inputs, targets)[-len(window) :].sum())
    return total


def test_local_tasks_score_each_example_as_the_forward_pass(
    trainer: Trainer, one_device: nnx.Module, tasks: Path
) -> None:
    model = HarnessLM(trainer, Letters(), batch_size=4)
    results = lm_eval.simple_evaluate(
        model=model, tasks=["tiny_mc", "tiny_rolling"],
        # Only the local tasks indexed: lm_eval's own thousands of YAML files take seconds.
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True,
    )  # fmt: skip
    for sample in results["samples"]["tiny_mc"]:
        doc = sample["doc"]
        got = [resp[0][0] for resp in sample["resps"]]
        want = [expected_choice(one_device, doc["question"], c) for c in doc["choices"]]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        assert sample["acc"] == float(np.argmax(want) == doc["label"])
    rolling = results["samples"]["tiny_rolling"]
    assert len(Letters().encode(TEXTS[1]["text"])) > 2 * SEQ  # three windows
    for sample in rolling:
        got = sample["resps"][0][0]
        np.testing.assert_allclose(
            got, expected_rolling(one_device, sample["doc"]["text"]), atol=1e-5
        )
    assert results["results"]["tiny_rolling"]["bits_per_byte,none"] > 0.0


class Request:
    """What lm_eval hands a model: an object whose ``args`` are the request's."""

    def __init__(self, *args: Any) -> None:
        self.args = args


def test_generate_until_is_the_samplers_greedy_text_cut_at_until(trainer: Trainer) -> None:
    model = HarnessLM(trainer, Letters())
    prompts = ["abc", "j", "a big"]
    texts = model.generate_until([Request(p, {"max_gen_toks": 8}) for p in prompts])
    sampler = Sampler(trainer.model, trainer.plan, tokenizer=Letters(), print_fn=None)
    for prompt, text in zip(prompts, texts, strict=True):  # batched: as each alone
        greedy = sampler.generate([prompt], max_new_tokens=8, end_token=EOS)
        assert greedy.text is not None and text == greedy.text[0]
    text = texts[0]
    assert text  # characters of the alphabet
    stop = text[-1]  # cut at a string that occurs: it and everything after are dropped
    (cut,) = model.generate_until([Request("abc", {"max_gen_toks": 8, "until": [stop]})])
    assert cut == text[: text.index(stop)]


class Pairs:
    """Merges "ab" into one token (12) where it occurs: a context's end and a
    continuation's start tokenize differently apart than together."""

    eos_id = EOS

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for c in text:
            if out and out[-1] == 0 and c == "b":
                out[-1] = 12
            else:
                out.append(ALPHABET.index(c))
        return out

    def decode(self, ids: Any) -> str:
        return "".join("ab" if i == 12 else ALPHABET[i] for i in ids)


def test_the_continuation_is_tokenized_in_its_context_as_lm_evals_models_do() -> None:
    harness = HarnessLM(None, Pairs())
    # "ca" + "bd": the whole is c, ab, d; the continuation is the whole's tokens past as
    # many as the context has alone (lm_eval's HFLM._encode_pair), not "bd" on its own.
    assert harness._pair("ca", "bd") == ([2, 0], [3])
    assert harness._pair("c", "abd") == ([2], [12, 3])
    assert harness._pair("a b ", "c") == ([0, 10, 1], [10, 2])  # trailing space moves
    assert harness._pair("", "ab") == ([EOS], [12])  # no context: the end-of-text token


def test_the_module_imports_without_lm_eval_and_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    import nnx_spmd_trainer.generate.harness as installed

    for name in [n for n in sys.modules if n == "lm_eval" or n.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now fails
    spec = importlib.util.spec_from_file_location("harness_without_lm_eval", installed.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports: score_tokens needs no lm_eval
    assert callable(module.score_tokens)
    with pytest.raises(ImportError, match=r"nnx-spmd-trainer\[lm-eval\]"):
        module.HarnessLM(None, Letters())


def test_a_request_without_context_needs_a_prefix_token(trainer: Trainer) -> None:
    class NoEos(Letters):
        eos_id = None  # type: ignore[assignment]

    with pytest.raises(ValueError, match="prefix_token"):
        HarnessLM(trainer, NoEos()).loglikelihood([Request("", "abc")])


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


def test_the_callback_without_lm_eval_names_the_extra_when_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # find_spec("lm_eval") now fails
    with pytest.raises(ImportError, match=r"nnx-spmd-trainer\[lm-eval\]"):
        EvalHarnessCallback(["tiny_mc"], every_n_steps=1, tokenizer=Letters())
