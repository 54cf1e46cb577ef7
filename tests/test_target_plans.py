"""Issue 55: a plan for TPU chips that are not here, compiled by the real TPU compiler
(libtpu) on this CPU. Small topologies only (v5e:2x2, v5e:2x4): each compile is seconds.
Skipped where libtpu is not installed (``pip install 'nnx-spmd-trainer[tpu-plan]'``)."""

from __future__ import annotations

import importlib.util
import math

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, Plan, TensorParallel
from nnx_spmd_trainer.app.models import GPT, gpt
from nnx_spmd_trainer.planner import target_choice
from nnx_spmd_trainer.planner.target import Target, TargetError, TargetUnavailable

pytest.importorskip("libtpu")

GiB = 2**30


def tiny_gpt(rngs):
    return GPT(
        vocab_size=256, seq_len=32, embed_dim=64, num_heads=4, ff_dim=128, num_layers=1,
        dropout_rate=0.0, rngs=rngs,
    )  # fmt: skip


def tokens(rows):
    shape = jax.ShapeDtypeStruct((rows, 32), jnp.int32)
    return {"inputs": shape, "targets": shape}


class Wide(nnx.Module):
    """One square layer of ``n`` x ``n`` float32: 4 n^2 bytes of weights, and Adam twice that."""

    def __init__(self, n, rngs):
        self.linear = nnx.Linear(n, n, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


def squared_error(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}


def wide_batch(rows, n):
    shape = jax.ShapeDtypeStruct((rows, n), jnp.float32)
    return {"x": shape, "y": shape}


def test_target_names_parse_and_unknown_ones_list_the_known():
    assert Target.parse("v5e-16") == Target("v5e", "4x4")
    assert Target.parse("v5p-128").chips == 64  # Cloud TPU counts v5p's TensorCores
    assert Target.parse("2xv5e-256") == Target("v5e", "16x16", slices=2)
    assert Target.parse("v6e:16x16").chips == 256
    with pytest.raises(TargetError, match=r"no chip 'v9'.*Known targets: v5e-N"):
        Target.parse("v9-8")
    with pytest.raises(TargetError, match=r"v5e comes in 4, 8, 16.*not 12"):
        Target.parse("v5e-12")


def test_state_bytes_per_device_agree_between_eight_cpus_and_a_v5e_target():
    strategy = Hybrid(FSDP(4, min_size=64), TensorParallel(2))
    on_cpu = Plan(tiny_gpt, optax.adam(1e-3), strategy=strategy, loss_fn=gpt.loss_fn)
    on_tpu = Plan(
        tiny_gpt, optax.adam(1e-3), strategy=strategy, loss_fn=gpt.loss_fn, target="v5e:2x4"
    )
    assert dict(on_tpu.mesh.shape) == dict(on_cpu.mesh.shape) == {"fsdp": 4, "model": 2}
    assert on_tpu.mesh.devices.flat[0].platform == "tpu"
    held = {}
    for name, plan in (("cpu", on_cpu), ("tpu", on_tpu)):
        compiled = plan.lower(tokens(8)).compile()
        leaves = jax.tree.leaves(plan.abstract_state)
        shardings = jax.tree.leaves(compiled.input_shardings[0])[: len(leaves)]
        # each compiler's own answer: the shape of every state argument on one device
        held[name] = [
            (s.shard_shape(x.shape), x.dtype.itemsize)
            for x, s in zip(leaves, shardings, strict=True)
        ]
        report = plan.report(tokens(8))
        held[name + " report"] = {
            k: report.bytes_per_device(k) for k in ("parameters", "optimizer", "other")
        }
    assert held["cpu"] == held["tpu"]
    own = sum(math.prod(shape) * itemsize for shape, itemsize in held["tpu"])
    assert held["tpu report"] == held["cpu report"]
    assert sum(held["tpu report"].values()) == own > 0


#: jax's CUDA plugin, which compiles for GPUs that are not here ([gpu-plan], not in [dev]).
GPU_PLAN = importlib.util.find_spec("jax_cuda12_plugin") is not None


def test_h100_names_parse_and_without_the_plugin_the_extra_is_named():
    assert Target.parse("h100-8") == Target("h100", "8")
    assert Target.parse("h100-16") == Target("h100", "8", slices=2)  # hosts of 8
    assert Target.parse("2xh100:8").chips == 16
    with pytest.raises(TargetError, match=r"h100 comes in 1, 2, 4, 8, not 12"):
        Target.parse("h100-12")
    if not GPU_PLAN:
        with pytest.raises(TargetUnavailable, match=r"nnx-spmd-trainer\[gpu-plan\]"):
            Target.parse("h100-8").devices  # noqa: B018


@pytest.mark.skipif(not GPU_PLAN, reason="needs jax's CUDA plugin: [gpu-plan]")
def test_a_plan_for_h100s_is_compiled_by_xlas_gpu_compiler_and_agrees_with_the_cpus():
    strategy = Hybrid(FSDP(4, min_size=64), TensorParallel(2))
    on_gpus = Plan(tiny_gpt, optax.adam(1e-3), strategy=strategy, loss_fn=gpt.loss_fn,
                   target="h100-8")  # fmt: skip
    on_cpus = Plan(tiny_gpt, optax.adam(1e-3), strategy=strategy, loss_fn=gpt.loss_fn)
    (device, *_) = on_gpus.mesh.devices.flat
    assert (device.platform, device.device_kind) == ("gpu", "NVIDIA H100 80GB HBM3")
    gpus, cpus = on_gpus.report(tokens(8)), on_cpus.report(tokens(8))
    assert gpus.fits and gpus.target["chip"] == "h100" and gpus.memory["temporaries"] > 0
    assert "8 h100 chips in 1 host" in str(gpus) and "NVLink" in str(gpus)
    for kind in ("parameters", "optimizer", "other"):
        assert gpus.bytes_per_device(kind) == cpus.bytes_per_device(kind)
    assert gpus.flops == cpus.flops > 0  # the jaxpr's count: the same step on any chip
    assert gpus.target["roofline"]["compute_s"] == pytest.approx(gpus.flops / 989e12)


def test_a_samplers_programs_are_planned_for_a_target():
    """A sampler on a target's plan (the model as the plan's shapes: nothing is built)
    compiles its prefill, decode and one-program call for the chips: their peaks."""
    from nnx_spmd_trainer import Sampler

    strategy = Hybrid(FSDP(2, min_size=64), TensorParallel(2))
    plan = Plan(tiny_gpt, optax.adam(1e-3), strategy=strategy, loss_fn=gpt.loss_fn,
                target="v5e:2x2")  # fmt: skip
    model = nnx.merge(plan.graphdef, plan.state_targets())["model"]
    memory = Sampler(model, plan, print_fn=None).memory([[1, 2, 3]] * 4, max_new_tokens=8)
    assert (memory.rows, memory.columns, memory.length) == (4, 16, 32)
    for peak in (memory.prefill_peak, memory.decode_peak, memory.call_peak):
        assert peak is not None and peak >= memory.cache_bytes + memory.state_bytes > 0


def test_an_axis_that_is_no_product_of_whole_torus_axes_is_laid_along_a_split_one():
    """v6e:4x4 has physical axes 4 and 4: an 8-way FSDP axis is no product of them, which
    ``jax.make_mesh`` refuses off v5e; the mesh splits a physical axis instead, every
    chip once, and the plan compiles."""
    strategy = Hybrid(FSDP(8, min_size=64), TensorParallel(2))
    plan = Plan(tiny_gpt, optax.adam(1e-3), strategy=strategy, loss_fn=gpt.loss_fn,
                target="v6e:4x4")  # fmt: skip
    assert dict(plan.mesh.shape) == {"fsdp": 8, "model": 2}
    chips = plan.mesh.devices.flat
    assert len({d.id for d in chips}) == 16 and chips[0].platform == "tpu"
    assert plan.report(tokens(16)).fits


@pytest.fixture(scope="module")
def wide_choice():
    """``auto`` on v5e:2x2 between replicating a 4 GiB layer (with Adam's 8 GiB and the
    gradients: over a chip's 16 GiB, so the compiler refuses) and sharding it (FSDP)."""
    n = 32768
    return target_choice.choose(
        lambda rngs: Wide(n, rngs), optax.adam(1e-3), wide_batch(8, n),
        loss_fn=squared_error, devices=Target.parse("v5e:2x2").devices,
        strategies=[DataParallel(), FSDP()], target="v5e:2x2",
    )  # fmt: skip


def test_a_compiler_refusal_is_a_report_that_does_not_fit_with_its_bytes(wide_choice):
    refused = next(row.report for row in wide_choice.rows if row.layout == "DataParallel()")
    assert refused.fits is False
    assert refused.verdict.startswith("does not fit: the compiler refused")
    # the compiler's own figures: what it needed against the HBM it had (15.75 of 16 GiB)
    assert 15 * GiB < refused.budget_bytes <= 16 * GiB
    assert refused.memory["peak"] > refused.budget_bytes
    # at least the replicated weights and Adam's two moments the plan lays out
    assert refused.memory["peak"] >= sum(r["bytes_per_device"] for r in refused.leaves)
    assert refused.target["chip"] == "v5e" and refused.target["hbm_bytes"] == 16 * GiB
    assert "does not fit" in str(refused)


def test_a_plan_that_fits_reports_the_chip_the_links_and_the_roofline():
    plan = Plan(
        tiny_gpt, optax.adam(1e-3), strategy=Hybrid(DataParallel(2), FSDP(4, min_size=64)),
        loss_fn=gpt.loss_fn, target="2xv5e:2x2",
    )  # fmt: skip
    report = plan.report(tokens(8))
    target = report.target
    assert report.fits is True and report.budget_bytes == 16 * GiB
    assert target["chips"] == 8 and target["slices"] == 2
    # the data axis spans the slices: the gradients cross the data-centre network
    assert target["links"]["dcn"]["count"] > 0 and target["links"]["dcn"]["bytes"] > 0
    assert target["links"]["ici"]["count"] > 0
    times = target["roofline"]
    assert times["bound_s"] == max(
        times["compute_s"], times["hbm_s"], times["ici_s"], times["dcn_s"]
    )
    assert times["compute_s"] == pytest.approx(report.flops / 197e12)
    assert 0 < times["mfu"] <= 1 and report.step_time_bound_s == times["bound_s"]
    assert "across slices (DCN)" in str(report)


def test_auto_picks_a_layout_that_fits_where_the_default_does_not(wide_choice):
    rows = {row.layout: row for row in wide_choice.rows}
    assert rows["DataParallel()"].status == "does not fit"
    assert wide_choice.strategy == FSDP() and wide_choice.chosen.status == "bounded"
    assert wide_choice.report.fits is True and wide_choice.chosen.peak_bytes < 16 * GiB
    # FSDP over 4 chips holds a quarter of the weights and of Adam's moments (and counts)
    assert 0 <= wide_choice.chosen.state_bytes - 3 * 4 * 32768**2 // 4 < 64
    assert "ranked by the roofline" in wide_choice.table()


def test_largest_batch_doubles_then_bisects():
    n = 1024  # 4 MiB of weights; within 64 MiB a chip, the rows' activations decide
    plan = Plan(
        lambda rngs: Wide(n, rngs), optax.sgd(1e-3), strategy=FSDP(), loss_fn=squared_error,
        target="v5e:2x2",
    )  # fmt: skip
    step = 8192
    found = target_choice.largest_batch(
        plan, lambda rows: wide_batch(rows, n), start=step, step=step, memory_budget_bytes=64 << 20
    )
    fits = {rows: ok for rows, ok, _ in found.compiles}
    tried = [rows for rows, _, _ in found.compiles]
    doubled = [r for r in tried if r & (r - 1) == 0]
    assert tried[: len(doubled)] == [step * 2**k for k in range(len(doubled))]
    assert fits[found.rows] and found.report is not None and found.report.fits
    assert not any(ok for rows, ok in fits.items() if rows > found.rows)
    assert min(rows for rows, ok in fits.items() if not ok) - found.rows == step
    # the peak grows with the rows: what fits is below the budget, what does not above
    assert all((peak <= 64 << 20) == ok for _, ok, peak in found.compiles)
    assert found.lines()[0].startswith(f"largest global batch that fits: {found.rows} rows")


# -- the command line: --dry_run --config.target -----------------------------------------
def _cli(*args, cwd):
    import subprocess
    import sys

    from conftest import environment_for_own_devices

    return subprocess.run(
        [sys.executable, "-m", "nnx_spmd_trainer", "--workdir=out", "--dry_run", *args],
        cwd=cwd, env=environment_for_own_devices(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip


SMALL_GPT = ("--config.gpt.seq_len=16", "--config.batch_size=16", "--config.gpt.num_heads=8")


@pytest.mark.serial
def test_cli_dry_run_for_a_target_the_compiler_refuses_exits_0(tmp_path):
    # 6 layers 4096 wide, replicated: 4.5 GiB of weights and 9 of Adam on each chip, and more
    proc = _cli(
        "--config.target=v5e:2x2", "--config.strategy=data", "--config.gpt.embed_dim=4096",
        "--config.gpt.ff_dim=16384", "--config.gpt.num_layers=6", *SMALL_GPT, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "planning for v5e:2x2: 4 v5e chips (not here)" in proc.stdout
    (verdict,) = [line for line in proc.stdout.splitlines() if "does not fit" in line]
    assert "the compiler refused" in verdict and "GiB of HBM available per chip" in verdict
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


@pytest.mark.serial
def test_cli_target_refusals_name_the_key(tmp_path):
    unknown = _cli("--config.target=v9-8", *SMALL_GPT, cwd=tmp_path)
    assert unknown.returncode == 2
    assert "config.target='v9-8'" in unknown.stderr and "Known targets: v5e-N" in unknown.stderr
    # a vocabulary a 2-way model axis does not divide: the sharding error, and the padding
    odd = _cli(
        "--config.target=v5e:2x2", "--config.strategy=fsdp=2,model=2",
        "--config.gpt.vocab_size=50257", *SMALL_GPT, cwd=tmp_path,
    )  # fmt: skip
    assert odd.returncode == 2, odd.stdout[-2000:] + odd.stderr[-2000:]
    assert "--config.gpt.vocab_size=50304" in odd.stderr


def test_a_scanned_stacks_collectives_count_once_per_layer_as_the_unrolled_ones():
    """The TPU compiler's text holds the layer loop's body once and writes no trip count:
    the report reads it from the loop's condition (``counter < 4``). The same GPT with its
    4 layers unrolled (no loop) is the independent count: the scanned step moves about as
    many bytes (before, a quarter of the layers' all-gathers were counted: 30%)."""

    def report(scan_layers):
        def build(rngs):
            return GPT(
                vocab_size=256, seq_len=32, embed_dim=64, num_heads=4, ff_dim=128,
                num_layers=4, dropout_rate=0.0, rngs=rngs, scan_layers=scan_layers,
            )  # fmt: skip

        plan = Plan(build, optax.adam(1e-3), strategy=FSDP(4, min_size=64),
                    loss_fn=gpt.loss_fn, target="v5e:2x2")  # fmt: skip
        return plan.report(tokens(8))

    scanned, unrolled = report(True), report(False)
    ici = scanned.target["links"]["ici"]["bytes"] / unrolled.target["links"]["ici"]["bytes"]
    assert 0.85 < ici < 1.15, ici
    # The gradients' reduction: the same bytes, in 4 reductions a step or merged into fewer.
    reduced = (r.collectives["all-reduce"]["bytes"] for r in (scanned, unrolled))
    assert math.isclose(*reduced, rel_tol=0.01)
