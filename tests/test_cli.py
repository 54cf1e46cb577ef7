"""The command line: strategy specs, argv, device setup, optimizer, every config end to end."""

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import environment_for_own_devices

from nnx_spmd_trainer import FSDP, DataParallel, Hybrid, TensorParallel
from nnx_spmd_trainer.app import host_devices, job, tasks
from nnx_spmd_trainer.app.command_line import CONFIGS_DIR, normalize_argv

CONFIG_NAMES = sorted(p.stem for p in CONFIGS_DIR.glob("*.py") if not p.name.startswith("_"))
REQUIRED_KEYS = (
    "max_steps", "batch_size", "seed", "strategy", "log_every_n_steps",
    "eval_every_n_steps", "learning_rate", "grad_accum_steps",
)  # fmt: skip


def load(name):
    return importlib.import_module(f"nnx_spmd_trainer.configs.{name}").get_config()


def shrink(config):
    """The smallest sizes every strategy in configs/ still divides."""
    config.max_steps = 2
    config.batch_size = 16
    config.log_every_n_steps = 1
    config.eval_every_n_steps = 0  # evaluate once, at the end
    config.max_eval_batches = 1
    if "gpt" in config:
        config.gpt.update(seq_len=16, embed_dim=32, num_heads=8, ff_dim=64, num_layers=1)
    if "mlp" in config:
        config.mlp.update(hidden_dim=32)
    if "cnn" in config:
        config.cnn.update(image_size=8, channels=8)
    if "gpt2_hf" in config:  # the 256 byte tokens, padded to 256
        config.gpt2_hf.update(
            seq_len=16, n_positions=16, n_embd=32, n_head=4, n_layer=1, vocab_size=256
        )
    return config


# -- strategy specs -------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, expected",
    [
        ("data", DataParallel()),
        ("dp=8", DataParallel(8)),
        ("fsdp", FSDP()),
        ("tp:8", TensorParallel(8)),
        ("fsdp=4,model=2", Hybrid(FSDP(4), TensorParallel(2))),
        (" data=2, fsdp=2, tp=2 ", Hybrid(DataParallel(2), FSDP(2), TensorParallel(2))),
    ],
)
def test_parse_strategy(spec, expected):
    assert tasks.parse_strategy(spec) == expected


@pytest.mark.parametrize(
    "spec, message",
    [
        ("pipeline=2", "Unknown strategy member 'pipeline'"),
        ("fsdp=two", "not an integer"),
        ("", "names no member"),
    ],
)
def test_parse_strategy_errors_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        tasks.parse_strategy(spec)


# -- argv and devices ---------------------------------------------------------------------
def test_normalize_argv_makes_the_config_explicit(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no configs/ here: names resolve to the embedded files
    default = str(CONFIGS_DIR / "default.py")
    assert normalize_argv(["prog", "--config.max_steps=3"]) == [
        "prog", f"--config={default}", "--config.max_steps=3",
    ]  # fmt: skip
    tp = str(CONFIGS_DIR / "tp.py")
    assert normalize_argv(["prog", "--config=tp"])[1] == f"--config={tp}"
    assert normalize_argv(["prog", "--config", "configs/tp.py"])[2] == tp
    assert normalize_argv(["prog", "--config=tp.py:arg"])[1] == f"--config={tp}:arg"
    assert normalize_argv(["prog", f"--config={tp}"])[1] == f"--config={tp}"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tp.py").write_text("")  # a file that exists wins
    assert normalize_argv(["prog", "--config=configs/tp.py"])[1] == "--config=configs/tp.py"


@pytest.mark.parametrize(
    "before, after",
    [
        (None, "--xla_force_host_platform_device_count=8"),
        ("--xla_dump_to=/tmp/x", "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8"),
        ("--xla_force_host_platform_device_count=2", "--xla_force_host_platform_device_count=2"),
    ],
)
def test_simulate_host_devices_respects_the_users_flags(monkeypatch, before, after):
    monkeypatch.setattr(host_devices, "_has_accelerator", lambda: False)
    if before is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", before)
    host_devices.simulate_host_devices(8)
    assert os.environ["XLA_FLAGS"] == after


def test_simulate_host_devices_leaves_accelerators_alone(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    host_devices.simulate_host_devices(8)
    assert "XLA_FLAGS" not in os.environ


def test_an_installed_libtpu_without_a_chip_leaves_the_job_on_8_cpu_devices():
    """The tpu-plan extra installs libtpu where no TPU is: the CLI's device set-up must
    still simulate CPU devices, and libtpu must not start (its warnings, its wait)."""
    if importlib.util.find_spec("libtpu") is None or host_devices._tpu_chips_attached():
        pytest.skip("needs libtpu installed on a machine without a TPU chip")
    script = (
        "import jax\n"  # imported first, as the CLI imports it before choosing devices
        "from nnx_spmd_trainer.app.host_devices import simulate_host_devices\n"
        "simulate_host_devices(8)\n"
        "print(jax.device_count(), jax.default_backend())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["8", "cpu"]
    assert "TPU" not in done.stderr, done.stderr


# -- optimizer and configs ------------------------------------------------------------
def test_optimizer_exposes_the_scheduled_learning_rate():
    config = load("default")
    config.update(learning_rate=1e-2, warmup_steps=10, max_steps=100, end_lr_fraction=0.1)
    tx = tasks.make_optimizer(config)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    rates = [float(state.hyperparams["learning_rate"])]
    for _ in range(100):
        _, state = tx.update({"w": jnp.ones(3)}, state, params)
        rates.append(float(state.hyperparams["learning_rate"]))  # the rate of the last update
    assert rates[1] == 0.0  # warmup starts at zero
    assert max(rates) == pytest.approx(1e-2) == rates[11]
    assert rates[-1] == pytest.approx(1e-3, rel=1e-2)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_config_has_the_common_keys(name):
    config = load(name)
    for key in REQUIRED_KEYS:
        assert key in config, f"configs/{name}.py lacks {key}"
    assert config.model in config  # the model's size block
    tasks.parse_strategy(config.strategy)


def test_configs_share_one_base():
    assert {"default", "dp", "fsdp", "tp", "hybrid", "mlp", "cnn"} <= set(CONFIG_NAMES)
    dp, default = load("dp"), load("default")
    assert dp.strategy == "data=8" and dp.gpt == default.gpt


# -- the command line itself ----------------------------------------------------------
def _cli(*args, cwd, env_extra=None):
    env = environment_for_own_devices()  # the CLI sets it
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "nnx_spmd_trainer", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_unknown_config_key_is_an_error(tmp_path):
    proc = _cli("--config.nope=1", f"--workdir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2  # a configuration error, as argparse would say
    (line,) = proc.stderr.strip().splitlines()  # one line: no absl "Pass --helpshort" after it
    assert line.startswith("nnx-spmd-train: error: --config.nope: the config has no key 'nope'")
    assert "default.py" in line
    assert not (tmp_path / "run").exists()  # nothing ran
    typo = _cli("--config=tp", "--config.max_step=3", cwd=tmp_path)
    assert typo.returncode == 2 and 'Did you mean "max_steps"' in typo.stderr.splitlines()[-1]


@pytest.mark.slow
def test_default_job_end_to_end_in_a_subprocess(tmp_path):
    shrunk = (
        "--config.max_steps=3",
        "--config.batch_size=16",
        "--config.log_every_n_steps=1",
        "--config.max_eval_batches=1",
        "--config.gpt.seq_len=16",
        "--config.gpt.embed_dim=32",
        "--config.gpt.ff_dim=64",
        "--config.gpt.num_layers=1",
    )
    proc = _cli("--workdir=out", *shrunk, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on 8 cpu devices" in proc.stdout  # simulated by the CLI itself
    assert "final after 3 steps: eval loss" in proc.stdout
    out = tmp_path / "out"
    assert (out / "config.json").exists()
    assert "train/loss" in (out / "metrics.csv").read_text()
    assert list((out / "tb").glob("events.out.tfevents.*"))
    # where the time went, in one line whose shares add up to the whole
    (timeline,) = [line for line in proc.stdout.splitlines() if line.startswith("time: ")]
    shares = [float(part.split()[-1].rstrip("%")) for part in timeline.split("=")[1].split(",")]
    assert sum(shares) == pytest.approx(100, abs=0.5)

    # --dry_run on the same workdir: the plan, and not one file added, changed or removed
    def files():
        return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in out.rglob("*")}

    before = files()
    dry = _cli("--workdir=out", "--dry_run", *shrunk, cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "plan: Hybrid(FSDP(4), TensorParallel(2))" in dry.stdout
    assert "compiled step per device" in dry.stdout and "collectives:" in dry.stdout
    assert "final after" not in dry.stdout  # nothing trained
    assert files() == before


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_config_runs_two_steps(name, tmp_path):
    result = job.run(shrink(load(name)), tmp_path)
    assert result.history.steps["train/loss"][-1] == 2
    assert np.isfinite(result.eval_loss) and result.baseline > 0
    assert Path(tmp_path / "metrics.csv").exists()


# -- help and configuration errors ---------------------------------------------------------
def test_help_lists_the_flags_the_shipped_configs_and_the_keys_and_exits_0(tmp_path):
    proc = _cli("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for text in [
        "--config=NAME|FILE",
        "--workdir=DIR",
        "--export=DIR",
        "--export_format=safetensors",
        "--num_processes=N",
        "--config.max_steps=300",
        "--config.gpt.embed_dim=",
        "--config.resume=True",
        ", ".join(CONFIG_NAMES),
    ]:
        assert text in proc.stdout, text  # fmt: skip
    mlp = _cli("--config=mlp", "--help", cwd=tmp_path)
    assert "--config.mlp.hidden_dim=" in mlp.stdout and "gpt" not in mlp.stdout.split("Keys")[1]


def test_a_config_name_resolves_to_a_file_never_to_a_folder(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mlp").mkdir()  # a folder named like a shipped config
    assert normalize_argv(["prog", "--config=mlp"])[1] == f"--config={CONFIGS_DIR}/mlp.py"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config=nope"], "neither a config file nor a shipped config (char, cnn, default"),
        (["--config.strategy=fsdp=3"], "does not fit the 8 available devices"),
        (["--config.strategy=pipeline=2"], "Unknown strategy member 'pipeline'"),
    ],
)
def test_configuration_errors_are_one_line_and_exit_2(tmp_path, args, message):
    proc = _cli(*args, f"--workdir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert line.startswith("nnx-spmd-train: error:") and message in line
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "devices, expected, why",
    [
        (8, "fsdp=4,model=2", ""),
        (4, "fsdp=2,model=2", ""),
        (2, "fsdp=1,model=2", ""),
        (1, "fsdp=1,model=1", "model=2 does not fit 1 device, so model=1"),
    ],
)
def test_the_default_layout_fits_any_device_count(devices, expected, why):
    spec = load("default").strategy
    assert tasks.fit_to_devices(spec, devices) == (expected, why)
    strategy = tasks.parse_strategy(expected)
    assert strategy.make_mesh(jax.devices()[:devices]).size == devices


def test_a_layout_without_a_relative_size_is_taken_as_written():
    assert tasks.fit_to_devices("fsdp=4,model=2", 1) == ("fsdp=4,model=2", "")


def test_compute_dtype_is_checked():
    config = load("default")
    config.compute_dtype = "bf16"
    with pytest.raises(tasks.ConfigError, match="use 'float32', 'bfloat16' or 'float16'"):
        tasks.compute_dtype(config)


# One process per device count is a CLI run of its own. 1 device takes the fallback
# (model=1) and 2 devices a size-1 fsdp axis; 4 devices (fsdp=2,model=2) is the same
# layout as 8 (fsdp=4,model=2, test_default_job_end_to_end_in_a_subprocess), with a
# smaller axis, and fit_to_devices(spec, 4) is checked above.
@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
def test_the_default_job_runs_on_1_and_2_devices(tmp_path, devices):
    proc = _cli(
        "--workdir=out", "--config.max_steps=3", "--config.batch_size=16",
        "--config.max_eval_batches=1", "--config.gpt.seq_len=16", "--config.gpt.embed_dim=32",
        "--config.gpt.ff_dim=64", "--config.gpt.num_layers=1",
        cwd=tmp_path,
        env_extra={"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"on {devices} cpu devices" in proc.stdout
    assert "final after 3 steps: eval loss" in proc.stdout
    if devices == 1:
        assert "model=2 does not fit 1 device, so model=1" in proc.stdout
