"""JAX's persistent compilation cache as the library turns it on: where, off, and read back
by a later process (planner/compile_cache.py; the CLI's goodput line counts its hits)."""

import contextlib
import os
import re
import subprocess
import sys
import uuid
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import environment_for_own_devices
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from nnx_spmd_trainer.planner import compile_cache
from nnx_spmd_trainer.planner.compile_cache import (
    ENV_VAR,
    MAX_BYTES,
    CacheCounts,
    CompileCacheError,
    use_compile_cache,
)

OPTIONS = (
    "jax_enable_compilation_cache",
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_compilation_cache_max_size",
)


@pytest.fixture
def jax_options(monkeypatch, tmp_path):
    """JAX's cache options put back after the test (they are the process's); no
    ``NNX_SPMD_TRAINER_COMPILE_CACHE``, and the user cache directory under ``tmp_path``."""
    before = {name: getattr(jax.config, name) for name in OPTIONS}
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    jax_cache.reset_cache()


def fresh_program():
    """A program no cache has seen (its constant is new each call), an input, and what it
    computes, in NumPy."""
    salt = np.float32(uuid.uuid4().int % 1_000_003)
    x = np.linspace(-2, 2, 8, dtype=np.float32)
    return jax.jit(lambda x: jnp.tanh(x) * salt + x.sum()), x, np.tanh(x) * salt + x.sum()


def entries(directory):
    return sorted(p.name for p in directory.glob("*-cache")) if directory.exists() else []


def test_a_jax_cache_the_user_configured_is_left_as_it_is(jax_options, tmp_path):
    users = tmp_path / "users-own"
    jax.config.update("jax_compilation_cache_dir", str(users))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.5)
    before = {name: getattr(jax.config, name) for name in OPTIONS}
    assert use_compile_cache() == users
    assert {name: getattr(jax.config, name) for name in OPTIONS} == before
    assert not (tmp_path / "xdg").exists()  # the default directory is not made


def test_by_default_every_program_is_cached_in_the_user_cache_directory(jax_options, tmp_path):
    jax.config.update("jax_compilation_cache_dir", None)  # nothing configured in JAX
    directory = use_compile_cache()
    assert directory == tmp_path / "xdg" / "nnx_spmd_trainer" / "jax"
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    assert jax.config.jax_compilation_cache_max_size == MAX_BYTES
    f, x, expected = fresh_program()
    before = compile_cache.cache_counts()
    f(x).block_until_ready()  # compiles in well under JAX's own floor of one second
    assert compile_cache.cache_counts() - before == CacheCounts(hits=0, misses=1)
    assert len(entries(directory)) == 1
    # read back once JAX's in-memory caches are gone, as a new process would
    jax.clear_caches()
    np.testing.assert_allclose(f(x), expected, rtol=1e-6)
    assert compile_cache.cache_counts() - before == CacheCounts(hits=1, misses=1)


def test_an_argument_beats_the_environment_which_beats_jax(jax_options, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "from-env"))
    assert use_compile_cache() == tmp_path / "from-env"
    assert use_compile_cache(" Auto") == tmp_path / "from-env"
    assert use_compile_cache(tmp_path / "given") == tmp_path / "given"
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "given")
    f, x, _ = fresh_program()
    f(x).block_until_ready()
    assert len(entries(tmp_path / "given")) == 1 and not entries(tmp_path / "from-env")


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_off_writes_no_cache_anywhere(jax_options, tmp_path, monkeypatch, how):
    jax_dir = tmp_path / "jax-configured"
    jax.config.update("jax_compilation_cache_dir", str(jax_dir))
    if how == "environment":
        monkeypatch.setenv(ENV_VAR, "OFF")
    assert use_compile_cache("off" if how == "argument" else None) is None
    assert compile_cache.compile_cache_directory() is None
    before = compile_cache.cache_counts()
    f, x, _ = fresh_program()
    f(x).block_until_ready()
    assert compile_cache.cache_counts() - before == CacheCounts()  # not even looked up
    assert not jax_dir.exists() and not (tmp_path / "xdg").exists()
    assert use_compile_cache() is None  # off stays off for the process until a directory


def test_a_setting_that_cannot_be_used_names_the_fix(jax_options, tmp_path, monkeypatch):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(CompileCacheError, match="is a file, not a directory.*'off'"):
        use_compile_cache(a_file)
    with pytest.raises(CompileCacheError, match="give a directory, 'off' or 'auto'"):
        use_compile_cache(" ")
    monkeypatch.setenv(ENV_VAR, str(a_file))
    with pytest.raises(CompileCacheError, match=f"{ENV_VAR}=.*is a file"):
        use_compile_cache()
    with pytest.raises(CompileCacheError, match="cannot make the compilation cache directory"):
        use_compile_cache(a_file / "below-a-file")


def mounted(*options: str, at) -> None:
    """A fresh tmpfs at ``at`` (root only), or the test skipped where mounting is refused."""
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(at)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


@pytest.fixture(params=["read-only", "full"])
def unusable_directory(request, tmp_path):
    """A cache directory that takes no entries, and the reason the warning gives: read-only
    (a read-only tmpfs as root, whom mode bits do not stop; else mode 0o555), or on a full
    disk (a 1 MiB tmpfs filled up; root only)."""
    directory = tmp_path / request.param
    directory.mkdir()
    as_root = os.geteuid() == 0
    if request.param == "read-only":
        if as_root:
            mounted("ro", "size=128m", at=directory)  # roomy: the write is what fails
        else:
            directory.chmod(0o555)
        reason = r"cannot be written \((Read-only file system|Permission denied)\)"
    else:
        if not as_root:
            pytest.skip("a full disk is simulated with a tmpfs, which only root may mount")
        mounted("size=1m", at=directory)
        with contextlib.suppress(OSError), open(directory / "filler", "wb") as filler:
            filler.write(b"\0" * 2**21)  # until "No space left on device"
        reason = r"has 0\.\d MiB free \(the cache wants 64 MiB or more\)"
    yield directory, reason
    if as_root:
        subprocess.run(["umount", str(directory)], check=True, timeout=60)
    else:
        directory.chmod(0o755)


def test_a_directory_that_takes_no_entries_is_one_warning_and_the_run_goes_on_without_it(
    jax_options, unusable_directory
):
    """Where JAX would warn twice per program (a read and a write: 9-12 lines for the
    default job) and cache nothing, the cache is off for the run and says so once."""
    directory, reason = unusable_directory
    before = compile_cache.cache_counts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert use_compile_cache(directory) is None
        for _ in range(2):
            f, x, expected = fresh_program()
            np.testing.assert_allclose(f(x), expected, rtol=1e-6)  # the run goes on
        assert use_compile_cache() is None  # a later Trainer's default: off, quietly
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    said = re.escape(
        "; the run goes on without it. Name a writable directory (compile_cache=..., "
        f"{ENV_VAR}) or 'off'."
    )
    off = re.escape(f"The compilation cache is off for this run: {str(directory)!r} ")
    assert re.fullmatch(off + reason + said, messages[0]), messages[0]
    assert caught[0].filename == __file__  # the caller's line, not the library's
    assert compile_cache.compile_cache_directory() is None
    assert compile_cache.cache_counts() - before == CacheCounts()  # not even looked up


def test_an_entry_cut_short_is_deleted_when_the_cache_is_turned_on(jax_options, tmp_path):
    """A kill or a full disk while JAX writes an entry leaves it truncated and without the
    access-time file JAX writes after it: JAX would fail to read it in every run (and never
    write it again). The next run deletes it, compiles that program and writes it whole."""
    cache = tmp_path / "cache"
    assert use_compile_cache(cache) == cache
    f, x, expected = fresh_program()
    f(x).block_until_ready()
    (entry,) = cache.glob("*-cache")
    atime = entry.with_name(entry.name.removesuffix("-cache") + "-atime")
    whole = entry.stat().st_size
    g, y, _ = fresh_program()  # another program's entry, whole: kept
    g(y).block_until_ready()
    kept = sorted(p.name for p in cache.glob("*-cache") if p != entry)
    entry.write_bytes(entry.read_bytes()[: whole // 3])
    atime.unlink()
    jax.clear_caches()  # as a new process would start

    before = compile_cache.cache_counts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert use_compile_cache(cache) == cache  # the next run
        np.testing.assert_allclose(f(x), expected, rtol=1e-6)
    assert [str(w.message) for w in caught] == []  # no "Error reading ... cache entry"
    assert compile_cache.cache_counts() - before == CacheCounts(hits=0, misses=1)
    assert sorted(p.name for p in cache.glob("*-cache") if p != entry) == kept
    assert atime.exists()  # written whole this time: read back as a hit
    jax.clear_caches()
    np.testing.assert_allclose(f(x), expected, rtol=1e-6)
    assert compile_cache.cache_counts() - before == CacheCounts(hits=1, misses=1)


def test_cache_counts_read_as_the_goodput_line_says_them():
    assert str(CacheCounts(hits=3, misses=1)) == "3 hits, 1 miss"
    assert str(CacheCounts(hits=1, misses=0)) == "1 hit, 0 misses"
    assert CacheCounts(5, 2) - CacheCounts(1, 2) == CacheCounts(4, 0)


# -- the CLI, in processes of its own -------------------------------------------------
TINY = [
    "--config.max_steps=2",
    "--config.batch_size=16",
    "--config.log_every_n_steps=1",
    "--config.max_eval_batches=1",
    "--config.checkpoint_every_n_steps=0",
    "--config.gpt.seq_len=16",
    "--config.gpt.embed_dim=32",
    "--config.gpt.num_heads=4",
    "--config.gpt.ff_dim=64",
    "--config.gpt.num_layers=1",
]
CACHE_LINE = re.compile(r"\(compile cache: (\d+) hits?, (\d+) miss(?:es)?\)")


def start(tmp_path, name, *flags, env=()):
    return subprocess.Popen(
        [sys.executable, "-m", "nnx_spmd_trainer", f"--workdir={tmp_path / name}", *TINY, *flags],
        env={**environment_for_own_devices(), "XDG_CACHE_HOME": str(tmp_path / "xdg"), **dict(env)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def finished(proc):
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    (final,) = [line for line in stdout.splitlines() if line.startswith("final after 2 steps")]
    (timeline,) = [line for line in stdout.splitlines() if line.startswith("time: ")]
    return final, timeline


def hits_and_misses(timeline):
    match = CACHE_LINE.search(timeline)
    assert match, timeline
    return int(match[1]), int(match[2])


@pytest.mark.serial
@pytest.mark.slow
def test_two_runs_at_once_share_a_cache_and_a_third_process_reads_it_all_back(tmp_path):
    cache = tmp_path / "cache"
    flag = f"--config.compile_cache={cache}"
    first, second = [finished(p) for p in [start(tmp_path, "a", flag), start(tmp_path, "b", flag)]]
    for _, timeline in (first, second):
        assert hits_and_misses(timeline)[1] > 0  # each compiled what the other had not written
    assert entries(cache)
    final, timeline = finished(start(tmp_path, "c", flag))
    hits, misses = hits_and_misses(timeline)
    assert hits > 0 and misses == 0, timeline  # every program read back
    assert final == first[0] == second[0]  # the same eval loss from programs read back
    assert not (tmp_path / "xdg").exists()  # only the directory named was written


@pytest.mark.serial
@pytest.mark.slow
def test_the_cli_off_switch_writes_no_cache(tmp_path):
    jax_dir = tmp_path / "jax-configured"  # JAX's own setting is switched off too
    proc = start(
        tmp_path,
        "run",
        "--config.compile_cache=off",
        env={"JAX_COMPILATION_CACHE_DIR": str(jax_dir)},
    )
    _, timeline = finished(proc)
    assert "(compile cache off)" in timeline
    assert not jax_dir.exists() and not (tmp_path / "xdg").exists()
