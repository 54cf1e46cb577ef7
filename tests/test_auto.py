"""strategy="auto": every layout planned from shapes, those that fit timed, the fastest kept."""

import dataclasses
import gc
import itertools
import statistics
import time
from collections.abc import Sequence

import grain
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from live_memory import live_bytes
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from toy_models import (
    Net,
    RecordLosses,
    assert_params_match,
    classification_loss,
    flat_params,
    make_batches,
    train_reference,
)

from nnx_spmd_trainer import (
    FSDP,
    Auto,
    DataParallel,
    Hybrid,
    LayoutNotChosen,
    NoLayoutFits,
    Plan,
    Strategy,
    TensorParallel,
    Trainer,
    auto,
)
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint, TensorBoard
from nnx_spmd_trainer.engine import timing


def big_net(rngs):
    return Net(rngs, din=256, hidden=512, dout=16)


def big_batches(n):
    return make_batches(n, din=256, classes=16)


def collected_live_bytes():
    """Device bytes of live arrays, once Python's garbage (cycles holding arrays) is gone."""
    gc.collect()
    return live_bytes()


def shapes_of(batch):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)


def test_candidates_are_every_layout_the_device_count_allows():
    assert auto.candidates(8) == [
        DataParallel(),
        FSDP(),
        Hybrid(DataParallel(4), TensorParallel(2)),
        Hybrid(FSDP(4), TensorParallel(2)),
        Hybrid(DataParallel(2), TensorParallel(4)),
        Hybrid(FSDP(2), TensorParallel(4)),
        TensorParallel(8),
    ]
    assert auto.candidates(8, tp_sizes=[3, 4]) == [
        DataParallel(),
        FSDP(),
        Hybrid(DataParallel(2), TensorParallel(4)),
        Hybrid(FSDP(2), TensorParallel(4)),
    ]
    assert auto.candidates(1) == [DataParallel(), FSDP()]
    with pytest.raises(ValueError, match="'auto'"):
        Trainer(Net, optax.adam(1e-3), strategy="fastest", loss_fn=classification_loss)
    with pytest.raises(TypeError, match="memory_budget_bytes"):
        Trainer(Net, optax.adam(1e-3), loss_fn=classification_loss, memory_budget_bytes=10**6)


def test_auto_within_a_budget_picks_a_layout_that_fits_trains_as_it_given_and_leaks_nothing():
    batches = big_batches(3)
    tx = optax.adam(1e-3)

    def report(strategy, budget):
        plan = Plan(big_net, tx, strategy=strategy, loss_fn=classification_loss)
        return plan.report(shapes_of(batches[0]), memory_budget_bytes=budget)

    budget = report(DataParallel(), None).memory["peak"] // 2
    dp, fsdp = report(DataParallel(), budget), report(FSDP(min_size=64), budget)
    assert dp.fits is False and dp.verdict.startswith("does not fit")
    assert fsdp.fits is True and fsdp.verdict.startswith("fits")

    printed: list[str] = []
    strategies = [
        DataParallel(),
        FSDP(min_size=64),
        Hybrid(FSDP(4, min_size=64), TensorParallel(2)),
    ]
    base = collected_live_bytes()
    trainer = Trainer(
        big_net,
        tx,
        strategy=Auto(candidates=strategies, steps=2, rounds=1, print_fn=printed.append),
        memory_budget_bytes=budget,
        loss_fn=classification_loss,
        callbacks=[losses := RecordLosses()],
    )
    with pytest.raises(LayoutNotChosen, match="choose_layout"):
        trainer.plan  # noqa: B018
    with pytest.raises(LayoutNotChosen, match="no layout yet"):
        trainer.mesh  # noqa: B018
    with pytest.raises(LayoutNotChosen, match="no layout yet"):
        trainer.model  # noqa: B018
    trainer.fit(batches, max_steps=3)
    auto_bytes = collected_live_bytes() - base

    choice = trainer.layout_choice
    assert choice is not None and trainer.strategy == choice.strategy != DataParallel()
    rows = {row.layout: row for row in choice.rows}
    assert rows["DataParallel()"].status == "does not fit"
    assert rows["DataParallel()"].report.verdict.startswith("does not fit")
    assert rows["FSDP(min_size=64)"].status == "timed"
    assert choice.chosen.status == "timed" and choice.chosen.peak_bytes <= budget
    assert choice.chosen.step_time_s == min(r.step_time_s for r in choice.rows if r.step_time_s)
    assert printed == [choice.table()]
    assert "does not fit" in printed[0] and "<- chosen" in printed[0]
    # the choice in the run's first logs: its mesh and step time, at step 0
    mesh = dict(trainer.mesh.shape)
    for axis, n in mesh.items():
        assert trainer.history.history[f"layout/mesh/{axis}"] == [n]
    assert trainer.history.steps["layout/step_time_s"] == [0]

    # The same numbers as the chosen strategy given explicitly, and as plain optax.
    explicit = Trainer(
        big_net, tx, strategy=choice.strategy, loss_fn=classification_loss,
        callbacks=[explicit_losses := RecordLosses()],
    )  # fmt: skip
    # Copies: on the CPU a placed shard may alias its NumPy rows, and an alias of the
    # first run's batch would be counted once for both runs.
    explicit.fit([jax.tree.map(np.copy, b) for b in batches], max_steps=3)
    explicit_bytes = collected_live_bytes() - base - auto_bytes
    assert losses.losses == explicit_losses.losses
    got, want = flat_params(trainer.state), flat_params(explicit.state)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    reference_params, reference_losses = train_reference(big_net, tx, batches)
    np.testing.assert_allclose(losses.losses, reference_losses, rtol=1e-5)
    assert_params_match(trainer, reference_params)
    # No candidate's arrays left behind: the devices hold what the explicit run holds.
    assert auto_bytes == explicit_bytes


def _time_trainers(trainers, batches, rounds):
    """The test's own timing: each trainer's fit over ``batches``, interleaved, median."""
    for trainer in trainers:  # compile, first calls
        trainer.fit(batches, max_steps=trainer.step + len(batches))
    times = [[] for _ in trainers]
    for _ in range(rounds):
        for i, trainer in enumerate(trainers):
            start = time.perf_counter()
            trainer.fit(batches, max_steps=trainer.step + len(batches))
            times[i].append((time.perf_counter() - start) / len(batches))
    return [statistics.median(t) for t in times]


def test_auto_picks_a_layout_as_fast_as_the_fastest_the_test_measures():
    batches = big_batches(4)
    strategies = [
        DataParallel(),
        TensorParallel(8),
        Hybrid(FSDP(4, min_size=64), TensorParallel(2)),
    ]
    trainer = Trainer(
        big_net, optax.sgd(1e-3), strategy=Auto(candidates=strategies, print_fn=None),
        loss_fn=classification_loss,
    )  # fmt: skip
    choice = trainer.choose_layout(batches)
    assert [r.status for r in choice.rows] == ["timed"] * 3
    trainers = [
        Trainer(big_net, optax.sgd(1e-3), strategy=s, loss_fn=classification_loss)
        for s in strategies
    ]
    measured = _time_trainers(trainers, batches, rounds=5)
    picked = measured[strategies.index(choice.strategy)]
    # A shared 2-core machine is noisy: "within noise" is a generous factor here.
    assert picked <= 1.5 * min(measured), (
        choice.table(),
        dict(zip(map(repr, strategies), measured, strict=True)),
    )


@pytest.fixture(scope="module")
def net_reference_losses():
    """Plain optax on one device over ``make_batches(4)``: the same for every kind of data."""
    return train_reference(Net, optax.adam(1e-3), make_batches(4))[1]


@pytest.mark.parametrize("kind", ["list", "generator", "grain iterator"])
def test_auto_times_on_the_first_batches_without_taking_them_from_training(
    kind, net_reference_losses
):
    batches = make_batches(4)
    data = {
        "list": lambda: batches,
        "generator": lambda: (b for b in batches),
        "grain iterator": lambda: iter(grain.MapDataset.source(batches).to_iter_dataset()),
    }[kind]()
    trainer = Trainer(
        Net, optax.adam(1e-3),
        strategy=Auto(candidates=[FSDP(min_size=64)], steps=2, rounds=1, print_fn=None),
        loss_fn=classification_loss, callbacks=[losses := RecordLosses()],
    )  # fmt: skip
    trainer.fit(data, max_steps=4)
    np.testing.assert_allclose(losses.losses, net_reference_losses, rtol=1e-5)
    assert trainer.step == 4


def test_nothing_fits_is_one_error_listing_every_candidate_and_the_budget():
    # hidden=12: the "model" dimensions split over 2 and 4 devices, not over 8.
    def factory(rngs):
        return Net(rngs, hidden=12)

    strategies = [DataParallel(), Hybrid(DataParallel(2), TensorParallel(4)), TensorParallel(8)]
    with pytest.raises(NoLayoutFits) as raised:
        auto.choose(
            factory, optax.adam(1e-3), make_batches(1), loss_fn=classification_loss,
            memory_budget_bytes=1000, strategies=strategies,
        )  # fmt: skip
    message = str(raised.value)
    assert "1000 bytes" in message
    peaks = {
        repr(s): Plan(factory, optax.adam(1e-3), strategy=s, loss_fn=classification_loss)
        .report(shapes_of(make_batches(1)[0]))
        .memory["peak"]
        for s in strategies[:2]
    }
    for layout, peak in peaks.items():
        assert f"{layout}: a peak of" in message and f"({peak} bytes)" in message
    assert "TensorParallel(8): cannot split:" in message and "12" in message
    with nnx.use_eager_sharding(False):
        built = Net(nnx.Rngs(0))
    with pytest.raises(TypeError, match="factory"):
        auto.choose(built, optax.adam(1e-3), make_batches(1), loss_fn=classification_loss)


def _texts(logdir):
    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0}).Reload()
    return {
        tag.removesuffix("/text_summary"): acc.Tensors(tag)[0].tensor_proto.string_val[0].decode()
        for tag in acc.Tags()["tensors"]
        if tag.endswith("/text_summary")
    }


def test_tensorboard_shows_the_ranking_and_the_plan_report(tmp_path):
    trainer = Trainer(
        Net, optax.adam(1e-3), strategy=Auto(candidates=[DataParallel(), FSDP(min_size=64)],
        steps=1, rounds=1, print_fn=None), loss_fn=classification_loss,
        callbacks=[TensorBoard(tmp_path / "auto")],
    )  # fmt: skip
    trainer.fit(make_batches(2), max_steps=2)
    texts = _texts(tmp_path / "auto")
    assert texts["layout"].startswith('strategy="auto" chose ' + repr(trainer.strategy))
    assert "| DataParallel() |" in texts["layout"] and "| FSDP(min_size=64) |" in texts["layout"]
    assert "plan: " + repr(trainer.strategy) in texts["plan"]
    assert "collectives:" in texts["plan"]

    # Without auto, the plan report of the first step's batch.
    explicit = Trainer(
        Net, optax.adam(1e-3), strategy=Hybrid(FSDP(4), TensorParallel(2)),
        loss_fn=classification_loss, callbacks=[TensorBoard(tmp_path / "explicit")],
    )  # fmt: skip
    explicit.fit(make_batches(2), max_steps=2)
    texts = _texts(tmp_path / "explicit")
    assert "layout" not in texts
    assert (
        "plan: Hybrid(FSDP(4), TensorParallel(2)) on mesh {'fsdp': 4, 'model': 2}" in texts["plan"]
    )
    assert "l1/kernel" in texts["plan"] and "compiled step per device" in texts["plan"]


def test_a_trainer_that_chose_keeps_its_choice():
    trainer = Trainer(
        Net, optax.adam(1e-3),
        strategy=Auto(candidates=[FSDP(min_size=64)], steps=1, rounds=1, print_fn=None),
        loss_fn=classification_loss,
    )  # fmt: skip
    choice = trainer.choose_layout(itertools.repeat(make_batches(1)[0]))
    assert trainer.choose_layout([]) is choice
    trainer.fit(make_batches(2), max_steps=2)
    assert trainer.layout_choice is choice and trainer.step == 2
    with pytest.raises(TypeError, match="strategy='auto'"):
        Trainer(Net, optax.adam(1e-3), loss_fn=classification_loss).choose_layout([])


def test_the_cli_chooses_with_a_metrics_logger_and_names_the_budget_when_nothing_fits(
    tmp_path, capsys, monkeypatch
):
    from test_cli import load, shrink

    from nnx_spmd_trainer.app import job, loader, tasks

    @dataclasses.dataclass(frozen=True)
    class Quick(Auto):  # every default candidate, each timed on one step in one round
        steps: int = 1
        rounds: int = 1

    monkeypatch.setattr(loader, "Auto", Quick)  # the job asks the loader
    config = shrink(load("mlp"))
    config.strategy = "auto"
    result = job.run(config, tmp_path / "run")  # its MetricsLogger asks the log schedule early
    out = capsys.readouterr().out
    assert result.trainer is not None and result.trainer.layout_choice is not None
    chosen = result.trainer.layout_choice.strategy
    assert "<- chosen" in out and f"({chosen!r}, from strategy 'auto')" in out
    assert result.history.steps["train/loss"] == [1, 2]  # logged every step, as configured

    # The CLI's error when nothing fits, from one candidate: each candidate is compiled
    # to find its peak, and what is checked here is the CLI's message and that nothing is
    # written, not the listing of every candidate (test_nothing_fits_is_one_error_...).
    # The run above chose among every default candidate.
    @dataclasses.dataclass(frozen=True)
    class OneCandidate(Auto):
        candidates: Sequence[Strategy] | None = (DataParallel(),)

    monkeypatch.setattr(loader, "Auto", OneCandidate)
    config.memory_budget_bytes = 1024
    with pytest.raises(tasks.ConfigError, match=r"config.memory_budget_bytes=1024.*1024"):
        job.run(config, tmp_path / "too-small")
    assert not (tmp_path / "too-small").exists()  # refused before anything is written


def test_a_resumed_auto_run_keeps_its_layout_untimed_and_ends_as_one_run_would(tmp_path):
    """A run resumed from its checkpoint goes on in the layout it saved (taken without
    timing anything), so it ends bitwise as the uninterrupted run; a saved layout that
    is no candidate now is chosen afresh, and the state still restores."""
    data = make_batches(6)

    def trainer(strategy, *callbacks):
        return Trainer(
            Net, optax.adam(1e-2), strategy=strategy, loss_fn=classification_loss,
            callbacks=callbacks,
        )  # fmt: skip

    uninterrupted = trainer(FSDP(min_size=64))
    uninterrupted.fit(data, max_steps=6)
    saved_in = FSDP(min_size=64)
    first = trainer(
        Auto(candidates=[saved_in], steps=1, rounds=1, print_fn=None),
        OrbaxCheckpoint(tmp_path / "ckpt", save_every_n_steps=2, async_save=False),
    )
    first.fit(data, max_steps=4)
    tables: list[str] = []
    resumed = trainer(
        Auto(candidates=[DataParallel(), saved_in], steps=1, rounds=1, print_fn=tables.append),
        OrbaxCheckpoint(tmp_path / "ckpt", save_every_n_steps=2, async_save=False),
    )
    resumed.fit(data, max_steps=6)
    choice = resumed.layout_choice
    assert choice is not None and choice.resumed and resumed.strategy == saved_in
    assert [(row.status, row.times) for row in choice.rows] == [("resumed", [])]  # none timed
    assert "kept FSDP" in tables[0] and "resumed" in tables[0]
    expected = flat_params(nnx.state(uninterrupted.model))
    for path, value in flat_params(nnx.state(resumed.model)).items():
        np.testing.assert_array_equal(value, expected[path], err_msg=path)

    elsewhere = trainer(
        Auto(candidates=[DataParallel()], steps=1, rounds=1, print_fn=None),
        OrbaxCheckpoint(tmp_path / "ckpt", restore=4, save_every_n_steps=100),
    )
    elsewhere.choose_layout(data)
    assert elsewhere.layout_choice is not None and not elsewhere.layout_choice.resumed
    assert [row.status for row in elsewhere.layout_choice.rows] == ["timed"]
    elsewhere.fit(data, max_steps=6)
    assert elsewhere.strategy == DataParallel()
    assert_params_match(elsewhere, nnx.state(uninterrupted.model, nnx.Param), rtol=1e-5)


class Unannotated(nnx.Module):
    """No sharding annotation: a tensor-parallel axis would split none of it."""

    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def test_a_layout_whose_tensor_parallel_axis_splits_nothing_is_not_timed():
    # The axis is read from the strategy: a renamed one is refused by its own name.
    renamed = Hybrid(DataParallel(4), TensorParallel(2, axis="tp"))
    choice = auto.choose(
        Unannotated,
        optax.sgd(0.1),
        make_batches(1),
        loss_fn=classification_loss,
        strategies=[DataParallel(), TensorParallel(8), renamed],
        steps=1,
        rounds=1,
        time_steps=timing.time_steps,  # the engine times; auto ranks
    )
    rows = {row.layout: row for row in choice.rows}
    assert choice.strategy == DataParallel()
    for layout, axis in (("TensorParallel(8)", "'model'"), (repr(renamed), "'tp'")):
        assert rows[layout].status == "cannot split"
        assert f"annotated for the {axis} axis" in rows[layout].reason
        assert rows[layout].step_time_s is None


def test_choose_ranks_by_the_timing_it_is_handed_and_refuses_to_time_without_one():
    """auto ranks; the engine times: ``choose`` asks the ``time_steps`` it is handed for
    each fitting candidate's seconds per step, round after round, and ranks by them."""
    calls = []

    def time_steps(plan, compiled, batches):
        on_its_mesh = all(x.sharding.mesh == plan.mesh for x in jax.tree.leaves(batches))
        calls.append((plan.strategy, len(batches), on_its_mesh))
        return 2.0 if plan.strategy == DataParallel() else 1.0  # FSDP "twice as fast"

    kwargs = dict(loss_fn=classification_loss, strategies=[DataParallel(), FSDP()], steps=2)
    choice = auto.choose(
        Net, optax.sgd(0.1), make_batches(2), rounds=2, time_steps=time_steps, **kwargs
    )
    assert choice.strategy == FSDP()
    assert [(r.layout, r.step_time_s, r.ratio) for r in choice.rows] == [
        ("FSDP()", 1.0, 1.0),
        ("DataParallel()", 2.0, 2.0),
    ]
    assert calls == [(DataParallel(), 2, True), (FSDP(), 2, True)] * 3  # untimed round + 2
    with pytest.raises(TypeError, match="time_steps=nnx_spmd_trainer.engine.timing"):
        auto.choose(Net, optax.sgd(0.1), make_batches(2), rounds=1, **kwargs)


def test_a_candidate_is_traced_with_its_own_plan_and_the_trainers_run_is_untouched():
    seen = []

    class Recording(Trainer):
        def train_step(self, model, optimizer, batch):
            seen.append((self.run.plan, self.plan))  # the step is handed its plan
            return super().train_step(model, optimizer, batch)

    strategies = [DataParallel(), FSDP(min_size=64)]
    trainer = Recording(
        Net,
        optax.sgd(0.1),
        loss_fn=classification_loss,
        strategy=Auto(candidates=strategies, steps=1, rounds=1, print_fn=None),
    )
    trainer.choose_layout(make_batches(1))
    assert [plan.strategy for _, plan in seen] == strategies  # each traced once, as itself
    assert all(run_plan is None for run_plan, _ in seen)  # the trainer's run: never swapped
    assert trainer.run.plan is not None and trainer.plan is trainer.run.plan
