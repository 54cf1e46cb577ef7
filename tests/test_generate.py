"""The sampler (nnx_spmd_trainer.generate): exact against the training forward pass under
every strategy, seeded alike on one device and eight, a user's Flax model, stops, errors."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnx_spmd_trainer import (
    FSDP,
    DataParallel,
    ExpertParallel,
    Hybrid,
    PipelineParallel,
    SequenceParallel,
    TensorParallel,
    Trainer,
)
from nnx_spmd_trainer.app.models.gpt import GPT
from nnx_spmd_trainer.app.models.gpt2_hf import GPT2, GPT2Config
from nnx_spmd_trainer.generate import CacheTooLarge, Inputs, Sampler, Sampling, row_key, sample

# Unequal lengths: left padding is in play in every test.
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]]
NEW = 5


def gpt(*, scan: bool = False, experts: int = 0) -> Callable[[nnx.Rngs], nnx.Module]:
    def factory(rngs: nnx.Rngs) -> nnx.Module:
        return GPT(
            vocab_size=32, seq_len=16, embed_dim=32, num_heads=8, ff_dim=64, num_layers=2,
            dropout_rate=0.1, rngs=rngs, scan_layers=scan,
            moe_experts=experts, moe_every=2,
            moe_capacity_factor=None,  # dropless: each token routed alone, as it decodes
        )  # fmt: skip

    return factory


def gpt2(rngs: nnx.Rngs) -> nnx.Module:
    config = GPT2Config(
        vocab_size=30, n_positions=16, n_embd=32, n_layer=2, n_head=4, dropout=0.1, pad_vocab_to=8
    )
    return GPT2(config, rngs=rngs, scan_layers=True)


class UserLM(nnx.Module):
    """A user's model in Flax's decode convention: a plain nnx.MultiHeadAttention."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.seq_len = 16
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.pos = nnx.Embed(16, 16, rngs=rngs)
        self.mha = nnx.MultiHeadAttention(2, 16, decode=False, rngs=rngs)
        self.head = nnx.Linear(16, 32, rngs=rngs)

    def __call__(
        self, tokens: jax.Array, positions: jax.Array | None = None, mask: jax.Array | None = None
    ) -> jax.Array:
        where = jnp.arange(tokens.shape[-1]) if positions is None else positions
        x = self.embed(tokens) + self.pos(where)
        x = x + self.mha(x, mask=nnx.make_causal_mask(tokens) if mask is None else mask)
        return self.head(x)


def trainer(factory: Callable[[nnx.Rngs], nnx.Module], strategy: Any, **kw: Any) -> Trainer:
    return Trainer(factory, optax.sgd(0.1), strategy=strategy, loss_fn=lambda m, b: (0.0, {}), **kw)


def forced_logits(t: Trainer, prompts: list[list[int]], new: list[list[int]]) -> list[np.ndarray]:
    """The logits that chose each generated token (``[new, vocab]`` a prompt), float32, from
    the trainer's own compiled forward pass over prompt + continuation, right padded."""
    tokens = np.zeros((8, 16), np.int32)
    for r, (p, n) in enumerate(zip(prompts, new, strict=True)):
        tokens[r, : len(p) + len(n)] = p + n
    (logits,) = t.predict([{"x": tokens}], to_numpy=True)
    return [
        np.asarray(logits[r, len(p) - 1 : len(p) + len(n) - 1], np.float32)
        for r, (p, n) in enumerate(zip(prompts, new, strict=True))
    ]


def teacher_forced(t: Trainer, prompts: list[list[int]], new: list[list[int]]) -> tuple[Any, Any]:
    """Each generated token's log-probability and the argmax, from the trainer's own
    compiled forward pass (``Trainer.predict``) over prompt + continuation, right padded."""
    rows = [p + n for p, n in zip(prompts, new, strict=True)]
    # Eight rows of the whole context: every layout splits them without padding.
    tokens = np.zeros((8, 16), np.int32)
    for r, row in enumerate(rows):
        tokens[r, : len(row)] = row
    (logits,) = t.predict([{"x": tokens}], to_numpy=True)
    log_probs, argmax = [], []
    for r, (p, n) in enumerate(zip(prompts, new, strict=True)):
        steps = np.arange(len(p) - 1, len(p) + len(n) - 1)
        lp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits[r, steps], jnp.float32), axis=-1))
        log_probs.append(lp[np.arange(len(n)), n])
        argmax.append(lp.argmax(-1).tolist())
    return log_probs, argmax


CASES = {
    "dp": (gpt(), DataParallel()),
    "fsdp-scanned": (gpt(scan=True), FSDP(min_size=16)),
    "tp": (gpt(), TensorParallel(8)),
    "fsdp-tp": (gpt(), Hybrid(FSDP(4, min_size=16), TensorParallel(2))),
    "moe-ep": (gpt(experts=4), Hybrid(DataParallel(2), ExpertParallel(4, min_size=16))),
    "gpt2-scanned-tp": (gpt2, Hybrid(DataParallel(4), TensorParallel(2))),
    "user-model": (UserLM, DataParallel()),
    "pipeline-resharded": (gpt(scan=True), Hybrid(DataParallel(4), PipelineParallel(2))),
    "sequence-resharded": (gpt(), Hybrid(DataParallel(2), SequenceParallel(4))),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def greedy(request: pytest.FixtureRequest) -> tuple[Trainer, Any]:
    factory, strategy = CASES[request.param]
    t = trainer(factory, strategy)
    notes: list[str] = []
    out = Sampler(t.model, t.plan, print_fn=notes.append).generate(PROMPTS, max_new_tokens=NEW)
    assert len(notes) == ("resharded" in request.param)  # one line where it reshards
    return t, out


def test_greedy_log_probs_equal_the_training_forward_pass(greedy: tuple[Trainer, Any]) -> None:
    t, out = greedy
    assert out.finish == ["length"] * len(PROMPTS)
    assert [len(new) for new in out.tokens] == [NEW] * len(PROMPTS)
    expected, argmax = teacher_forced(t, PROMPTS, out.tokens)
    for log_probs, want in zip(out.log_probs, expected, strict=True):
        np.testing.assert_allclose(log_probs, want, atol=1e-5, rtol=0)
    assert out.tokens == argmax


def test_a_bfloat16_model_decodes_from_a_float32_cache_as_its_forward_pass() -> None:
    """A model computing in bfloat16 beside the sampler's float32 cache (its default):
    keys and values are written in the cache's dtype and read back in their own (a
    bfloat16 value survives the round trip), so greedy decoding equals the model's own
    forward pass."""

    def bf16_gpt(rngs: nnx.Rngs) -> nnx.Module:
        return GPT(vocab_size=64, seq_len=16, embed_dim=32, num_heads=4, ff_dim=64,
                   num_layers=2, dropout_rate=0.0, rngs=rngs, dtype=jnp.bfloat16)  # fmt: skip

    t = trainer(bf16_gpt, Hybrid(FSDP(4, min_size=16), TensorParallel(2)))
    out = Sampler(t.model, t.plan, print_fn=None).generate(PROMPTS, max_new_tokens=NEW)
    expected, argmax = teacher_forced(t, PROMPTS, out.tokens)
    assert out.tokens == argmax
    for log_probs, want in zip(out.log_probs, expected, strict=True):
        np.testing.assert_allclose(log_probs, want, atol=1e-5, rtol=0)


def test_the_training_state_is_only_read(greedy: tuple[Trainer, Any]) -> None:
    t, _ = greedy
    assert not jax.tree.leaves(nnx.state(t.model, nnx.Cache))
    assert all(not getattr(m, "decode", False) for _, m in nnx.iter_modules(t.model))


@pytest.mark.parametrize("phase_timing", [False, True], ids=["one_program", "two"])
def test_one_program_per_bucket_or_prefill_and_decode_not_one_per_token(
    phase_timing: bool, caplog: pytest.LogCaptureFixture
) -> None:
    t = trainer(gpt(), DataParallel())
    sampler = Sampler(t.model, t.plan, phase_timing=phase_timing)
    with jax.log_compiles(), caplog.at_level(logging.WARNING, logger="jax"):
        first = sampler.generate(PROMPTS, max_new_tokens=NEW + 4)
        again = sampler.generate([[3, 4], [5]], max_new_tokens=NEW + 6)  # the same bucket
    compiled = [
        r.getMessage().split()[4]
        for r in caplog.records
        if r.getMessage().startswith("Finished XLA compilation of")
    ]
    # Not one per token, nor per length: how many steps run is an argument.
    expected = ["jit(decode)", "jit(prefill)"] if phase_timing else ["jit(whole)"]
    assert sorted(compiled) == expected, compiled
    assert sampler.last_timing is not None and sampler.last_timing.decode_steps == NEW + 5
    assert [len(x) for x in first.tokens + again.tokens] == [NEW + 4] * 3 + [NEW + 6] * 2


def test_the_decode_loop_donates_the_cache(small: Sampler) -> None:
    programs = small.programs
    rows, columns, length = 8, 16, 32
    how = Sampling()
    leaves = programs.state_leaves()
    tokens = np.ones((rows, columns), np.int32)
    positions = np.tile(np.arange(columns, dtype=np.int32), (rows, 1))
    real = np.ones((rows, length), bool)
    lengths, row_ids = np.full(rows, columns, np.int32), np.arange(rows, dtype=np.int32)
    inputs = Inputs(lengths, real, np.uint32(0), row_ids, np.int32(-1))
    active = np.ones(rows, bool)
    cache, carry, on_devices = programs.prefill(rows, columns, length, how)(
        leaves, tokens, positions, active, inputs
    )
    decode = programs.decode(rows, length, how)
    after, done = decode(leaves, cache, carry, on_devices, jnp.int32(4))
    assert int(done.step) == 4 and np.asarray(done.taken).tolist() == [4] * rows
    # The keys, values and index: their buffers became the next cache's. (The padding
    # mask is rewritten from `real` at every call, so the step never reads the old one.)
    kept = [x for x in cache if x.dtype != jnp.bool_]
    assert len(kept) == 2 * 3 and all(x.is_deleted() for x in kept)
    assert not any(x.is_deleted() for x in after + leaves)


def test_prefill_is_one_pass_where_every_attention_takes_a_block() -> None:
    """GPT's and GPT-2's prompts go through the model once: no loop over the prompt's
    columns in the program (GPT-2's one loop is its scanned layers'); Flax's own
    attention takes one position a call, so the user's model loops over them."""
    for factory, one_pass, loops in ((gpt(), True, 0), (gpt2, True, 1), (UserLM, False, 1)):
        t = trainer(factory, DataParallel())
        programs = Sampler(t.model, t.plan).programs
        assert programs.one_pass_prefill is one_pass
        text = programs.prefill(8, 16, 32, Sampling()).as_text()
        assert text.count(" while(") == loops, factory


def test_the_same_seed_samples_the_same_tokens_on_one_device_and_on_eight() -> None:
    how = {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 7, "max_new_tokens": NEW}
    one = trainer(gpt(), DataParallel(), devices=jax.devices()[:1])
    eight = trainer(gpt(), Hybrid(FSDP(4, min_size=16), TensorParallel(2)))
    same = zip(
        jax.tree.leaves(nnx.state(one.model, nnx.Param)),
        jax.tree.leaves(nnx.state(eight.model, nnx.Param)),
        strict=True,
    )
    for a, b in same:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same weights
    on_one = Sampler(one.model, one.plan).generate(PROMPTS, **how)
    on_eight = Sampler(eight.model, eight.plan).generate(PROMPTS, **how)
    assert on_one.tokens == on_eight.tokens
    other_seed = Sampler(one.model, one.plan).generate(PROMPTS, **{**how, "seed": 8})
    assert other_seed.tokens != on_one.tokens


class Letters:
    """A codec of 32 letters: id i is chr(ord('a') + i)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids: Any) -> str:
        return "".join(chr(ord("a") + int(i)) for i in ids)


SMALL_TRAINER: list[Trainer] = []


@pytest.fixture(scope="module")
def small() -> Sampler:
    t = trainer(gpt(), DataParallel())
    SMALL_TRAINER[:] = [t]
    return Sampler(t.model, t.plan, tokenizer=Letters())


def test_stops_on_an_end_token_and_a_stop_string(small: Sampler) -> None:
    full = small.generate(["bcdef", "hi"], max_new_tokens=NEW)
    assert full.text == [Letters().decode(ids) for ids in full.tokens]
    end = full.tokens[0][2]
    first_end = full.tokens[0].index(end)
    ended = small.generate(["bcdef", "hi"], max_new_tokens=NEW, end_token=end)
    assert ended.tokens[0] == full.tokens[0][: first_end + 1] and ended.finish[0] == "end"
    assert ended.text is not None and ended.text[0] == full.text[0][:first_end]
    stop = full.text[1][1:3]
    stopped = small.generate(["bcdef", "hi"], max_new_tokens=NEW, stop=[stop])
    assert stopped.finish[1] == "stop" and stopped.text is not None
    assert stopped.text[1] == full.text[1][: full.text[1].index(stop)]
    assert stopped.tokens[1] == full.tokens[1][: len(stopped.tokens[1])]
    # Read every 2 steps (three decode programs): the same rows, the stopped one marked
    # done on the device between blocks while the other runs on.
    blocks = Sampler(small.programs._model, small.programs.plan, tokenizer=Letters(),
                     block_steps=2, print_fn=None)  # fmt: skip
    again = blocks.generate(["bcdef", "hi"], max_new_tokens=NEW, stop=[stop])
    assert (again.tokens, again.text, again.finish) == (stopped.tokens, stopped.text,
                                                        stopped.finish)  # fmt: skip
    assert again.log_probs == stopped.log_probs
    assert blocks.last_timing is not None and blocks.last_timing.blocks >= 2


def test_tokens_per_second_are_measured_and_logged_once_per_call(
    small: Sampler, caplog: pytest.LogCaptureFixture
) -> None:
    # The default call is one program: only the whole call is timed.
    with caplog.at_level(logging.INFO, logger="nnx_spmd_trainer.generate.sampler"):
        whole = small.generate([[1, 2, 3], [4]], max_new_tokens=4)
    timing = small.last_timing
    assert timing is not None and timing.one_program and timing.blocks == 0
    assert (timing.prompt_tokens, timing.decode_steps, timing.tokens) == (4, 3, 2 * 4)
    assert whole.tokens_per_second == pytest.approx(8 / timing.call_seconds)
    assert whole.prefill_tokens_per_second == 0.0 == whole.decode_tokens_per_second
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "in one program" in lines[0], lines
    # phase_timing: prefill and the loop as two programs, each timed; the same output.
    phases = Sampler(small.programs._model, small.programs.plan, phase_timing=True,
                     print_fn=None)  # fmt: skip
    out = phases.generate([[1, 2, 3], [4]], max_new_tokens=4)
    assert (out.tokens, out.log_probs) == (whole.tokens, whole.log_probs)
    assert out.prefill_tokens_per_second > 0 and out.decode_tokens_per_second > 0
    timing = phases.last_timing
    assert timing is not None and not timing.one_program and timing.blocks == 1
    assert timing.decode_tokens == 2 * 3  # two prompts, three steps after prefill's token
    assert out.decode_tokens_per_second == pytest.approx(6 / timing.decode_seconds)
    assert timing.decode_seconds <= timing.decode_loop_seconds <= timing.call_seconds
    one = small.generate([[1, 2, 3]], max_new_tokens=1)
    assert one.decode_tokens_per_second == 0.0  # no decode step ran
    assert one.tokens_per_second > 0


def test_one_program_and_two_draw_the_same_tokens(small: Sampler) -> None:
    """A sampled call (temperature, top-k, top-p, an end token) gives the same tokens and
    log-probabilities, bitwise, as one program or as prefill and the loop apart."""
    phases = Sampler(small.programs._model, small.programs.plan, phase_timing=True,
                     print_fn=None)  # fmt: skip
    how = {"max_new_tokens": 6, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3,
           "end_token": 2}  # fmt: skip
    one, two = (s.generate([[1, 2, 3], [4], [5, 6]], **how) for s in (small, phases))
    assert small.last_timing is not None and small.last_timing.one_program
    assert (one.tokens, one.finish) == (two.tokens, two.finish)
    assert one.log_probs == two.log_probs
    assert one.sampling_log_probs == two.sampling_log_probs


def test_bad_input_is_named(small: Sampler) -> None:
    with pytest.raises(ValueError, match=r"top_p=1.5 is outside \(0, 1\]"):
        small.generate([[1]], max_new_tokens=2, top_p=1.5)
    with pytest.raises(ValueError, match="more than the model's context of 16 positions"):
        small.generate([list(range(14))], max_new_tokens=4)
    with pytest.raises(ValueError, match="empty prompt"):
        small.generate([[]], max_new_tokens=2)


def test_a_cache_that_cannot_fit_is_refused_with_its_numbers(small: Sampler) -> None:
    # Two prompts padded to 8 rows (DataParallel over 8 devices: one row each), 16 prompt
    # columns + 5 rounded up to 32 positions. Per layer (2): keys and values of one row
    # (32 positions x 8 heads x 4 dims x float32), its row of the mask (32 bools), the index.
    need = small.cache_bytes(["bcdef", "hi"], max_new_tokens=5)
    assert need == 2 * (2 * 32 * 8 * 4 * 4 + 32 + 4)
    tight = Sampler(small.programs._model, small.programs.plan, memory_budget_bytes=need - 1)
    with pytest.raises(CacheTooLarge, match=f"needs {need:,} bytes per device, more than"):
        tight.generate([[1, 2, 3, 4, 5], [7, 8]], max_new_tokens=5)


def test_a_calls_memory_is_reported_before_it_runs(small: Sampler) -> None:
    short = small.memory(["bcdef", "hi"], max_new_tokens=5)  # a cache of 32 positions
    long = small.memory(["bcdef", "hi"], max_new_tokens=40)  # of 64
    assert (short.rows, short.length, long.length) == (8, 32, 64)
    assert short.cache_bytes == small.cache_bytes(["bcdef", "hi"], max_new_tokens=5)
    assert long.cache_bytes == 2 * (2 * 64 * 8 * 4 * 4 + 64 + 4)  # as the refusal test counts
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(small.programs._model)))
    assert short.state_bytes == weights  # DataParallel: every device holds them whole
    for report in (short, long):
        assert report.prefill_peak is not None and report.decode_peak is not None
        # Each program holds the weights and the cache (made, or donated) at its peak.
        assert report.prefill_peak >= report.state_bytes + report.cache_bytes
        assert report.decode_peak >= report.state_bytes + report.cache_bytes
        assert report.call_peak is not None
        assert report.call_peak >= report.state_bytes + report.cache_bytes
    assert long.decode_peak - short.decode_peak >= long.cache_bytes - short.cache_bytes
    assert "prefill peak" in str(short) and "decode peak" in str(short)


def test_top_k_and_top_p_keep_only_the_likeliest_tokens() -> None:
    logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    keys = jax.vmap(lambda step: row_key(0, step, 0))(jnp.arange(200))

    def drawn(how: Sampling) -> set[int]:
        return set(np.asarray(jax.vmap(lambda k: sample(logits, k, how))(keys)).tolist())

    assert drawn(Sampling(1.0, top_k=2)) == {0, 1}
    assert drawn(Sampling(1.0, top_p=0.9)) == {0, 1, 2}  # 0.5 + 0.3 < 0.9 <= 0.95
    assert drawn(Sampling(1.0)) == {0, 1, 2, 3}


def sampling_distribution(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """One step's sampling distribution written out in NumPy (float64): the logits over
    the temperature, the fewest likeliest tokens whose mass reaches ``top_p``, renormalised."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    kept = np.zeros_like(p, bool)
    kept[order[before < top_p]] = True
    q = np.where(kept, p, 0.0)
    return q / q.sum()


def test_sampling_log_probs_are_the_sampled_distributions(small: Sampler) -> None:
    t = small.programs._model
    out = small.generate(PROMPTS, max_new_tokens=NEW, temperature=0.7, top_p=0.9, seed=3)
    trained = SMALL_TRAINER[0]
    assert trained.model is t
    for r, logits in enumerate(forced_logits(trained, PROMPTS, out.tokens)):
        for step, token in enumerate(out.tokens[r]):
            q = sampling_distribution(logits[step], 0.7, 0.9)
            assert q[token] > 0  # the token was in the kept set
            np.testing.assert_allclose(out.sampling_log_probs[r][step], np.log(q[token]), atol=1e-5)
            kept = q > 0
            want_min = -np.inf if kept.all() else (logits[step][kept] / 0.7).min()
            np.testing.assert_allclose(out.kept_min_logit[r][step], want_min, atol=1e-5)
            raw = logits[step] - logits[step].max()
            raw = raw - np.log(np.exp(raw).sum())
            np.testing.assert_allclose(out.log_probs[r][step], raw[token], atol=1e-5)
    # At temperature 1 with nothing truncated (and greedy), the two are the same numbers.
    for how in ({"temperature": 1.0}, {}):
        plain = small.generate(PROMPTS, max_new_tokens=NEW, **how)
        assert plain.sampling_log_probs == plain.log_probs
        assert all(k == -np.inf for row in plain.kept_min_logit for k in row)
