"""nn.token_log_probs: each target's log-probability, the head projected a chunk of
positions at a time.

Checked against ``jax.nn.log_softmax`` of the full logits written out here (values and
gradients, float32, 1e-5), with a temperature and a sampler's kept set (top-k / top-p
renormalized: the formula written here over the full logits), a padded vocabulary,
and sharded under DataParallel and FSDP x TensorParallel.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, TensorParallel
from nnx_spmd_trainer.nn import token_log_probs

ROWS, SEQ, WIDTH, VOCAB = 4, 24, 16, 64


def random_head(rows=ROWS, seq=SEQ, width=WIDTH, vocab=VOCAB, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    hidden = jax.random.normal(keys[0], (rows, seq, width))
    kernel = jax.random.normal(keys[1], (width, vocab)) / np.sqrt(width)
    bias = 0.5 * jax.random.normal(keys[2], (vocab,))
    targets = jax.random.randint(keys[3], (rows, seq), 0, vocab)
    weights = jax.random.uniform(keys[4], (rows, seq))  # a loss that weighs each token
    return hidden, kernel, bias, targets, weights


def full_log_probs(hidden, kernel, bias, targets, temperature=1.0, kept=None, vocab_size=None):
    """The independent computation: the whole [rows, seq, vocab] logits, jnp's log_softmax."""
    logits = (hidden @ kernel + bias).astype(jnp.float32)
    if vocab_size is not None:
        logits = logits[..., :vocab_size]
    logits = logits / temperature
    if kept is not None:
        logits = jnp.where(logits >= kept[..., None], logits, -jnp.inf)
    logps = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logps, targets[..., None], axis=-1)[..., 0]


def value_and_grads(fn, hidden, kernel, bias, targets, weights, **static):
    """A weighted sum of the log-probabilities and its gradients (hidden, kernel, bias)."""

    def loss(h, k, b):
        logps = fn(h, k, b, targets, **static)
        return jnp.sum(logps * weights), logps

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(hidden, kernel, bias)


def chunked(hidden, kernel, bias, targets, *, chunk_size=8, **kw):
    return token_log_probs(hidden, kernel, targets, head_bias=bias, chunk_size=chunk_size, **kw)


def assert_close(actual, expected, tol=1e-5):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=tol, atol=tol)


@pytest.mark.parametrize("chunk_size", [5, 8, SEQ, 100])
def test_equals_the_full_log_softmax_values_and_gradients(chunk_size):
    head = random_head()
    (_, logps), grads = value_and_grads(chunked, *head, chunk_size=chunk_size)
    (_, expected), expected_grads = value_and_grads(full_log_probs, *head)
    assert logps.shape == (ROWS, SEQ) and logps.dtype == jnp.float32
    assert_close((logps, grads), (expected, expected_grads))


def test_a_temperature_and_a_kept_set_are_the_sampled_distribution():
    """z/T renormalized over the tokens whose tempered logit is at least the kept
    minimum (here each position keeps its 10 largest; some positions keep all: -inf)."""
    hidden, kernel, bias, targets, weights = random_head(seed=1)
    temperature = 0.7
    tempered = (hidden @ kernel + bias) / temperature
    kept = jnp.sort(tempered, axis=-1)[..., -10]
    kept = kept.at[0, :5].set(-jnp.inf)  # nothing truncated there
    targets = jnp.argsort(-tempered, axis=-1)[..., 3]  # a token inside the kept set
    head = (hidden, kernel, bias, targets, weights)
    static = {"temperature": temperature, "kept_min_logit": kept}
    (_, logps), grads = value_and_grads(chunked, *head, **static)
    full_static = {"temperature": temperature, "kept": kept}
    (_, expected), expected_grads = value_and_grads(full_log_probs, *head, **full_static)
    assert_close((logps, grads), (expected, expected_grads))
    untruncated = chunked(hidden, kernel, bias, targets, temperature=temperature)
    assert np.all(np.asarray(logps[1:]) > np.asarray(untruncated[1:]))  # less mass to share
    np.testing.assert_array_equal(logps[0, :5], untruncated[0, :5])


def test_padded_vocabulary_columns_are_never_a_token():
    hidden, kernel, bias, targets, weights = random_head(seed=2)
    targets = targets % 50
    head = (hidden, kernel, bias, targets, weights)
    (_, logps), grads = value_and_grads(chunked, *head, vocab_size=50)
    (_, expected), expected_grads = value_and_grads(full_log_probs, *head, vocab_size=50)
    assert_close((logps, grads), (expected, expected_grads))


@pytest.mark.parametrize(
    ("strategy", "specs"),
    [
        (DataParallel(8), (P("data"), P(), P(), P("data"), P("data"))),
        (
            Hybrid(FSDP(4), TensorParallel(2)),
            (P("fsdp"), P(None, "model"), P("model"), P("fsdp"), P("fsdp")),
        ),
    ],
    ids=["dp", "fsdp_x_tp"],
)
def test_sharded_equals_one_device(strategy, specs):
    mesh = strategy.make_mesh()
    head = random_head(rows=8, seq=16, vocab=128, seed=3)
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(head, specs, strict=True)]
    with jax.set_mesh(mesh):
        (_, logps), grads = value_and_grads(chunked, *placed)
    (_, expected), expected_grads = value_and_grads(full_log_probs, *head)
    assert_close((logps, grads), (expected, expected_grads))
    assert [g.sharding.spec for g in grads] == list(specs[:3])


def test_the_vocabulary_never_exists_whole_forward_or_backward():
    """No value of the compiled gradient has [rows, seq, vocab] elements: only chunks."""
    rows, seq, width, vocab = 2, 64, 8, 1000
    shapes = [
        jax.ShapeDtypeStruct((rows, seq, width), jnp.float32),
        jax.ShapeDtypeStruct((width, vocab), jnp.float32),
        jax.ShapeDtypeStruct((rows, seq), jnp.int32),
    ]

    def loss(h, k, t):
        return token_log_probs(h, k, t, chunk_size=8).sum()

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*shapes).compile().as_text()
    assert "f32[2,8,1000]" in hlo.replace(" ", "")  # a chunk's logits
    assert f"[{rows},{seq},{vocab}]" not in hlo.replace(" ", "")


def test_bad_arguments_are_clear_errors():
    hidden, kernel, bias, targets, _ = random_head()
    with pytest.raises(ValueError, match="temperature=0"):
        token_log_probs(hidden, kernel, targets, temperature=0.0)
    with pytest.raises(ValueError, match="kept_min_logit is one value per token"):
        token_log_probs(hidden, kernel, targets, kept_min_logit=jnp.zeros((ROWS,)))
    with pytest.raises(ValueError, match="does not match the hidden states' width"):
        token_log_probs(hidden, kernel.T, targets)


# -- a model's log-probabilities (nn.logprob_model's protocol) ---------------------------


def tiny_gpt(rngs):
    from nnx_spmd_trainer.app.models.gpt import GPT

    return GPT(
        vocab_size=40,
        seq_len=12,
        embed_dim=16,
        num_heads=2,
        ff_dim=32,
        num_layers=1,
        dropout_rate=0.0,
        rngs=rngs,
    )


def tiny_gpt2(rngs):
    from nnx_spmd_trainer.app.models.gpt2_hf import GPT2, GPT2Config

    config = GPT2Config(
        vocab_size=37, n_positions=12, n_embd=16, n_layer=1, n_head=2, dropout=0.0, pad_vocab_to=8
    )
    return GPT2(config, rngs=rngs)


def model_and_tokens(build, lora_config=None):
    from flax import nnx

    from nnx_spmd_trainer.nn import lora

    with nnx.use_eager_sharding(False):  # one device: the models' annotations unused
        model = build(nnx.Rngs(0))
        if lora_config is not None:
            lora.apply(model, lora_config, rngs=nnx.Rngs(1))
        for layer in lora.adapted_layers(model).values():  # adapters that change the output
            layer.lora_b[...] = 0.1 * jax.random.normal(jax.random.key(2), layer.lora_b.shape)
    tokens = jax.random.randint(jax.random.key(3), (3, 12), 0, 37)
    return model, tokens[:, :-1], tokens[:, 1:]


def model_grads(fn, model, inputs, targets, wrt):
    """The log-probabilities and the gradient of their sum w.r.t. ``wrt``'s parameters."""
    from flax import nnx

    def loss(m):
        logps = fn(m, inputs, targets)
        return jnp.sum(logps), logps

    grad = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, wrt), has_aux=True))
    grads, logps = grad(model)
    return logps, nnx.to_pure_dict(grads)


@pytest.mark.parametrize(
    ("build", "lora_targets"),
    [(tiny_gpt, None), (tiny_gpt2, None), (tiny_gpt, r"blocks/\d+/mha/(query|value)")],
    ids=["gpt", "gpt2_tied_padded", "gpt_lora"],
)
def test_a_models_chunked_log_probs_equal_its_full_logits(build, lora_targets):
    """GPT (head: nnx.Linear), GPT-2 (head tied to wte, vocabulary padded 37 -> 40) and a
    LoRA run (only the adapters differentiated): the chunked log-probabilities and the
    parameters' gradients equal jnp's log_softmax over ``model(inputs)``."""
    from flax import nnx

    from nnx_spmd_trainer.nn import lora
    from nnx_spmd_trainer.nn.logprob_model import chunk_reason, model_token_scores

    config = None if lora_targets is None else lora.LoRA(rank=2, targets=lora_targets)
    model, inputs, targets = model_and_tokens(build, config)
    assert chunk_reason(model) is None
    assert config is None or len(lora.adapted_layers(model)) == 2
    wrt = nnx.Param if config is None else nnx.LoRAParam

    def chunked_fn(m, x, y):
        return model_token_scores(m, x, y, chunk_size=4)[0]

    def full_fn(m, x, y):
        logps = jax.nn.log_softmax(m(x).astype(jnp.float32), axis=-1)
        return jnp.take_along_axis(logps, y[..., None], axis=-1)[..., 0]

    got, got_grads = model_grads(chunked_fn, model, inputs, targets, wrt)
    want, want_grads = model_grads(full_fn, model, inputs, targets, wrt)
    assert_close(got, want)
    assert jax.tree.structure(got_grads) == jax.tree.structure(want_grads)
    assert_close(got_grads, want_grads)


def test_a_model_without_the_protocol_is_scored_on_its_logits():
    from flax import nnx

    from nnx_spmd_trainer.nn.logprob_model import chunk_reason, model_token_scores

    class Bare(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(40, 8, rngs=rngs)
            self.out = nnx.Linear(8, 40, rngs=rngs)

        def __call__(self, tokens):
            return self.out(self.embed(tokens))

    model, inputs, targets = model_and_tokens(Bare)
    assert "Bare has no features" in chunk_reason(model)
    logps, predictions = model_token_scores(model, inputs, targets, temperature=0.5)
    logits = model(inputs) / 0.5
    want = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    assert_close(logps, want)
    np.testing.assert_array_equal(predictions, jnp.argmax(logits, -1))


def test_gpt2s_chunked_sft_loss_equals_its_plain_loss():
    """gpt.chunked_loss_fn on GPT-2 (its tied, padded head through output_head()): the
    plain loss over the full logits, value and gradients."""
    from flax import nnx

    from nnx_spmd_trainer.app.models import gpt

    model, inputs, targets = model_and_tokens(tiny_gpt2)
    batch = {"inputs": inputs, "targets": targets}

    def grads(loss):
        fn = nnx.value_and_grad(lambda m: loss(m, batch)[0])
        value, g = nnx.jit(fn)(model)
        return value, nnx.to_pure_dict(g)

    chunked = grads(lambda m, b: gpt.chunked_loss_fn(m, b, chunk_size=4))
    assert_close(chunked, grads(gpt.loss_fn))


def test_greedy_says_whether_each_target_is_the_argmax():
    from nnx_spmd_trainer.nn.logprob import token_scores

    hidden, kernel, bias, targets, _ = random_head(seed=9)
    logits = hidden @ kernel + bias
    targets = targets.at[:, ::2].set(jnp.argmax(logits, -1)[:, ::2])  # half of them greedy
    logps, greedy = token_scores(hidden, kernel, targets, head_bias=bias, chunk_size=8, greedy=True)
    np.testing.assert_array_equal(greedy, targets == jnp.argmax(logits, -1))
    assert greedy.dtype == jnp.bool_ and bool(greedy[:, ::2].all())
    assert_close(logps, full_log_probs(hidden, kernel, bias, targets))
