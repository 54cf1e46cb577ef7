"""data.chat: conversations rendered with a chat template, the loss on the assistant's tokens.

The templates in tests/fixtures/chat_templates/ have the shapes of Llama-3, Qwen3 (think
tags: an earlier turn's think block dropped once a later user turn follows), Gemma (no
system role, ``model`` for the assistant, alternation enforced) and ChatML, each with and
without ``{% generation %}`` markers, over a tiny word-level tokenizer built here.
"""

from __future__ import annotations

import json
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

pytest.importorskip("transformers")

import tokenizers  # noqa: E402
from tokenizers import models, pre_tokenizers  # noqa: E402

from nnx_spmd_trainer import DataParallel, Trainer  # noqa: E402
from nnx_spmd_trainer.app.models import gpt  # noqa: E402
from nnx_spmd_trainer.app.models.gpt_losses import loss_fn  # noqa: E402
from nnx_spmd_trainer.data.chat import (  # noqa: E402
    CHATML_TOKENS,
    ChatError,
    ChatTokenizer,
    load_chat_tokenizer,
)
from nnx_spmd_trainer.data.conversations import chat_documents, read_conversations  # noqa: E402
from nnx_spmd_trainer.data.packing import LOSS_WEIGHTS, ROW_KEYS, pack_documents  # noqa: E402
from nnx_spmd_trainer.data.tokenizer import EOS_TOKEN, train_bpe  # noqa: E402
from nnx_spmd_trainer.nn.packed import packed_inputs, target_weights  # noqa: E402

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
SPECIAL = [
    *("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_response>", "</tool_response>"),
    *("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    *("<bos>", "<start_of_turn>", "<end_of_turn>"),
]
WORDS = [
    *("<unk>", "\n", "system", "user", "assistant", "model", "be", "brief", "hi", "how"),
    *("are", "you", "hello", "fine", "thanks", "why", "because", "hmm", "ok", "sunny", "weather"),
]
# (bos_token, eos_token) of each family's tokenizer_config.json
FAMILIES = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "qwen3": ("<|im_start|>", "<|im_end|>"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
    "gemma": ("<bos>", "<end_of_turn>"),
}
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi how are you"},
    {"role": "assistant", "content": "<think>\nok\n</think>\n\nhello fine thanks"},
    {"role": "user", "content": "why"},
    {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nbecause"},
]
THINK_OK = ["<think>", "\n", "ok", "\n", "</think>", "\n", "\n"]
THINK_HMM = ["<think>", "\n", "hmm", "\n", "</think>", "\n", "\n"]
# Hand-checked: the runs of tokens the loss trains, in order; the same with and without
# generation markers. Qwen3 drops the first turn's think block once "why" follows (the
# model never sees it in its context there), and writes the last one.
GOLDEN = {
    "chatml": [[*THINK_OK, "hello", "fine", "thanks", "<|im_end|>"],
               [*THINK_HMM, "because", "<|im_end|>"]],
    "qwen3": [["hello", "fine", "thanks", "<|im_end|>"], [*THINK_HMM, "because", "<|im_end|>"]],
    "llama3": [[*THINK_OK, "hello", "fine", "thanks", "<|eot_id|>"],
               [*THINK_HMM, "because", "<|eot_id|>"]],
    "gemma": [[*THINK_OK, "hello", "fine", "thanks", "<end_of_turn>"],
              [*THINK_HMM, "because", "<end_of_turn>"]],
}  # fmt: skip


def word_tokenizer() -> tokenizers.Tokenizer:
    """Words split at spaces (dropped) and newlines (kept), the templates' tokens special."""
    backend = tokenizers.Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(" +"), "removed"),
            pre_tokenizers.Split("\n", "isolated"),
        ]
    )
    backend.add_special_tokens(SPECIAL)
    return backend


def write_tokenizer(folder: Path, template: str | None, family: str = "chatml") -> Path:
    """``folder/tokenizer.json`` and a ``tokenizer_config.json`` holding ``template``."""
    folder.mkdir(parents=True, exist_ok=True)
    word_tokenizer().save(str(folder / "tokenizer.json"))
    bos, eos = FAMILIES[family]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def chat_tokenizers(tmp_path_factory) -> dict[str, ChatTokenizer]:
    root = tmp_path_factory.mktemp("chat_tokenizers")
    loaded = {}
    for path in sorted(TEMPLATES.glob("*.jinja")):
        family = path.stem.split("_")[0]
        folder = write_tokenizer(root / path.stem, path.read_text(), family)
        loaded[path.stem] = load_chat_tokenizer(folder)
    return loaded


def runs(tokenizer: ChatTokenizer, ids: np.ndarray, mask: np.ndarray) -> list[list[str]]:
    """The masked tokens as runs of consecutive positions."""
    tokens = tokenizer.backend.convert_ids_to_tokens(ids.tolist())
    found: list[list[str]] = []
    for place, (token, masked) in enumerate(zip(tokens, mask, strict=True)):
        if masked:
            if place == 0 or not mask[place - 1]:
                found.append([])
            found[-1].append(token)
    return found


@pytest.mark.parametrize("markers", [False, True], ids=["prefixes", "generation_markers"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_mask_is_the_assistants_content_and_end_tokens(chat_tokenizers, family, markers):
    tokenizer = chat_tokenizers[family + ("_generation" if markers else "")]
    assert tokenizer.markers is markers
    document = tokenizer.encode(CONVERSATION)
    tokens = tokenizer.backend.convert_ids_to_tokens(document.ids.tolist())
    assert "<unk>" not in tokens
    assert runs(tokenizer, document.ids, document.assistant) == GOLDEN[family]
    # a turn ends just after its end token (where a long conversation is cut)
    assert [tokens[end - 1] for end in document.turn_ends] == [run[-1] for run in GOLDEN[family]]
    if family == "qwen3":  # the case the plain prefix difference gets wrong: history rewritten
        first_turn = tokenizer.render(CONVERSATION[:3])
        assert not tokenizer.render(CONVERSATION).startswith(first_turn)


def test_a_template_with_markers_gives_transformers_own_mask(chat_tokenizers):
    tokenizer = chat_tokenizers["qwen3_generation"]
    own = tokenizer.backend.apply_chat_template(
        CONVERSATION, return_dict=True, return_assistant_tokens_mask=True
    )
    document = tokenizer.encode(CONVERSATION)
    assert document.ids.tolist() == own["input_ids"]
    assert document.assistant.astype(int).tolist() == own["assistant_masks"]


def test_the_tool_role_where_the_template_has_it(chat_tokenizers, tmp_path):
    conversation = [
        {"role": "user", "content": "weather"},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "sunny"},
    ]
    qwen3 = chat_tokenizers["qwen3"]
    document = qwen3.encode(conversation)
    assert runs(qwen3, document.ids, document.assistant) == [
        ["ok", "<|im_end|>"],
        [*THINK_HMM[:2], "\n", "</think>", "\n", "\n", "sunny", "<|im_end|>"],
    ]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": conversation}) + "\n")
    rows = read_conversations(tmp_path / "c.jsonl")
    with pytest.raises(
        ChatError, match=r"c.jsonl:1: unknown role 'tool'; .* system, user, assistant"
    ):
        chat_documents(rows, chat_tokenizers["chatml"], seq_len=64)


def test_the_default_template_for_the_librarys_own_bpe():
    bpe = train_bpe(
        texts=["hi there", "hello you"], vocab_size=300, special_tokens=(EOS_TOKEN, *CHATML_TOKENS)
    )
    tokenizer = ChatTokenizer.from_tokenizer(bpe)  # CHATML_TEMPLATE, generation markers
    conversation = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello you"},
    ]
    document = tokenizer.encode(conversation)
    assert tokenizer.decode(document.ids) == tokenizer.render(conversation)
    assert tokenizer.decode(document.ids[document.assistant]) == "hello you<|im_end|>"


def write_jsonl(path: Path, conversations: list) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def turn(user: str, assistant: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def test_long_conversations_are_cut_at_a_turn_or_dropped_and_counted(chat_tokenizers, tmp_path):
    tokenizer = chat_tokenizers["chatml"]
    long = turn("hi", "hello") + turn("why", "because because because because")
    conversations = [
        ("a:1", turn("hi", "hello")),  # 12 tokens, the last a newline
        ("a:2", long),  # 25 tokens; its first turn (11) fits 16 pairs
        ("a:3", [{"role": "user", "content": "hi how are you"}]),  # no assistant token
        ("a:4", turn("hi how are you fine fine fine fine fine", "hello")),  # no turn fits
    ]
    documents, counts = chat_documents(conversations, tokenizer, seq_len=16)
    assert [len(d["ids"]) for d in documents] == [12, 11]  # cut after <|im_end|>
    assert runs(tokenizer, documents[1]["ids"], documents[1]["loss_weights"] > 0) == [
        ["hello", "<|im_end|>"]
    ]
    assert (counts.conversations, counts.kept, counts.cut, counts.too_long) == (4, 2, 1, 1)
    assert counts.no_assistant == 1 and counts.trained == 4
    line = counts.line("a.jsonl", 16)
    assert "2 of 4 conversations from a.jsonl (1 cut at a turn to fit 16 tokens, 1 too" in line
    assert "1 without an assistant token skipped" in line
    _, dropping = chat_documents(conversations, tokenizer, seq_len=16, too_long="drop")
    assert (dropping.kept, dropping.cut, dropping.too_long) == (1, 0, 2)


def test_packed_rows_carry_the_loss_weights(chat_tokenizers):
    tokenizer = chat_tokenizers["chatml"]
    words = ["hi", "how", "are", "you", "fine", "thanks"]
    conversations = [
        (f"x:{i}", turn(" ".join(words[: 1 + i % 4]), " ".join(words[i % 3 :]))) for i in range(9)
    ]
    documents, _ = chat_documents(conversations, tokenizer, seq_len=24)
    rows = list(pack_documents(grain.MapDataset.source(documents), 24, weighted=True))
    assert all(set(row) == {*ROW_KEYS, LOSS_WEIGHTS} for row in rows)
    assert all(row[LOSS_WEIGHTS].dtype == np.float32 for row in rows)
    found = sorted(
        (
            tuple(row["targets"][row["segment_ids"] == s]),
            tuple(row[LOSS_WEIGHTS][row["segment_ids"] == s]),
        )
        for row in rows
        for s in range(1, row["segment_ids"].max() + 1)
    )
    assert found == sorted((tuple(d["ids"][1:]), tuple(d["loss_weights"][1:])) for d in documents)
    assert all((row[LOSS_WEIGHTS][row["segment_ids"] == 0] == 0).all() for row in rows)
    plain = list(pack_documents(grain.MapDataset.source([d["ids"] for d in documents]), 24))
    assert all(set(row) == set(ROW_KEYS) for row in plain)  # unweighted rows as before


def weighted_mean_loss(model, batch):
    """Cross entropy averaged over the batch's trained targets, each by its weight: the
    loss the CHAT/TOKEN-MEAN contract asks of ``loss_weights``."""
    logits = model(batch["inputs"], **packed_inputs(batch))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    weights = target_weights(batch).astype(jnp.float32) * batch[LOSS_WEIGHTS]
    return jnp.sum(losses * weights) / jnp.sum(weights)


SEQ = 40


@pytest.fixture(scope="module")
def chat_batches(chat_tokenizers):
    """A tiny GPT split as ``(graph, params, rest)``, and the same 8 conversations as one
    batch packed (several a row, padded to 4 rows with empty ones) and one unpacked (one a
    row): their trained tokens differ from row to row and microbatch to microbatch."""
    tokenizer = chat_tokenizers["llama3"]
    words = ["hi", "how", "are", "you", "fine", "thanks", "because"]
    conversations = [
        (f"x:{i}", turn(" ".join(words[i % 5 : 1 + i % 5 + i % 2]), " ".join(words[: 1 + i % 3])))
        for i in range(8)
    ]  # 14 to 17 tokens each
    documents, counts = chat_documents(conversations, tokenizer, seq_len=SEQ)
    assert counts.kept == 8
    source = grain.MapDataset.source(documents)

    def batch(packed: bool):
        rows = list(pack_documents(source, SEQ, packed=packed, weighted=True, num_packing_bins=4))
        rows += [{k: np.zeros_like(v) for k, v in rows[0].items()}] * (-len(rows) % 4)
        return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}

    packed, unpacked = batch(True), batch(False)
    assert len(unpacked["inputs"]) == len(documents) > len(packed["inputs"]) == 4
    with nnx.use_eager_sharding(False):  # one device: the model's layout annotations unused
        model = gpt.GPT(len(tokenizer.backend) + 5, SEQ, 32, 4, 64, 1, 0.0, nnx.Rngs(0))
    return nnx.split(model, nnx.Param, ...), packed, unpacked


def test_packed_and_unpacked_conversations_give_the_same_loss_and_gradients(chat_batches):
    (graph, params, rest), packed, unpacked = chat_batches

    def loss(p, b):
        return weighted_mean_loss(nnx.merge(graph, p, rest), b)

    loss_and_grads = jax.jit(jax.value_and_grad(loss))
    loss_p, grads_p = loss_and_grads(params, packed)
    loss_u, grads_u = loss_and_grads(params, unpacked)
    assert float(loss_p) == pytest.approx(float(loss_u), abs=1e-6)
    for a, b in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_u), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("accum", [1, 2, 4])
def test_the_gpt_loss_over_chat_rows_is_the_batch_token_mean_for_any_split(chat_batches, accum):
    """One SGD step of the Trainer with the shipped GPT loss: it honours ``loss_weights``
    and gradient accumulation divides by the whole batch's trained weight, so packed or
    not, split 1, 2 or 4 ways, the step is that of one mean over all the batch's
    assistant tokens (the test's own loss, plain JAX; 1e-6)."""
    (graph, params, rest), packed, unpacked = chat_batches

    def own(p, b):
        return weighted_mean_loss(nnx.merge(graph, p, rest), b)

    want_loss, want_grads = jax.jit(jax.value_and_grad(own))(params, unpacked)
    if accum == 4:  # a mean of the microbatches' means would differ: the split matters
        rows = [{k: v[i : i + 1] for k, v in packed.items()} for i in range(4)]
        naive = np.mean([float(own(params, r)) for r in rows if r[LOSS_WEIGHTS].sum()])
        assert abs(naive - float(want_loss)) > 1e-3
    want = jax.tree.map(lambda p, g: p - g, params, want_grads)  # SGD, learning rate 1

    for batch in (packed, unpacked):
        trainer = Trainer(
            nnx.merge(graph, *jax.tree.map(jnp.copy, (params, rest))),  # the step donates
            optax.sgd(1.0),
            loss_fn=loss_fn,
            grad_accum_steps=accum,
            strategy=DataParallel(),
            devices=jax.devices()[:1],
        )
        trainer.fit([jax.tree.map(np.asarray, batch)], max_steps=1)
        assert trainer.history.history["train/loss"][-1] == pytest.approx(
            float(want_loss), abs=1e-6
        )
        got = nnx.state(trainer.model, nnx.Param)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            # Gradients reach ~3: 3e-6 is 1e-6 of the largest, float32 summation order under
            # accumulation (the chunk-free target gather reads 1.4e-6 at most).
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=3e-6)


# -- bad input: one line each, naming the row and the fix ------------------------------------
def test_a_row_without_messages_names_its_file_and_line(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": turn("hi", "hello")}) + "\n\n" + '{"text": "hi"}\n')
    with pytest.raises(ChatError, match=rf"{path}:3 has no 'messages' list \(it has \['text'\]\)"):
        read_conversations(path)
    path.write_text('{"messages": [{"role": "user"}]}\n')
    with pytest.raises(ChatError, match=r"chat.jsonl:1: the message .* needs a string 'role' and"):
        read_conversations(path)


def test_an_unknown_role_names_its_row(chat_tokenizers):
    bad = [("f.jsonl:7", [{"role": "narrator", "content": "hi"}, *turn("hi", "hello")])]
    with pytest.raises(ChatError, match=r"^f.jsonl:7: unknown role 'narrator'; this template"):
        chat_documents(bad, chat_tokenizers["llama3"], seq_len=64)


def test_a_tokenizer_without_a_template_needs_the_default_chosen(tmp_path):
    folder = write_tokenizer(tmp_path / "plain", None)
    with pytest.raises(ChatError, match=r"has no chat template; .*\(template='chatml'"):
        load_chat_tokenizer(folder)
    chosen = load_chat_tokenizer(folder, template="chatml")
    document = chosen.encode(turn("hi", "hello"))
    assert runs(chosen, document.ids, document.assistant) == [["hello", "<|im_end|>"]]
    with pytest.raises(ChatError, match="neither 'chatml'"):
        load_chat_tokenizer(folder, template="chatm1")


def test_a_template_that_raises_names_the_row(chat_tokenizers):
    not_alternating = [("g.jsonl:2", [*turn("hi", "hello"), *turn("why", "because")[1:]])]
    with pytest.raises(ChatError, match=r"^g.jsonl:2: the chat template fails \(Conversation"):
        chat_documents(not_alternating, chat_tokenizers["gemma"], seq_len=64)
