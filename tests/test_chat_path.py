"""The chat path through the CLI, each step reading the workdir the one before wrote: the
default job's GPT pretrained, fine-tuned on chat data from it (ChatML's markers one token
each: the default BPE reserves them), then ``generate`` on the fine-tune with plain prompts
(a user turn and the generation prompt, as transformers renders them; ``--raw``; the
template's end of turn ends a row). A real run prints its skipped-conversation count; a
tokenizer that would split the markers is refused; DPO's config is the default job's GPT,
and a run of other sizes is refused naming the keys to set."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_chat_cli import conversation

pytest.importorskip("transformers")

from nnx_spmd_trainer import Sampler  # noqa: E402
from nnx_spmd_trainer.app import generate, job, post_training_job, tasks  # noqa: E402
from nnx_spmd_trainer.data import CHATML_TOKENS, ChatError, ChatTokenizer, train_bpe  # noqa: E402

QUESTION = "what is one and two"
NEW = 30


def tiny(name: str = "default", **keys: Any) -> Any:
    config = importlib.import_module(f"nnx_spmd_trainer.configs.{name}").get_config()
    config.update(batch_size=8, max_eval_batches=1, eval_every_n_steps=0, loggers="csv", **keys)
    config.gpt.update(seq_len=64, embed_dim=32, num_heads=4, ff_dim=64, num_layers=1)
    config.data.vocab_size = 300
    return config


def printed(run: Any, *args: Any, **keys: Any) -> tuple[Any, str]:
    """``run(...)`` and what it printed (``say`` writes to ``sys.stdout``)."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        result = run(*args, **keys)
    return result, out.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 2-step pretraining of the default GPT (small), then 60 steps of chat SFT from its
    workdir on conversations of which 3 have no assistant turn."""
    base = tmp_path_factory.mktemp("chat-path")
    chat = base / "chat.jsonl"
    unanswered = {"messages": [{"role": "user", "content": "no answer here"}]}
    rows = [conversation(i) for i in range(48)] + [unanswered] * 3
    chat.write_text("".join(json.dumps(row) + "\n" for row in rows))
    job.run(tiny(max_steps=2), base / "pretrain")
    sft = tiny(max_steps=60, learning_rate=1e-2, warmup_steps=0, init_from=str(base / "pretrain"))
    sft.data.update(chat=str(chat), chat_template="chatml")
    result, out = printed(job.run, sft, base / "sft")
    _, again = printed(job.run, sft, base / "sft")  # a resume: nothing left to train
    return {"base": base, "sft": base / "sft", "trainer": result.trainer, "out": out,
            "again": again, "config": sft}  # fmt: skip


def _chat_backend(workdir: Path) -> Any:
    """The fine-tune's saved tokenizer and template, read by transformers alone."""
    import transformers

    return transformers.PreTrainedTokenizerFast.from_pretrained(str(workdir))


def _generate(*argv: str) -> tuple[list[dict[str, Any]], str]:
    code, out = printed(generate.main, list(argv))
    assert code == 0
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")], out


def test_a_real_run_prints_the_skipped_conversations(runs) -> None:
    (line,) = [line for line in runs["out"].splitlines() if line.startswith("chat: ")]
    assert " of 51 conversations from " in line
    assert "3 without an assistant token skipped" in line
    assert "compiling the train step first" in runs["out"]  # not 30 s of silence


def test_a_resumed_run_does_not_say_the_optimizer_starts_fresh(runs) -> None:
    assert "init_from: the model of " in runs["out"] and "starts fresh" in runs["out"]
    assert "nothing trained" in runs["again"]  # resumed at its last step
    assert "init_from" not in runs["again"] and "starts fresh" not in runs["again"]


def test_the_markers_are_one_token_each_from_the_pretrained_runs_tokenizer(runs) -> None:
    backend = _chat_backend(runs["sft"])
    pretrained = _chat_backend(runs["base"] / "pretrain")  # the BPE of the default job
    for marker in CHATML_TOKENS:
        (one,) = backend(marker, add_special_tokens=False)["input_ids"]
        assert one == pretrained.convert_tokens_to_ids(marker) < 300


def test_generate_renders_a_plain_prompt_as_a_user_turn_and_stops_at_its_end(runs) -> None:
    (row,), _ = _generate(str(runs["sft"]), "--prompt", QUESTION, "--json",
                          "--max_new_tokens", str(NEW))  # fmt: skip
    backend = _chat_backend(runs["sft"])
    ids = backend.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    end = backend.convert_tokens_to_ids("<|im_end|>")
    trained = runs["trainer"]
    want = Sampler(trained.model, trained.plan, print_fn=None).generate(
        [ids], max_new_tokens=NEW, end_token=end
    )
    assert row["tokens"] == want.tokens[0]
    # 60 steps on the conversations: an answer, then the end of turn, which ends the row
    assert row["finish"] == "end" and row["tokens"][-1] == end
    assert row["text"] == backend.decode(row["tokens"][:-1])
    assert " make " in row["text"]  # the answers' form
    # --raw: the text as it is, no template
    (raw,), _ = _generate(str(runs["sft"]), "--prompt", QUESTION, "--raw", "--json",
                          "--max_new_tokens", "4")  # fmt: skip
    plain = backend(QUESTION, add_special_tokens=False)["input_ids"]
    want = Sampler(trained.model, trained.plan, print_fn=None).generate(
        [plain], max_new_tokens=4, end_token=end
    )
    assert raw["tokens"] == want.tokens[0]


def test_generate_prints_the_prompt_a_separator_and_says_it_compiles(runs, tmp_path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    conversation = [{"role": "user", "content": "what is two and one"}]
    prompts.write_text(json.dumps(QUESTION) + "\n" + json.dumps({"messages": conversation}) + "\n")
    rows, _ = _generate(str(runs["sft"]), "--prompts_file", str(prompts), "--json",
                        "--max_new_tokens", "4")  # fmt: skip
    assert [r["prompt"] for r in rows] == [QUESTION, conversation]
    _, out = _generate(str(runs["sft"]), "--prompt", QUESTION, "--max_new_tokens", "4")
    assert "compiling the prefill and decode steps" in out
    (line,) = [line for line in out.splitlines() if line.startswith(QUESTION)]
    assert line == QUESTION + generate.SEPARATOR + rows[0]["text"]


def test_a_tokenizer_that_would_split_the_markers_is_refused(tmp_path) -> None:
    bpe = train_bpe(texts=["what is one and two"] * 4, vocab_size=300)
    with pytest.raises(ChatError, match=r"'<\|im_start\|>', '<\|im_end\|>', which this"):
        ChatTokenizer.from_tokenizer(bpe)
    grown = ChatTokenizer.from_tokenizer(bpe, add_tokens=True)  # or given them
    assert grown.vocab_size == bpe.vocab_size + 2
    assert grown.end_of_turn_id == bpe.vocab_size + 1
    bpe.save(tmp_path / "plain")
    config = tiny(max_steps=1)
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(4)))
    config.data.update(chat=str(chat), chat_template="chatml", tokenizer=str(tmp_path / "plain"))
    with pytest.raises(tasks.ConfigError, match="no single token for") as refused:
        job.run(config, tmp_path / "run")
    message = str(refused.value)
    assert "<|im_end|>' into" in message and "--config.data.tokenizer=<a tokenizer" in message
    assert not (tmp_path / "run").exists()


def test_dpo_is_the_default_gpt_and_a_run_of_other_sizes_is_refused_naming_keys(
    runs, tmp_path
) -> None:
    dpo, default = (importlib.import_module(f"nnx_spmd_trainer.configs.{n}").get_config()
                    for n in ("dpo", "default"))  # fmt: skip
    for name in ("dpo", "grpo"):
        other = importlib.import_module(f"nnx_spmd_trainer.configs.{name}").get_config()
        assert other.gpt == default.gpt and other.data.vocab_size == default.data.vocab_size
    pairs = tmp_path / "pairs.jsonl"
    pair = {"prompt": "say one:", "chosen": " one", "rejected": " no"}
    pairs.write_text((json.dumps(pair) + "\n") * 8)
    dpo.update(init_from=str(runs["base"] / "pretrain"), max_steps=1, loggers="csv")
    dpo.data.preferences = str(pairs)
    with pytest.raises(tasks.ConfigError) as refused:
        post_training_job.run(dpo, tmp_path / "dpo")
    message = str(refused.value)
    assert "config.gpt.embed_dim=128 (that run's: 32)" in message
    assert "config.data.vocab_size=1024 (that run's: 300)" in message
    assert "--config.gpt.embed_dim=32" in message and "--config.gpt.num_layers=1" in message
    assert not (tmp_path / "dpo").exists()


def test_a_chat_command_prints_no_pytorch_notice() -> None:
    """transformers' import-time advisory (``PyTorch was not found``) is not printed: chat
    templates need no torch."""
    code = "from nnx_spmd_trainer.data import chat; chat._transformers(); print('imported')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-2000:]
    assert "PyTorch" not in proc.stderr + proc.stdout
