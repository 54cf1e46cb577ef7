"""LoRA (issue 47): adapters added by ``Trainer(lora=LoRA(...))`` train alone, under each
strategy, to what a one-device loop in plain JAX + optax gives (its own ``W x + alpha/r *
x A B``, from the same base and the same initial adapters); the base stays bitwise; every
adapter is laid out from its base kernel; merged outputs equal adapted ones; bad input
is refused in one line."""

from __future__ import annotations

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
from nnx_spmd_trainer.app.models import GPT
from nnx_spmd_trainer.nn import lora
from nnx_spmd_trainer.nn.lora import LoRA

VOCAB, SEQ, ROWS, STEPS = 32, 8, 16, 5
SIZES = dict(vocab_size=VOCAB, seq_len=SEQ, embed_dim=32, num_heads=8, ff_dim=64, num_layers=2)
TARGETS = r".*mha/(query|value|out)|.*linear1"
CONFIG = LoRA(rank=4, alpha=8.0, targets=TARGETS)


def dense(rngs):
    return GPT(**SIZES, dropout_rate=0.0, rngs=rngs)


def scanned(rngs):
    return GPT(**SIZES, dropout_rate=0.0, rngs=rngs, scan_layers=True)


def mixture(rngs):
    return GPT(**SIZES, dropout_rate=0.0, rngs=rngs, moe_experts=4, moe_every=2)


CASES = {
    "dp": (dense, lambda: DataParallel()),
    "fsdp": (dense, lambda: FSDP(min_size=1)),
    "tp": (dense, lambda: TensorParallel(8)),
    "fsdp_x_tp": (dense, lambda: Hybrid(FSDP(4, min_size=1), TensorParallel(2))),
    "dp_x_seq": (dense, lambda: Hybrid(DataParallel(2), SequenceParallel(4))),
    "stage2_x_dp": (scanned, lambda: Hybrid(PipelineParallel(2), DataParallel(4))),
    "dp_x_ep": (mixture, lambda: Hybrid(DataParallel(2), ExpertParallel(4))),
}


def xent(model, batch):
    logits = model(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean(), {}


def token_batches(n, seed=0):
    rng = np.random.default_rng(seed)
    windows = [rng.integers(0, VOCAB, size=(ROWS, SEQ + 1), dtype=np.int32) for _ in range(n)]
    return [{"inputs": w[:, :-1], "targets": w[:, 1:]} for w in windows]


def host(state):
    return {
        "/".join(map(str, p)): np.asarray(jax.device_get(v.get_value()))
        for p, v in nnx.to_flat_state(state)
    }


# -- the one-device reference: its own adapters around the base layers --------------------
class Delta(nnx.Variable):
    """The reference's adapter arrays (not a Param: nothing else trains)."""


class RefAdapted(nnx.Module):
    """``base(x) + scale * (x A) B``, A contracting x's trailing dimensions."""

    def __init__(self, base, a, b, scale):
        self.base, self.scale = base, scale
        self.a, self.b = Delta(jnp.asarray(a)), Delta(jnp.asarray(b))

    def __call__(self, x, **kwargs):
        a, b = self.a[...], self.b[...]
        h = jnp.tensordot(x, a, axes=a.ndim - 1)
        return self.base(x, **kwargs) + self.scale * jnp.tensordot(h, b, axes=1)


def _owner(model, path):
    *parents, name = path.split("/")
    for part in parents:
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model, name


def reference(factory, start, batches, lr=0.1):
    """Adapters trained by plain optax SGD on one device from the trainer's start."""
    with nnx.use_eager_sharding(False):
        model = factory(nnx.Rngs(123))
    base = {k: v for k, v in start.items() if not k.endswith(("lora_a", "lora_b"))}
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    for path, variable in flat:
        variable.set_value(jnp.asarray(base["/".join(map(str, path))]))
    for kernel in sorted(k for k in start if k.endswith("lora_a")):
        layer = kernel.rsplit("/", 1)[0]
        owner, name = _owner(model, layer)
        wrapped = RefAdapted(getattr(owner, name), start[f"{layer}/lora_a"],
                             start[f"{layer}/lora_b"], CONFIG.alpha / CONFIG.rank)  # fmt: skip
        setattr(owner, name, wrapped)
    optimizer = nnx.Optimizer(model, optax.sgd(lr, momentum=0.9), wrt=Delta)

    @nnx.jit
    def step(model, optimizer, batch):
        def loss(m):
            return xent(m, batch)[0]

        value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, Delta))(model)
        optimizer.update(model, grads)
        return value

    losses = [float(step(model, optimizer, batch)) for batch in batches]
    deltas = nnx.state(model, Delta)
    return losses, {f"{k[:-2]}/lora_{k[-1]}": v for k, v in host(deltas).items()}


@pytest.fixture(scope="module", params=list(CASES))
def trained(request):
    factory, strategy = CASES[request.param]
    trainer = Trainer(
        factory,
        optax.sgd(0.1, momentum=0.9),
        strategy=strategy(),
        loss_fn=xent,
        lora=CONFIG,
        log_every_n_steps=1,
        track_norms=False,
    )
    start = host(nnx.state(trainer.model, nnx.Param))
    batches = token_batches(STEPS)
    history = trainer.fit(batches, max_steps=STEPS)
    return request.param, factory, trainer, start, batches, history.history["train/loss"]


def test_lora_trains_as_a_one_device_loop_and_leaves_the_base_bitwise(trained):
    name, factory, trainer, start, batches, losses = trained
    assert trainer.plan.wrt is nnx.LoRAParam
    after = host(nnx.state(trainer.model, nnx.Param))
    adapters = [k for k in after if k.endswith(("lora_a", "lora_b"))]
    expected = {scanned: 8, mixture: 14}.get(factory, 16)  # the MoE block has no linear1
    assert len(adapters) == expected, adapters
    for key, value in after.items():
        if key not in adapters:
            assert np.array_equal(value, start[key]), key  # the base: bitwise
    ref_losses, ref_adapters = reference(factory, start, batches)
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5)
    for key in adapters:
        np.testing.assert_allclose(after[key], ref_adapters[key], atol=1e-5, err_msg=key)
    assert not np.allclose(after[adapters[1]], start[adapters[1]])  # B moved from zero


def _padded(spec, ndim):
    return (*tuple(spec), *([None] * (ndim - len(tuple(spec)))))


def test_every_adapter_is_split_as_its_base_kernel(trained):
    name, factory, trainer, *_ = trained
    lead = 1 if factory is scanned else 0
    specs = {}
    for path, layer in lora.adapted_layers(trainer.model).items():
        kernel = layer.kernel.get_value()
        base = _padded(kernel.sharding.spec, kernel.ndim)
        a, b = layer.lora_a.get_value(), layer.lora_b.get_value()
        n_in = a.ndim - lead - 1
        assert _padded(a.sharding.spec, a.ndim) == (*base[: lead + n_in], None), path
        assert _padded(b.sharding.spec, b.ndim) == (*base[:lead], None, *base[lead + n_in :]), path
        specs[f"{path}/lora_a"], specs[f"{path}/lora_b"] = a.sharding.spec, b.sharding.spec
    # The optimizer holds adapters alone, each laid out as its adapter.
    moments = nnx.to_flat_state(nnx.state(trainer.optimizer))
    held = [(p, v.get_value()) for p, v in moments if np.ndim(v.get_value())]
    assert held and all(p[-1] in ("lora_a", "lora_b") for p, _ in held)
    for path, value in held:
        owner = next(k for k in specs if "/".join(map(str, path)).endswith(k))
        assert _padded(value.sharding.spec, value.ndim) == _padded(specs[owner], value.ndim), path
    if name in ("fsdp", "tp", "fsdp_x_tp", "stage2_x_dp"):  # those that split the bases
        assert any(any(e is not None for e in s) for s in specs.values()), specs


def test_merged_outputs_equal_adapted_outputs(trained):
    name, factory, trainer, _, batches, _ = trained
    if name not in ("dp", "stage2_x_dp"):
        pytest.skip("one dense and one stacked model suffice")
    model = trainer.model
    model.eval()
    tokens = batches[0]["inputs"]
    adapted = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))
    merged = lora.merge(nnx.clone(model))
    assert not lora.adapted_layers(merged) and not nnx.state(merged, nnx.LoRAParam)
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, t: m(t))(merged, tokens)), adapted,
                               atol=1e-5)  # fmt: skip


class Mixed(nnx.Module):
    """A user's layers: an ``nnx.Einsum`` into heads and an ``nnx.Linear`` back."""

    def __init__(self, rngs):
        self.proj = nnx.Einsum("btd,dnh->btnh", (8, 2, 4), rngs=rngs)
        self.out = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return self.out(self.proj(x).reshape(*x.shape[:2], 8))


def test_a_users_einsum_and_linear_compute_w_x_plus_scaled_x_a_b_and_merge():
    with nnx.use_eager_sharding(False):
        model = Mixed(nnx.Rngs(0))
        config = LoRA(rank=2, alpha=6.0, targets=["proj", "out"])
        lora.apply(model, config, rngs=nnx.Rngs(1))
    for layer in (model.proj, model.out):  # B away from zero: the update shows
        layer.lora_b.set_value(jax.random.normal(jax.random.key(2), layer.lora_b.shape))
    x = jax.random.normal(jax.random.key(3), (2, 3, 8))
    a, b = model.proj.lora_a[...], model.proj.lora_b[...]
    w = model.proj.kernel[...]
    heads = jnp.einsum("btd,dnh->btnh", x, w) + 3.0 * jnp.einsum("btr,rnh->btnh", x @ a, b)
    flat = heads.reshape(2, 3, 8)
    o = model.out
    want = flat @ o.kernel[...] + o.bias[...] + 3.0 * (flat @ o.lora_a[...]) @ o.lora_b[...]
    np.testing.assert_allclose(model(x), want, atol=1e-5)
    merged = lora.merge(nnx.clone(model))
    assert type(merged.proj) is nnx.Einsum and type(merged.out) is nnx.Linear
    np.testing.assert_allclose(merged(x), want, atol=1e-5)


@pytest.mark.parametrize(
    "config, message",
    [
        (
            LoRA(rank=2, targets="blocks/0/mha/qery"),
            r"matches no .* closest layer paths: blocks/0/mha/query",
        ),
        (
            LoRA(rank=2, targets=[".*linear1", "blocks/0/lnorm"]),
            r"targets='blocks/0/lnorm'\) matches no",
        ),
        (
            LoRA(rank=40, targets=".*linear1"),
            r"blocks/0/linear1 \(Linear\) has 32 input .* rank <= 32",
        ),
        (LoRA(rank=2, targets=".*layer_norm1"), r"matches no Linear, LinearGeneral or Einsum"),
    ],
)
def test_bad_targets_and_ranks_are_refused_in_one_line(config, message):
    with nnx.use_eager_sharding(False):
        model = dense(nnx.Rngs(0))
    with pytest.raises(ValueError, match=message) as error:
        lora.apply(model, config)
    assert "\n" not in str(error.value)
    assert not lora.adapted_layers(model)  # nothing changed


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank=0, targets="x"), r"rank must be an integer >= 1"),
        (dict(rank=2, targets="(x"), r"is not a regex"),
        (dict(rank=2, targets=[]), r"give a regex over layer paths"),
        (dict(rank=2, targets="x", dropout=1.0), r"rate in \[0, 1\)"),
    ],
)
def test_a_bad_lora_is_refused_when_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRA(**kwargs)


def test_the_plan_report_counts_the_adapters_optimizer_bytes_and_full_fine_tunings():
    """``Plan.report`` (what ``--dry_run`` prints): Adam holds two copies (mu, nu) of each
    adapter, split as the adapter is; full fine-tuning would hold them of the whole base."""
    from nnx_spmd_trainer import Plan

    batch = {k: jax.ShapeDtypeStruct((ROWS, SEQ), np.int32) for k in ("inputs", "targets")}

    def report(**lora_kwargs):
        plan = Plan(dense, optax.adam(1e-3), strategy=FSDP(8, min_size=1), loss_fn=xent,
                    **lora_kwargs)  # fmt: skip
        return plan.report(batch)

    adapted = report(lora=LoRA(rank=2, targets=r".*mha/(query|value)"))
    rows = {row["path"]: row for row in adapted.leaves}
    # The precondition of the count below: FSDP splits q and v's input dimension 8 ways.
    assert rows["model/blocks/0/mha/query/kernel"]["spec"] == "P('fsdp',)"
    d, heads, head_dim, r = SIZES["embed_dim"], 8, SIZES["embed_dim"] // 8, 2
    per_adapter = d * r // 8 + r * heads * head_dim  # A split like the input, B whole
    adapters = SIZES["num_layers"] * 2 * per_adapter  # 2 layers x (query, value)
    scalars = sum(
        row["bytes_per_device"]
        for row in adapted.leaves
        if row["kind"] == "optimizer" and not row["shape"]
    )  # Adam's count, the step
    split = adapted.training
    assert split["trainable_bytes"] == 4 * adapters
    assert split["trainable_parameters"] == SIZES["num_layers"] * 2 * (d * r + r * d)
    assert split["optimizer_bytes"] == 2 * 4 * adapters + scalars
    assert split["optimizer_copies"] == 2

    whole = report()
    full = whole.bytes_per_device("optimizer")
    assert split["full_optimizer_bytes"] == full and split["optimizer_bytes"] < full / 8
    assert split["frozen_parameters"] + split["trainable_parameters"] == sum(
        np.prod(row["shape"]) for row in adapted.leaves if row["kind"] == "parameters"
        and row["path"].endswith(("kernel", "bias", "scale", "embedding", "lora_a", "lora_b"))
    )  # fmt: skip
    text = str(adapted)
    assert "trainable: 512 parameters" in text and "2 copies of each trainable" in text
    assert "full fine-tuning would hold about" in text
    assert "trainable:" not in str(whole)  # a run where everything trains: as before


def test_weights_merged_params_folds_any_adapted_kernel_as_merge_does():
    """``weights.merged_params`` folds ``nn.lora``'s layers through ``lora.merge`` (on a
    copy): GPT's ``[d, heads, head_dim]`` query kernels too (a plain ``a @ b`` cannot), at
    each layer's own ``alpha / rank`` unless a ``scale`` is given; the model is unchanged."""
    from nnx_spmd_trainer import weights

    with nnx.use_eager_sharding(False):
        model = dense(nnx.Rngs(0))
        lora.apply(model, LoRA(rank=2, alpha=6.0, targets=r".*mha/query"), rngs=nnx.Rngs(1))
    query = model.blocks[0].mha.query
    query.lora_b.set_value(jax.random.normal(jax.random.key(2), query.lora_b.shape))
    w, a, b = (np.asarray(v[...]) for v in (query.kernel, query.lora_a, query.lora_b))
    want = w + 3.0 * np.tensordot(a, b, axes=1)  # alpha / rank = 3, by hand

    merged = weights.merged_params(model)
    np.testing.assert_allclose(merged["blocks/0/mha/query/kernel"], want, rtol=1e-6, atol=1e-6)
    assert not any(k.endswith(("lora_a", "lora_b")) for k in merged)
    folded = lora.merge(nnx.clone(model))
    flat = {"/".join(map(str, p)): v.get_value() for p, v in
            nnx.to_flat_state(nnx.state(folded, nnx.Param))}  # fmt: skip
    assert merged.keys() == flat.keys()
    for key, value in flat.items():
        np.testing.assert_array_equal(merged[key], value, err_msg=key)
    with pytest.raises(ValueError, match=r"blocks/0/mha/query holds adapters of scale 3.0"):
        weights.merged_params(model, scale=1.0)  # it would not compute what the model did
    assert lora.adapted_layers(model) and query.lora_scale == 3.0  # the model untouched


def test_merged_params_folds_each_layer_at_its_own_scale():
    """Layers adapted by two ``LoRA`` s of different ``alpha / rank`` are each folded at
    their own (``merged_params`` once overwrote every layer's with one scale), checked
    against ``W + alpha / rank * A B`` by hand and against the adapted model's output."""
    from nnx_spmd_trainer import weights

    with nnx.use_eager_sharding(False):
        model = nnx.Sequential(
            nnx.Linear(6, 5, rngs=nnx.Rngs(0)), nnx.Linear(5, 4, rngs=nnx.Rngs(1))
        )
        lora.apply(model, LoRA(rank=2, alpha=1.0, targets="layers/0"), rngs=nnx.Rngs(2))
        lora.apply(model, LoRA(rank=3, alpha=12.0, targets="layers/1"), rngs=nnx.Rngs(3))
    for i, layer in enumerate(model.layers):
        layer.lora_b.set_value(jax.random.normal(jax.random.key(10 + i), layer.lora_b.shape))
    merged = weights.merged_params(model)
    for i, scale in enumerate((0.5, 4.0)):
        layer = model.layers[i]
        w, a, b = (
            np.asarray(v[...], np.float64) for v in (layer.kernel, layer.lora_a, layer.lora_b)
        )
        np.testing.assert_allclose(
            merged[f"layers/{i}/kernel"], w + scale * a @ b, rtol=1e-5, atol=1e-6
        )
    x = np.asarray(jax.random.normal(jax.random.key(9), (3, 6)), np.float64)
    h = x @ merged["layers/0/kernel"] + merged["layers/0/bias"]
    plain = h @ merged["layers/1/kernel"] + merged["layers/1/bias"]
    np.testing.assert_allclose(
        plain, np.asarray(model(jnp.asarray(x, jnp.float32))), rtol=1e-4, atol=1e-5
    )
