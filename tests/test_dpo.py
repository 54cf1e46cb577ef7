"""DPOTrainer: the loss, TRL's metrics and the gradients against a one-device loop written
from the paper's formulas (DataParallel, FSDP x TP, and LoRA under FSDP x TP with the base
as the reference, held once), the reference model laid out as the policy, learning a toy
preference, an exact resume, bad preference rows, chat rows rendered with a template."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnx_spmd_trainer import FSDP, Auto, Callback, DataParallel, Hybrid, TensorParallel
from nnx_spmd_trainer.app.models import gpt
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint
from nnx_spmd_trainer.nn.lora import LoRA
from nnx_spmd_trainer.post_training import (
    DPOTrainer,
    PreferenceError,
    ReferenceModel,
    encode_chat_pair,
    encode_text_pair,
    is_chat_row,
    pair_batch,
    read_preferences,
)

VOCAB, SEQ, ROWS, LR, BETA = 16, 8, 8, 0.5, 0.1
LETTERS = "abcdefghijklmnop"  # one token a letter: the test's tokenizer
FSDP_TP = Hybrid(FSDP(4, min_size=64), TensorParallel(2))
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def encode(text: str) -> np.ndarray:
    return np.asarray([LETTERS.index(c) for c in text], np.int32)


def make_model(rngs: nnx.Rngs) -> gpt.GPT:
    return gpt.GPT(VOCAB, SEQ, 32, 2, 64, 1, 0.0, rngs)


def toy_rows(count: int, seed: int) -> list[dict[str, str]]:
    """Prefer the completion that repeats the prompt's last letter three times."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        prompt = "".join(rng.choice(list(LETTERS), 4))
        other = rng.choice([c for c in LETTERS if c != prompt[-1]])
        rows.append({"prompt": prompt, "chosen": prompt[-1] * 3, "rejected": other * 3})
    return rows


def toy_batches(steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rows = toy_rows(ROWS * steps, seed)
    pairs = [encode_text_pair(row, encode) for row in rows]
    return [pair_batch(pairs[i * ROWS : (i + 1) * ROWS], SEQ) for i in range(steps)]


class Params(Callback):
    """The parameters after each step, on the host."""

    def __init__(self) -> None:
        self.after: list[dict] = []

    def on_train_batch_end(self, step, logs):
        self.after.append(
            jax.device_get(nnx.to_pure_dict(nnx.state(self.trainer.model, nnx.Param)))
        )


# -- the one-device loop, from the papers' formulas -----------------------------------------
def plain_loss(params, reference, rest, graphdef, batch, loss_type, smoothing, beta):
    def logp(state, side, mean):
        logits = nnx.merge(graphdef, state, rest)(jnp.asarray(batch[f"{side}_inputs"]))
        lp = jax.nn.log_softmax(logits, axis=-1)
        targets = jnp.asarray(batch[f"{side}_targets"])
        weights = jnp.asarray(batch[f"{side}_weights"])
        total = jnp.sum(jnp.take_along_axis(lp, targets[..., None], -1)[..., 0] * weights, -1)
        return total / jnp.sum(weights, -1) if mean else total

    mean = loss_type == "ipo"  # Azar et al. as TRL computes it: per-token means
    pc, pr = logp(params, "chosen", mean), logp(params, "rejected", mean)
    rc, rr = logp(reference, "chosen", mean), logp(reference, "rejected", mean)
    h = (pc - rc) - (pr - rr)
    if loss_type == "ipo":
        loss = jnp.mean((h - 1 / (2 * beta)) ** 2)
    else:  # Rafailov et al. eq. 7; label smoothing: conservative DPO
        p = jax.nn.sigmoid(beta * h)
        loss = jnp.mean(-(1 - smoothing) * jnp.log(p) - smoothing * jnp.log(1 - p))
    sums = (logp(params, "chosen", False), logp(params, "rejected", False))
    sums_ref = (logp(reference, "chosen", False), logp(reference, "rejected", False))
    chosen, rejected = beta * (sums[0] - sums_ref[0]), beta * (sums[1] - sums_ref[1])
    metrics = {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracies": (chosen > rejected).mean(),
        "rewards/margins": (chosen - rejected).mean(),
        "logps/chosen": sums[0].mean(),
        "logps/rejected": sums[1].mean(),
    }
    return loss, metrics


def plain_run(initial, batches, loss_type, smoothing, lr, beta):
    with nnx.use_eager_sharding(False):  # one device: the annotations unused
        graphdef, state, rest = nnx.split(make_model(nnx.Rngs(0)), nnx.Param, ...)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, initial))
    reference = state
    losses, metrics, after = [], [], []
    grad_fn = jax.jit(  # one device: the default one, nothing sharded
        jax.value_and_grad(plain_loss, has_aux=True), static_argnums=(3, 5, 6, 7)
    )
    for batch in batches:
        (loss, logs), grads = grad_fn(
            state, reference, rest, graphdef, batch, loss_type, smoothing, beta
        )
        state = jax.tree.map(lambda p, g: p - lr * g, state, grads)
        losses.append(float(loss))
        metrics.append({k: float(v) for k, v in logs.items()})
        after.append(nnx.to_pure_dict(state))
    return losses, metrics, after


def trainer_for(strategy, loss_type="sigmoid", smoothing=0.0, callbacks=(), lr=LR, beta=BETA):
    return DPOTrainer(
        make_model,
        optax.sgd(lr),
        beta=beta,
        loss_type=loss_type,
        label_smoothing=smoothing,
        strategy=strategy,
        log_every_n_steps=1,
        callbacks=list(callbacks),
    )


def flat(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


@pytest.mark.parametrize(
    ("strategy", "loss_type", "smoothing", "lr"),  # beta: BETA, IPO's 1 (a gentler square)
    [
        (DataParallel(), "sigmoid", 0.1, LR),
        (FSDP_TP, "sigmoid", 0.0, LR),
        (FSDP_TP, "ipo", 0.0, 0.5),
    ],
    ids=["dp-cdpo", "fsdp_tp-dpo", "fsdp_tp-ipo"],
)
def test_three_steps_equal_a_one_device_loop(strategy, loss_type, smoothing, lr):
    batches = toy_batches(3)
    recorded = Params()
    beta = 1.0 if loss_type == "ipo" else BETA
    trainer = trainer_for(strategy, loss_type, smoothing, callbacks=[recorded], lr=lr, beta=beta)
    initial = jax.device_get(nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))
    trainer.fit(batches, max_steps=3)
    losses, metrics, after = plain_run(initial, batches, loss_type, smoothing, lr, beta)

    np.testing.assert_allclose(trainer.history.history["train/loss"], losses, atol=1e-5)
    for name in METRICS:
        got = trainer.history.history[f"train/{name}"]
        np.testing.assert_allclose(got, [m[name] for m in metrics], atol=1e-5, err_msg=name)
    previous = flat(initial)
    for step, (got, want) in enumerate(zip(recorded.after, after, strict=True)):
        got, want = flat(got), flat(want)
        for key in want:  # the gradient of each step: SGD's update over the rate
            np.testing.assert_allclose(
                (previous[key] - got[key]) / lr,
                (previous[key] - want[key]) / lr,
                atol=1e-5,
                err_msg=f"step {step + 1} {key}",
            )
        previous = got


@pytest.mark.parametrize("strategy", [DataParallel(), FSDP_TP], ids=["dp", "fsdp_tp"])
def test_the_reference_is_laid_out_as_the_policy(strategy):
    trainer = trainer_for(strategy)
    policy = nnx.state(trainer.model)
    reference = trainer.reference.state
    policy_leaves = jax.tree_util.tree_flatten_with_path(policy)[0]
    reference_leaves = jax.tree_util.tree_flatten_with_path(reference)[0]
    assert [p for p, _ in policy_leaves] == [p for p, _ in reference_leaves]
    sharded = 0
    for (path, mine), (_, theirs) in zip(policy_leaves, reference_leaves, strict=True):
        assert theirs.sharding == mine.sharding, jax.tree_util.keystr(path)
        if jnp.issubdtype(mine.dtype, jax.dtypes.prng_key):
            mine, theirs = jax.random.key_data(mine), jax.random.key_data(theirs)
        np.testing.assert_array_equal(np.asarray(theirs), np.asarray(mine))  # step 0's weights
        sharded += not mine.sharding.is_fully_replicated
    assert sharded > 0 or isinstance(strategy, DataParallel)
    total = sum(x.nbytes for x in jax.tree.leaves(reference))
    per_device = trainer.reference.bytes_per_device()
    assert per_device == total if isinstance(strategy, DataParallel) else per_device < total


def test_auto_strategy_trains_as_the_layout_it_picks():
    """strategy=Auto(...): the layouts are timed on the policy's step (placeholder reference
    log-probabilities), and the run then equals the chosen strategy given explicitly."""
    batches = toy_batches(3, seed=4)
    auto = Auto(candidates=[DataParallel(), FSDP_TP], steps=1, rounds=1, print_fn=None)
    chosen = trainer_for(auto)
    chosen.fit(batches, max_steps=3)
    assert chosen.layout_choice is not None and chosen.step == 3
    explicit = trainer_for(chosen.strategy)
    explicit.fit(batches, max_steps=3)
    want = explicit.history.history
    for name in ("loss", *METRICS):
        got = chosen.history.history[f"train/{name}"]
        np.testing.assert_allclose(got, want[f"train/{name}"], atol=1e-6, err_msg=name)
    # The reference is real, never the placeholder: at step 1 the policy is the reference.
    assert chosen.history.history["train/rewards/chosen"][0] == 0.0


def test_dpo_learns_a_toy_preference():
    """16 pairs in two batches, seen 5 times each: the chosen completions (the prompt's
    last letter repeated) win on every pair and become likelier (Adam: no exactness here)."""
    pairs = [encode_text_pair(row, encode) for row in toy_rows(16, seed=1)]
    two = [pair_batch(pairs[:8], SEQ), pair_batch(pairs[8:], SEQ)]
    trainer = DPOTrainer(make_model, optax.adam(1e-2), beta=BETA, log_every_n_steps=1)
    trainer.fit([two[i % 2] for i in range(10)], max_steps=10)
    history = trainer.history.history
    assert history["train/rewards/accuracies"][0] == 0.0  # the policy is the reference
    assert min(history["train/rewards/accuracies"][-4:]) > 0.9, history
    assert history["train/logps/chosen"][-1] > history["train/logps/chosen"][0] + 3.0, history


class Crash(Callback):
    def on_train_batch_end(self, step, logs):
        if step == 3:
            raise RuntimeError("simulated crash")


def test_a_stopped_run_resumes_bitwise(tmp_path):
    batches = toy_batches(5, seed=2)
    whole = trainer_for(FSDP_TP)
    whole.fit(batches, max_steps=5)

    crashed = trainer_for(
        FSDP_TP, callbacks=[OrbaxCheckpoint(tmp_path, save_every_n_steps=2), Crash()]
    )
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit(batches, max_steps=5)
    checkpoint = OrbaxCheckpoint(tmp_path, save_every_n_steps=2)
    resumed = trainer_for(FSDP_TP, callbacks=[checkpoint])
    with pytest.warns(UserWarning, match="read and discarded"):
        resumed.fit(batches, max_steps=5)
    assert checkpoint.restored_step == 2 and resumed.step == 5
    want = flat(jax.device_get(nnx.to_pure_dict(nnx.state(whole.model, nnx.Param))))
    got = flat(jax.device_get(nnx.to_pure_dict(nnx.state(resumed.model, nnx.Param))))
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert resumed.history.history["train/loss"] == whole.history.history["train/loss"]


def test_bad_preference_rows(tmp_path):
    path = tmp_path / "pairs.jsonl"
    good = {"prompt": "ab", "chosen": "c", "rejected": "d"}
    same = {"prompt": "ab", "chosen": "c", "rejected": "c"}
    path.write_text("\n".join(json.dumps(r) for r in (good, same, good)) + "\n")
    rows = read_preferences(path)
    assert len(rows.rows) == 2 and rows.identical == 1
    assert "2 pairs, 1 skipped (chosen identical to rejected)" in rows.line()

    path.write_text(json.dumps(good) + "\n" + json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    with pytest.raises(PreferenceError, match=r"pairs.jsonl:2: .*no 'rejected'") as error:
        read_preferences(path)
    assert "\n" not in str(error.value)


# -- LoRA: the reference is the base with the adapters switched off ---------------------------
LORA = LoRA(rank=4, alpha=8.0, targets=r".*mha/(query|value|out)|.*linear1")


class Adapters(Callback):
    """The adapters (``lora_a``, ``lora_b``) after each step, on the host."""

    def __init__(self) -> None:
        self.after: list[dict[str, np.ndarray]] = []

    def on_train_batch_end(self, step, logs):
        self.after.append(host_flat(nnx.state(self.trainer.model, nnx.LoRAParam)))


def host_flat(state) -> dict[str, np.ndarray]:
    return {
        "/".join(map(str, p)): np.asarray(jax.device_get(v.get_value()))
        for p, v in nnx.to_flat_state(state)
    }


@pytest.fixture(scope="module")
def lora_run():
    """3 SGD steps of DPO with LoRA under FSDP x TP, its start and what each step left."""
    recorded = Adapters()
    trainer = DPOTrainer(
        make_model,
        optax.sgd(LR),
        beta=BETA,
        lora=LORA,
        strategy=FSDP_TP,
        log_every_n_steps=1,
        callbacks=[recorded],
    )
    start = host_flat(nnx.state(trainer.model, nnx.Param))
    batches = toy_batches(3, seed=3)
    trainer.fit(batches, max_steps=3)
    return trainer, start, batches, recorded.after


def plain_lora_run(start, batches):
    """The one-device loop: the policy is the base with each target kernel W replaced by
    ``W + alpha / rank * A B`` (the LoRA paper's eq. 3, merged), the reference the base
    alone; plain SGD on the adapters."""
    with nnx.use_eager_sharding(False):
        graphdef, state, rest = nnx.split(make_model(nnx.Rngs(0)), nnx.Param, ...)
    base = {k: v for k, v in start.items() if not k.endswith(("lora_a", "lora_b"))}
    for path, variable in nnx.to_flat_state(state):
        variable.set_value(jnp.asarray(base["/".join(map(str, path))]))
    layers = sorted(k.removesuffix("/lora_a") for k in start if k.endswith("/lora_a"))
    adapters = {k: (jnp.asarray(start[f"{k}/lora_a"]), jnp.asarray(start[f"{k}/lora_b"]))
                for k in layers}  # fmt: skip
    scale = LORA.alpha / LORA.rank

    def policy(adapters):
        merged = jax.tree.map(lambda x: x, state)  # a new State, the base's arrays
        flat = dict(nnx.to_flat_state(merged))
        for layer, (a, b) in adapters.items():
            kernel = flat[(*(int(p) if p.isdigit() else p for p in layer.split("/")), "kernel")]
            kernel.set_value(kernel.get_value() + scale * jnp.tensordot(a, b, axes=1))
        return merged

    def loss(adapters, batch):
        return plain_loss(policy(adapters), state, rest, graphdef, batch, "sigmoid", 0.0, BETA)

    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    losses, metrics, after = [], [], []
    for batch in batches:
        (value, logs), grads = grad_fn(adapters, batch)
        adapters = jax.tree.map(lambda p, g: p - LR * g, adapters, grads)
        losses.append(float(value))
        metrics.append({k: float(v) for k, v in logs.items()})
        after.append(adapters)
    return losses, metrics, after


def test_lora_dpo_equals_a_one_device_loop_with_the_base_as_reference(lora_run):
    trainer, start, batches, recorded = lora_run
    losses, metrics, after = plain_lora_run(start, batches)
    history = trainer.history.history
    np.testing.assert_allclose(history["train/loss"], losses, atol=1e-5)
    for name in METRICS:
        got = history[f"train/{name}"]
        np.testing.assert_allclose(got, [m[name] for m in metrics], atol=1e-5, err_msg=name)
    assert history["train/rewards/margins"][-1] > 0  # the reference is not the policy
    previous = {k: v for k, v in start.items() if k.endswith(("lora_a", "lora_b"))}
    for step, (got, want) in enumerate(zip(recorded, after, strict=True)):
        assert got.keys() == previous.keys()
        for layer, (a, b) in want.items():
            for key, value in ((f"{layer}/lora_a", a), (f"{layer}/lora_b", b)):
                np.testing.assert_allclose(  # the gradient of each step: SGD's update / LR
                    (previous[key] - got[key]) / LR,
                    (previous[key] - np.asarray(value)) / LR,
                    atol=1e-5,
                    err_msg=f"step {step + 1} {key}",
                )
        previous = got
    final = host_flat(nnx.state(trainer.model, nnx.Param))
    for key, value in start.items():
        if not key.endswith(("lora_a", "lora_b")):
            np.testing.assert_array_equal(final[key], value, err_msg=key)  # the base: frozen


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def test_lora_dpo_holds_no_second_copy_of_the_weights(lora_run):
    trainer, *_ = lora_run
    assert trainer.reference_is_base
    reference = trainer.reference
    assert reference.adapters_off and reference.bytes_per_device() == 0
    live = jax.tree.leaves(nnx.state(trainer.model))
    assert all(r is p for r, p in zip(jax.tree.leaves(reference.state), live, strict=True))
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(trainer.model, nnx.Param)))
    before = _live_bytes()
    base = ReferenceModel(trainer, trainer.side_logps, adapters_off=True)
    assert _live_bytes() - before < model_bytes // 10  # no weights of its own
    copy = ReferenceModel(trainer, trainer.side_logps)  # what DPO without LoRA holds
    assert _live_bytes() - before >= model_bytes and copy.bytes_per_device() > 0
    assert base.bytes_per_device() == 0


def test_adapters_off_needs_adapters():
    trainer = trainer_for(DataParallel())
    assert not trainer.reference_is_base
    with pytest.raises(ValueError, match="needs a policy with LoRA adapters"):
        ReferenceModel(trainer, trainer.side_logps, adapters_off=True)


# -- chat rows: rendered with a chat template, the completion's assistant tokens weighted ------
TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
CHAT_WORDS = ["<unk>", "\n", "system", "user", "assistant", "be", "brief", "hi", "hello"]
CHAT_WORDS += ["how", "are", "you", "fine", "thanks", "hmm", "<|im_start|>", "<|im_end|>"]
CHAT_ROW = {
    "prompt": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},  # an earlier turn: context, not trained
        {"role": "user", "content": "how are you"},
    ],
    "chosen": [{"role": "assistant", "content": "fine thanks"}],
    "rejected": [{"role": "assistant", "content": "hmm"}],
}


@pytest.fixture(scope="module")
def chat_tokenizers(tmp_path_factory):
    """ChatML with and without generation markers over a word-level tokenizer."""
    pytest.importorskip("transformers")
    import tokenizers
    from tokenizers import models, pre_tokenizers

    from nnx_spmd_trainer.data.chat import load_chat_tokenizer

    backend = tokenizers.Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(CHAT_WORDS)}, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(" +"), "removed"),
            pre_tokenizers.Split("\n", "isolated"),
        ]
    )
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    loaded = {}
    for name in ("chatml", "chatml_generation"):
        folder = tmp_path_factory.mktemp(name)
        backend.save(str(folder / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|im_end|>",
            "chat_template": (TEMPLATES / f"{name}.jinja").read_text(),
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        loaded[name] = load_chat_tokenizer(folder)
    return loaded


def weighted_tokens(tokenizer, sequence) -> list[str]:
    tokens = tokenizer.backend.convert_ids_to_tokens(sequence.tokens.tolist())
    return [t for t, w in zip(tokens, sequence.weights, strict=True) if w]


@pytest.mark.parametrize("template", ["chatml", "chatml_generation"])
def test_a_chat_row_weights_the_completions_assistant_tokens_only(chat_tokenizers, template):
    tokenizer = chat_tokenizers[template]
    assert tokenizer.markers == (template == "chatml_generation")
    assert is_chat_row(CHAT_ROW) and not is_chat_row({"prompt": "ab"})
    pair = encode_chat_pair(CHAT_ROW, tokenizer)
    # Hand-checked: the completion's content and its end token; not the prompt's "hello"
    # turn, not the newline the template writes after the end token.
    assert weighted_tokens(tokenizer, pair.chosen) == ["fine", "thanks", "<|im_end|>"]
    assert weighted_tokens(tokenizer, pair.rejected) == ["hmm", "<|im_end|>"]
    tokens = tokenizer.backend.convert_ids_to_tokens(pair.chosen.tokens.tolist())
    assert tokens[-5:] == ["\n", "fine", "thanks", "<|im_end|>", "\n"]
    assert tokens.count("hello") == 1  # the earlier assistant turn is there, as context
    # Shared prompt: both sides start with the same tokens, up to the completion.
    start = int(np.argmax(pair.rejected.weights))
    np.testing.assert_array_equal(pair.chosen.tokens[:start], pair.rejected.tokens[:start])


def test_a_text_row_and_the_same_row_as_messages(chat_tokenizers):
    """The text row written as the template renders it gives the chat row's tokens and
    weights; the chat row's sequence only adds the newline after the end token, unweighted."""
    tokenizer = chat_tokenizers["chatml"]

    def encode(text):
        return np.asarray(tokenizer.backend(text, add_special_tokens=False)["input_ids"])

    text_row = {
        "prompt": tokenizer.render(CHAT_ROW["prompt"], generation_prompt=True),
        "chosen": "fine thanks<|im_end|>",
        "rejected": "hmm<|im_end|>",
    }
    text, chat = encode_text_pair(text_row, encode), encode_chat_pair(CHAT_ROW, tokenizer)
    for side in ("chosen", "rejected"):
        t, c = getattr(text, side), getattr(chat, side)
        np.testing.assert_array_equal(c.tokens[:-1], t.tokens, err_msg=side)
        np.testing.assert_array_equal(c.weights[:-1], t.weights, err_msg=side)
        assert c.weights[-1] == 0 and tokenizer.decode(c.tokens[-1:]) == "\n"
    seq = len(chat.chosen.tokens)
    text_batch, chat_batch = pair_batch([text], seq), pair_batch([chat], seq)
    for key in ("chosen_weights", "rejected_weights"):  # the same tokens weighted
        np.testing.assert_array_equal(text_batch[key], chat_batch[key], err_msg=key)


def test_bad_chat_preference_rows(chat_tokenizers, tmp_path):
    path = tmp_path / "chat.jsonl"
    same = {**CHAT_ROW, "rejected": CHAT_ROW["chosen"]}
    mixed = {**CHAT_ROW, "chosen": "fine thanks"}
    path.write_text("\n".join(json.dumps(r) for r in (CHAT_ROW, same)) + "\n")
    rows = read_preferences(path)
    assert len(rows.rows) == 1 and rows.identical == 1 and is_chat_row(rows.rows[0])
    path.write_text(json.dumps(CHAT_ROW) + "\n" + json.dumps(mixed) + "\n")
    with pytest.raises(PreferenceError, match=r"chat.jsonl:2: 'chosen' of a chat row must be"):
        read_preferences(path)
    user_only = {**CHAT_ROW, "rejected": [{"role": "user", "content": "hmm"}]}
    path.write_text(json.dumps(user_only) + "\n")
    with pytest.raises(PreferenceError, match="'rejected' has no assistant message"):
        read_preferences(path)
    tool = {**CHAT_ROW, "chosen": [{"role": "robot", "content": "hi"}]}
    with pytest.raises(PreferenceError, match="unknown role 'robot'"):
        encode_chat_pair(tool, chat_tokenizers["chatml"])


def test_implicit_prompt_rows_are_split_as_trl_splits_them(tmp_path):
    """TRL's implicit-prompt rows (``{"chosen", "rejected"}`` only): the prompt is what both
    share from the start (``trl.extract_prompt``), checked against splits written by hand."""
    system = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": "What color is the sky?"}
    blue = {"role": "assistant", "content": "It is blue."}
    green = {"role": "assistant", "content": "It is green."}
    again = {"role": "user", "content": "Sure?"}
    rows = [
        {"chosen": [system, user, blue], "rejected": [system, user, green], "id": 7},
        # One a prefix of the other: TRL's loop leaves the last shared message to both.
        {"chosen": [user, blue], "rejected": [user, blue, again, green]},
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    ]
    expected = [
        {"prompt": [system, user], "chosen": [blue], "rejected": [green], "id": 7},
        {"prompt": [user], "chosen": [blue], "rejected": [blue, again, green]},
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    ]
    path = tmp_path / "implicit.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    read = read_preferences(path)
    assert read.rows == expected and read.identical == 0
    assert [is_chat_row(row) for row in read.rows] == [True, True, False]
    # A row that still lacks a key is refused as before, naming it.
    path.write_text(json.dumps({"chosen": [user, blue]}) + "\n")
    with pytest.raises(PreferenceError, match=r"implicit.jsonl:1: .*no 'prompt', 'rejected'"):
        read_preferences(path)
