"""Each adapter's assumption about another library's insides, checked against the installed
library (nnx_spmd_trainer/adapters/). A failure names the version the assumption was
checked against and what to change: pyproject.toml caps Orbax and Grain at the next
minor, so these fail first where an upgrade moved something."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboardX import SummaryWriter
from tensorboardX.summary import scalar

from nnx_spmd_trainer.adapters import (
    grain_private,
    jax_private,
    orbax_private,
    tensorboardx_private,
)
from nnx_spmd_trainer.app import python_private  # the app's own fence (app/ imports public names)
from nnx_spmd_trainer.distributed.agree import Agreement

JAX = f"checked against jax 0.10.2 (installed: {jax.__version__})"
ORBAX = "checked against orbax-checkpoint 0.12.8"
GRAIN = "checked against grain 0.2.18"
TENSORBOARDX = "checked against tensorboardX 2.6.5"
PYTHON = f"checked against CPython 3.11 (running: {sys.version.split()[0]})"


# -- jax_private ---------------------------------------------------------------------------
@pytest.fixture
def real_store() -> Iterator[object]:
    """JAX's own coordination service and a client of it, in this process (the runtime
    itself is not initialised: that would route every CPU collective through Gloo)."""
    from jax._src.lib import _jax

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    service = _jax.get_distributed_runtime_service(address, 1)
    client = _jax.get_distributed_runtime_client(address, 0)
    client.connect()
    yield client
    client.shutdown()
    service.shutdown()


def test_jax_keeps_its_coordination_client_where_the_adapter_reads_it():
    from jax._src import distributed
    from jax._src.lib import _jax

    assert hasattr(distributed.global_state, "client"), (
        f"jax_private.coordination_client reads jax._src.distributed.global_state.client, "
        f"{JAX}: find where jax.distributed.initialize keeps its client now and read it there."
    )
    missing = [
        m for m in jax_private.CLIENT_METHODS if not hasattr(_jax.DistributedRuntimeClient, m)
    ]
    assert not missing, (
        f"JAX's DistributedRuntimeClient lacks {missing}, {JAX}: adapt "
        "jax_private.KeyValueStore and its callers (distributed.agree, distributed.peers)."
    )
    assert jax_private.coordination_client() is None  # this process never initialised it


def test_agreement_runs_on_jaxs_own_key_value_store(real_store):
    """The calls distributed.agree and peers make, on JAX's store: a value set is read back,
    a key set twice is refused unless overwritten, a missing one times out."""
    agreement = Agreement(real_store, 0, 1)
    why = f"JAX's key-value store no longer behaves as distributed.agree assumes, {JAX}"
    assert agreement.all_values("t", {"a": [1, 2]}) == [{"a": [1, 2]}], why
    assert agreement.all_values("t", "again") == ["again"], why  # the next round, its own key
    first = agreement.key("t", 0, 0)
    assert json.loads(real_store.blocking_key_value_get(first, 1000)) == {"a": [1, 2]}, why
    with pytest.raises(Exception, match="ALREADY_EXISTS"):
        real_store.key_value_set(first, "x")  # a round's value is written once
    real_store.key_value_set("nnx_spmd/alive/0", "2", True)  # peers' beat overwrites
    assert ("nnx_spmd/alive/0", "2") in real_store.key_value_dir_get("nnx_spmd/alive/"), why
    with pytest.raises(Exception, match="DEADLINE_EXCEEDED"):
        real_store.blocking_key_value_get("never/set", 100)


class _PresentCluster:
    """Registers a present fake cluster environment first in JAX's list; removes it."""

    def __init__(self, name: str, *, opt_in: bool, processes: int) -> None:
        from jax._src import clusters

        class Fake(clusters.ClusterEnv):
            opt_in_only_method = opt_in

            @classmethod
            def is_env_present(cls) -> bool:
                return True

            @classmethod
            def get_coordinator_address(cls, timeout_secs, override_coordinator_port=None):
                return "127.0.0.1:1"

            @classmethod
            def get_process_count(cls) -> int:
                return processes

            @classmethod
            def get_process_id(cls) -> int:
                return 0

        Fake.name = name
        self.registry = clusters.ClusterEnv._cluster_types
        self.registry.remove(Fake)
        self.registry.insert(0, Fake)
        self.fake = Fake

    def remove(self) -> None:
        self.registry.remove(self.fake)


@pytest.mark.parametrize("opt_in", [True, False], ids=["opt-in", "default"])
def test_cluster_detection_finds_what_jax_initialize_would(opt_in):
    from jax._src import clusters

    assert clusters.ClusterEnv._cluster_types is not None
    mpi = next((c for c in jax_private.cluster_types() if c.name == "mpi4py"), None)
    assert mpi is not None and mpi.opt_in_only_method, (
        f"jax_private.detected_cluster assumes mpi4py's cluster is opt-in only, {JAX}"
    )
    fake = _PresentCluster("fake_cluster", opt_in=opt_in, processes=4)
    try:
        _, jax_count, _, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            None, None, None, None, None, None
        )
        ours = jax_private.cluster_process_count()
        named = jax_private.cluster_process_count("fake_cluster")
    finally:
        fake.remove()
    assert ours == (jax_count or 1), (
        f"jax_private.detected_cluster no longer mirrors ClusterEnv."
        f"auto_detect_unset_distributed_params ({ours} processes against JAX's {jax_count}), "
        f"{JAX}: read JAX's detection again and follow it."
    )
    assert ours == (1 if opt_in else 4) and named == 4


def test_jax_keeps_cudnn_attention_and_its_float32_lse_where_the_adapter_reads_it():
    from jax._src.cudnn import fused_attention_stablehlo as fused

    assert jax_private.cudnn_attention() is not None, (
        f"jax_private.cudnn_attention calls jax._src.cudnn.fused_attention_stablehlo."
        f"dot_product_attention with {jax_private.CUDNN_ATTENTION_KEYWORDS}, {JAX}: find "
        "cuDNN's attention with its float32 log-sum-exp, or let ring attention use einsums."
    )
    assert {"CAUSAL", "NO_MASK"} <= set(fused.MaskType.__members__)
    # The kernels' names, which Plan.report looks for in a compiled step.
    names = set(fused._custom_name_maps.values())
    assert "__cudnn$fmhaSoftmax" in names
    assert all(n.startswith(jax_private.CUDNN_ATTENTION_TARGET) for n in names), names
    # Why the public API will not do: its log-sum-exp comes back in the inputs' dtype.
    q = jnp.ones((1, 4, 1, 8), jnp.bfloat16)
    _, lse = jax.nn.dot_product_attention(q, q, q, implementation="xla", return_residual=True)
    assert lse.dtype == jnp.bfloat16


# -- orbax_private -------------------------------------------------------------------------
def _save_step(
    directory: Path, manager_class: type = ocp.CheckpointManager
) -> ocp.CheckpointManager:
    manager = manager_class(directory, options=ocp.CheckpointManagerOptions(create=True))
    manager.save(0, args=ocp.args.Composite(meta=ocp.args.JsonSave({"step": 0})))
    manager.wait_until_finished()
    return manager


def test_orbax_marks_a_committed_step_with_the_file_the_adapter_checks(tmp_path):
    from orbax.checkpoint._src.path import atomicity_types

    assert atomicity_types.COMMIT_SUCCESS_FILE == orbax_private.COMMIT_MARKER, (
        f"Orbax's commit marker is now {atomicity_types.COMMIT_SUCCESS_FILE!r}, {ORBAX}: "
        "set orbax_private.COMMIT_MARKER to it."
    )
    _save_step(tmp_path).close()
    step = tmp_path / "0"
    assert orbax_private.is_committed(step), f"a saved step has no {orbax_private.COMMIT_MARKER}"
    (step / orbax_private.COMMIT_MARKER).unlink()
    assert not orbax_private.is_committed(step)
    assert ocp.step.is_checkpoint_finalized(step), (
        f"Orbax's public is_checkpoint_finalized now rejects a step without its marker, "
        f"{ORBAX}: orbax_private.is_committed can use it instead of the file name."
    )


class _AbslNotes(logging.Handler):
    """The messages Orbax logs (through absl's logger) while the block runs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> _AbslNotes:
        logging.getLogger("absl").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("absl").removeHandler(self)


def test_orbax_notes_a_missing_step_metadata_file_as_quiet_listing_expects(tmp_path):
    """A step without its metadata file (a deletion killed half-way) and a manager opened
    read-only: Orbax's notes about both are what ``quiet_listing`` drops, and only while
    it is open (tiers.py opens its managers in it)."""
    from orbax.checkpoint._src.metadata import checkpoint as step_metadata

    assert step_metadata.step_metadata_file_path(tmp_path).name == orbax_private.STEP_METADATA, (
        f"Orbax's step metadata file is renamed, {ORBAX}: set orbax_private.STEP_METADATA."
    )
    _save_step(tmp_path).close()
    (tmp_path / "0" / orbax_private.STEP_METADATA).unlink()
    assert orbax_private.lacks_step_metadata(tmp_path / "0")
    read_only = ocp.CheckpointManagerOptions(read_only=True, create=False)
    with _AbslNotes() as loud:
        ocp.CheckpointManager(tmp_path, options=read_only).close()
    missing = [line for line in loud.lines if line.startswith("Metadata file does not exist")]
    assert missing and str(tmp_path / "0" / orbax_private.STEP_METADATA) in missing[0], (
        f"Orbax no longer notes a missing step metadata file as expected, {ORBAX}: "
        f"update orbax_private._ListingNotes (notes seen: {loud.lines[:5]})."
    )
    assert any(line.startswith(orbax_private._ListingNotes.READ_ONLY) for line in loud.lines)
    with _AbslNotes() as quiet, orbax_private.quiet_listing([tmp_path / "0"]):
        ocp.CheckpointManager(tmp_path, options=read_only).close()
    notes = ("Metadata file does not exist", *orbax_private._ListingNotes.READ_ONLY)
    assert not [line for line in quiet.lines if line.startswith(notes)], quiet.lines
    assert not logging.getLogger("absl").filters  # nothing left behind


def test_json_written_later_makes_its_value_in_orbaxs_background_commit(tmp_path):
    assert inspect.iscoroutinefunction(ocp.JsonCheckpointHandler._save_fn), (
        f"JsonCheckpointHandler._save_fn is gone or not a coroutine, {ORBAX}: "
        "orbax_private.JsonWrittenLater (callbacks/checkpoint/fingerprint.py) must override what "
        "async_save now hands to its commit future."
    )
    released, seen = threading.Event(), []

    class Doubled(orbax_private.JsonWrittenLater):
        def to_json(self, item):
            released.wait(10)  # a device value being computed: the save must not wait
            seen.append((threading.current_thread(), bool(returned)))
            return {k: 2 * v for k, v in item.items()}

    handler, returned = Doubled(filename="doubled.json"), []
    futures = asyncio.run(handler.async_save(tmp_path, args=ocp.args.JsonSave({"a": 1})))
    returned.append(True)
    released.set()
    for f in futures or []:
        f.result()
    assert json.loads((tmp_path / "doubled.json").read_text()) == {"a": 2}
    thread, save_had_returned = seen[0]
    assert save_had_returned and thread is not threading.current_thread(), (
        f"Orbax no longer makes a JSON item's value in its background commit, {ORBAX}: "
        "async_save waited for orbax_private.JsonWrittenLater.to_json."
    )


def test_orbax_asks_reached_preemption_when_saving_and_quiet_manager_answers_no(tmp_path):
    asked: list[int] = []

    class Counting(ocp.CheckpointManager):
        def reached_preemption(self, step: int) -> bool:
            asked.append(step)
            return False

    _save_step(tmp_path / "counting", Counting).close()
    assert 0 in asked, (
        f"CheckpointManager.save no longer asks reached_preemption(step), {ORBAX}: "
        "orbax_private.QuietManager may be dropped (check that a save leaves JAX's "
        "preemption sync point alone)."
    )
    quiet = _save_step(tmp_path / "quiet", orbax_private.QuietManager)
    assert quiet.reached_preemption(0) is False and quiet.all_steps() == [0]
    quiet.close()


# -- grain_private -------------------------------------------------------------------------
def test_a_map_dataset_iterators_state_is_its_next_index():
    iterator = iter(grain.MapDataset.range(10).batch(2).to_iter_dataset())
    next(iterator)
    state = iterator.get_state()
    assert grain_private.is_index_state(state) and grain_private.next_index(state) == 1, (
        f"a MapDataset iterator's state is now {state!r}, {GRAIN}: adapt grain_private "
        "(data.position resumes from it, callbacks/checkpoint/checks.py checks it)."
    )
    iterator.set_state(grain_private.state_at(3))
    np.testing.assert_array_equal(next(iterator), [6, 7])
    assert not grain_private.is_index_state(b"a DataLoader's bytes")


def test_grain_saves_each_process_position_in_the_file_the_adapter_names(tmp_path):
    iterator = iter(grain.MapDataset.range(10).to_iter_dataset())
    next(iterator)
    grain.checkpoint.CheckpointHandler().save(
        tmp_path, args=grain.checkpoint.CheckpointSave(iterator)
    )
    file = grain_private.position_file(tmp_path, jax.process_index(), jax.process_count())
    assert file.exists(), (
        f"Grain now writes {sorted(p.name for p in tmp_path.iterdir())}, not {file.name}, "
        f"{GRAIN}: change grain_private.position_file."
    )
    assert json.loads(file.read_text()) == iterator.get_state()


# -- tensorboardx_private ------------------------------------------------------------------
def test_a_summary_added_to_the_writers_file_writer_lands_in_its_one_event_file(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    writer.add_scalar("a", 1.0, 1)
    tensorboardx_private.event_file_writer(writer).add_summary(scalar("b", 2.0), 2)
    writer.close()
    files = list(tmp_path.glob("events.out.tfevents.*"))
    assert len(files) == 1, f"{sorted(p.name for p in tmp_path.rglob('*'))}, {TENSORBOARDX}"
    events = EventAccumulator(str(files[0]))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"a", "b"}, (
        f"{events.Tags()}, {TENSORBOARDX}: change tensorboardx_private.event_file_writer."
    )
    assert [(e.step, e.value) for e in events.Scalars("b")] == [(2, 2.0)]


# -- python_private ------------------------------------------------------------------------
def test_exit_handlers_run_once_without_waiting_for_a_stuck_thread():
    """What ``app.interrupts.exit_at_once`` relies on: the handlers run now, once, and a
    non-daemon thread that never ends does not hold the exit (``os._exit`` follows)."""
    # The adapter's file alone: importing the package (JAX) would only slow the child.
    script = f"""
import atexit, importlib.util, os, threading
spec = importlib.util.spec_from_file_location("python_private", {python_private.__file__!r})
adapter = importlib.util.module_from_spec(spec)
spec.loader.exec_module(adapter)
atexit.register(print, "handler ran", flush=True)
threading.Thread(target=threading.Event().wait).start()  # never ends, not a daemon
adapter.run_exit_handlers()
adapter.run_exit_handlers()  # cleared: nothing runs twice
os._exit(3)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout) == (3, "handler ran\n"), (
        f"{done.returncode}, {done.stdout!r}, {done.stderr[-2000:]}, {PYTHON}: change "
        "python_private.run_exit_handlers."
    )
