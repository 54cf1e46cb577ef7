"""Speed you can see: the compiled step's FLOPs against the transformer formula, the peak
table, and tokens/s, FLOP/s and MFU in a run's logs and in the job's last lines."""

import csv
import importlib
import logging

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from nnx_spmd_trainer import DataParallel, Plan, Trainer
from nnx_spmd_trainer.app import job, tasks
from nnx_spmd_trainer.app.models import GPT, gpt
from nnx_spmd_trainer.engine.speed import Speed
from nnx_spmd_trainer.planner import flops

# A GPT whose step is mostly its matmuls: 2048 tokens a step, so the optimizer's update,
# the norms and the softmaxes are ~2% of the FLOPs.
SIZE = {"num_layers": 2, "embed_dim": 128, "ff_dim": 512, "seq_len": 64, "vocab_size": 1024}
ROWS = 32


def formula_gpt(rngs):
    return GPT(
        vocab_size=SIZE["vocab_size"], seq_len=SIZE["seq_len"], embed_dim=SIZE["embed_dim"],
        num_heads=8, ff_dim=SIZE["ff_dim"], num_layers=SIZE["num_layers"], dropout_rate=0.0,
        rngs=rngs,
    )  # fmt: skip


def token_batch(rows, seq_len, vocab):
    window = np.random.default_rng(0).integers(0, vocab, size=(rows, seq_len + 1), dtype=np.int32)
    return {"inputs": window[:, :-1], "targets": window[:, 1:]}


def matmul_parameters(model) -> int:
    """The test's own count of N: every kernel multiplied by the activations (attention's
    query/key/value/output, the feed-forward pair, the head), not the embedding tables."""
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return sum(
        int(np.prod(leaf.get_value().shape)) for path, leaf in params if path[-1] == "kernel"
    )


def test_the_compiled_gpt_step_counts_the_formulas_flops_within_5_percent():
    plan = Plan(formula_gpt, optax.adamw(1e-3), loss_fn=gpt.loss_fn,
                strategy=DataParallel(), devices=jax.devices()[:1])  # fmt: skip
    batch = token_batch(ROWS, SIZE["seq_len"], SIZE["vocab_size"])
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    compiled_flops = plan.report(shapes).flops  # one device: the whole step
    tokens = ROWS * SIZE["seq_len"]

    with nnx.use_eager_sharding(False):
        n = matmul_parameters(formula_gpt(nnx.Rngs(0)))
    layers, width, seq = SIZE["num_layers"], SIZE["embed_dim"], SIZE["seq_len"]
    assert n == layers * (4 * width**2 + 2 * width * SIZE["ff_dim"]) + width * SIZE["vocab_size"]
    full = flops.transformer_flops_per_token(**SIZE)
    assert full == 6 * n + 12 * layers * seq * width
    assert compiled_flops / (full * tokens) == pytest.approx(1.0, abs=0.05)
    # XLA multiplies the masked half of the causal scores too: the full T x T count is the
    # one it runs, the causal half (and no attention term at all) are further off.
    causal = flops.transformer_flops_per_token(**SIZE, causal_skip=True)
    assert abs(compiled_flops / (causal * tokens) - 1) > abs(compiled_flops / (full * tokens) - 1)
    assert abs(compiled_flops / (6 * n * tokens) - 1) > 0.05


def test_scanned_layers_and_a_chunked_loss_count_every_layer_and_chunk():
    """XLA's cost analysis counts a loop's body once: a scanned stack of layers reads as
    one layer, a chunked loss as one chunk. The report's FLOPs are the step's matrix
    multiplies counted from its jaxpr, so scanning changes nothing, and both equal the
    formula; the compiled program's own count of the scanned step is lower."""
    batch = token_batch(ROWS, SIZE["seq_len"], SIZE["vocab_size"])
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    full = flops.transformer_flops_per_token(**SIZE) * ROWS * SIZE["seq_len"]
    counted = {}
    for scan in (False, True):
        def build(rngs, scan=scan):
            return GPT(
                vocab_size=SIZE["vocab_size"], seq_len=SIZE["seq_len"],
                embed_dim=SIZE["embed_dim"], num_heads=8, ff_dim=SIZE["ff_dim"],
                num_layers=SIZE["num_layers"], dropout_rate=0.0, rngs=rngs, scan_layers=scan,
            )  # fmt: skip

        plan = Plan(build, optax.adamw(1e-3), loss_fn=gpt.loss_fn, strategy=DataParallel(),
                    devices=jax.devices()[:1])  # fmt: skip
        counted[scan] = plan.report(shapes).flops
        if scan:  # the compiler's count: the scanned body once
            compiled = flops.cost_flops(plan.lower(shapes).compile())
            assert compiled < 0.8 * counted[scan]
    assert counted[True] == pytest.approx(counted[False], rel=1e-9)
    assert counted[False] / full == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize(
    "kind, name",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA A100-SXM4-40GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA B200", "B200"),
        ("TPU v4", "TPU v4"),
        ("TPU v5 lite", "TPU v5e"),
        ("TPU v5e", "TPU v5e"),
        ("TPU v5", "TPU v5p"),
        ("TPU v5p", "TPU v5p"),
        ("TPU v6 lite", "TPU v6e"),
        ("tpu_v6e", "TPU v6e"),
        # not in the table: no peak, so no MFU
        ("TPU v4 lite", None),
        ("TPU7x", None),
        ("NVIDIA GeForce RTX 4090", None),
        ("NVIDIA L4", None),
        ("cpu", None),
        ("Interpreter", None),
    ],
)
def test_the_peak_table_reads_device_kinds(kind, name):
    assert flops.device_name(kind) == name
    if name is None:
        assert flops.peak_flops(kind) is None and flops.peak_flops(kind, "fp32") is None
    else:
        assert flops.peak_flops(kind) == flops.PEAK_FLOPS[name]["bf16"]
        assert flops.peak_flops(kind, "float32") == flops.PEAK_FLOPS[name]["fp32"]


def test_the_table_holds_dense_peaks_not_the_sparsity_figures():
    # The datasheets' first figures are with 2:4 sparsity (H100 SXM: 1,979 TFLOPS bf16).
    assert flops.PEAK_FLOPS["H100 SXM"]["bf16"] == pytest.approx(1979e12 / 2, rel=1e-3)
    assert flops.PEAK_FLOPS["A100"]["bf16"] == 312e12
    assert all(peaks["fp32"] <= peaks["bf16"] < 2.5e15 for peaks in flops.PEAK_FLOPS.values())


def test_bad_settings_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        flops.peak_flops("NVIDIA H100 PCIe", "int4")
    for bad in (0.0, -1.0, float("nan"), "989e12"):
        with pytest.raises(ValueError, match="peak_flops=.*positive number"):
            Speed(peak_flops=bad)
    config = importlib.import_module("nnx_spmd_trainer.configs.default").get_config()
    config.peak_flops = -1.0
    with pytest.raises(tasks.ConfigError, match=r"config.peak_flops=-1.0: must be a finite"):
        tasks.check_config(config)


def test_a_step_without_tokens_or_flops_leaves_its_rate_out():
    speed = Speed(peak_flops=1e9)
    speed.add_step(tokens=None, flops=1e6)
    speed.add_step(tokens=100, flops=None)
    assert speed.read(seconds=1.0) == {}
    speed.add_step(tokens=100, flops=1e6)  # the next interval starts afresh
    assert speed.read(seconds=2.0) == {
        "perf/tokens_per_s": 50.0,
        "perf/flops_per_s_per_device": 5e5,
        "perf/mfu": 5e-4,
    }


def small_gpt(rngs):
    return GPT(vocab_size=64, seq_len=16, embed_dim=32, num_heads=4, ff_dim=64, num_layers=1,
               dropout_rate=0.0, rngs=rngs)  # fmt: skip


def test_on_the_cpu_a_run_logs_tokens_and_flops_per_second_and_no_mfu_saying_why_once(caplog):
    batch = token_batch(16, 16, 64)
    # No norms: one compiled step, the one the report below reads again.
    trainer = Trainer(small_gpt, optax.adamw(1e-3), loss_fn=gpt.loss_fn, log_every_n_steps=2,
                      track_norms=False)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="nnx_spmd_trainer.engine.speed"):
        history = trainer.fit([batch] * 6, max_steps=6).history
    assert "perf/mfu" not in history
    tokens, per_device = history["perf/tokens_per_s"], history["perf/flops_per_s_per_device"]
    assert len(tokens) == len(per_device) == 3 and min(tokens) > 0
    (note,) = [r.getMessage() for r in caplog.records if "perf/mfu" in r.getMessage()]
    assert "device kind 'cpu'" in note and "peak_flops" in note
    assert trainer.run.timings.speed.note == note
    # The time cancels: tokens over FLOPs per device is the batch's tokens over what the
    # compiled step (the plan's report of it) costs a device.
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    step_flops = trainer.plan.report(shapes, train_step=trainer.train_step).flops
    np.testing.assert_allclose(np.divide(tokens, per_device), 16 * 16 / step_flops, rtol=1e-6)
    # The job's last line: tokens/s and FLOP/s still show, and why there is no MFU.
    line = job.speed_line(history, trainer.run.timings.speed.note)
    assert "tokens/s" in line and "TFLOP/s per device" in line and "MFU" not in line
    assert line.endswith(note)


def shrunk_default_job(peak_flops: float):
    config = importlib.import_module("nnx_spmd_trainer.configs.default").get_config()
    config.update(max_steps=4, batch_size=16, log_every_n_steps=2, eval_every_n_steps=0,
                  max_eval_batches=1, checkpoint_every_n_steps=0)  # fmt: skip
    config.peak_flops = peak_flops
    config.gpt.update(seq_len=16, embed_dim=32, num_heads=8, ff_dim=64, num_layers=1)
    return config


def test_peak_flops_in_the_config_gives_mfu_as_flops_per_second_over_it(tmp_path, capsys):
    peak = 2e9  # --config.peak_flops=2e9
    job.run(shrunk_default_job(peak), tmp_path)
    with open(tmp_path / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("perf/flops_per_s_per_device")]
    assert [int(row["step"]) for row in rows] == [2, 4]
    per_device = np.array([float(row["perf/flops_per_s_per_device"]) for row in rows])
    assert np.all(per_device > 0) and all(float(row["perf/tokens_per_s"]) > 0 for row in rows)
    mfu = np.array([float(row["perf/mfu"]) for row in rows])
    np.testing.assert_allclose(mfu, per_device / peak, rtol=1e-6)
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("speed")]
    assert "tokens/s" in line and "TFLOP/s per device" in line and "MFU" in line


def test_the_dry_run_prints_the_steps_flops(tmp_path, capsys):
    job.run(shrunk_default_job(0.0), tmp_path, dry_run=True)
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if "FLOPs" in ln]
    per_device = float(line.split("per step and device:")[1].split()[0])
    assert per_device > 0 and "on 8 devices" in line
