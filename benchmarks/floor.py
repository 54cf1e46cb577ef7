"""The floor every trainer timing is a ratio to: the fastest hand-written ``jax.jit`` loop.

One definition, shared by ``trainer_overhead.py`` and ``run_all.py``. The loop is
the Flax performance guide's functional one (split state, ``jax.jit``,
``nnx.merge`` inside, the loss averaged on the devices as the trainer's
metrics are, two steps in flight), written four ways: state donated or not,
batches placed on the main thread or by a thread ahead of the steps. Which is
fastest depends on the backend and the load (donation costs on the CPU, a
placement thread pays when the host has a core to spare), so all four run and
the floor is the fastest of them, measured in the same interleaved rounds as
what is compared with it.
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
from clu import metrics as clu_metrics
from flax import nnx

Loss = clu_metrics.Collection.create(loss=clu_metrics.Average.from_output("loss"))
PREFIX = "hand-written jax.jit"


def _placed_by_a_thread(batches: list[dict], place: Callable[[dict], Any]) -> Iterator[Any]:
    """The batches placed by a thread, two ahead of the loop that takes them."""
    ready: queue.Queue[Any] = queue.Queue(maxsize=2)
    worker = threading.Thread(target=lambda: [ready.put(place(b)) for b in batches], daemon=True)
    worker.start()
    for _ in batches:
        yield ready.get()
    worker.join()


def hand_written_loops(
    trainer: Any, batches: list[dict], loss_fn: Callable[..., Any]
) -> dict[str, Callable[[], float]]:
    """``{name: run}``: each ``run()`` trains ``batches`` once from a copy of ``trainer``'s
    state (its layout, already sharded) and returns seconds per step."""
    graphdef, live = nnx.split({"model": trainer.model, "optimizer": trainer.optimizer})
    initial = jax.tree.map(lambda x: x.copy(), live)  # the trainer's next step donates `live`
    shardings = trainer.plan.shardings
    batch_sharding = trainer.plan.batch_shardings(batches[0])

    def step(state: Any, metrics: Any, batch: dict) -> Any:
        objects = nnx.merge(graphdef, state)
        model, optimizer = objects["model"], objects["optimizer"]
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m, batch)[0])(model)
        optimizer.update(model, grads)
        return nnx.state(objects), metrics.merge(Loss.single_from_model_output(loss=loss)), loss

    def loop(donate: bool, thread: bool) -> Callable[[], float]:
        jitted = jax.jit(
            step, donate_argnums=(0, 1) if donate else (), out_shardings=(shardings, None, None)
        )
        place = lambda batch: jax.device_put(batch, batch_sharding)  # noqa: E731

        def run() -> float:
            state = jax.device_put(jax.tree.map(lambda x: x.copy(), initial), shardings)
            metrics = Loss.empty()
            with jax.set_mesh(trainer.mesh):
                state, metrics, loss = jitted(state, metrics, place(batches[0]))
                jax.block_until_ready(loss)
                start, pending = time.perf_counter(), []
                placed = _placed_by_a_thread(batches, place) if thread else map(place, batches)
                for batch in placed:
                    state, metrics, loss = jitted(state, metrics, batch)
                    pending.append(loss)
                    if len(pending) > 2:  # the trainer's default in-flight bound
                        pending.pop(0).block_until_ready()
                jax.block_until_ready(state)
                float(metrics.compute()["loss"])
            return (time.perf_counter() - start) / len(batches)

        return run

    return {
        f"{PREFIX} ({'donating' if donate else 'copying'}, "
        f"{'placed by a thread' if thread else 'placed inline'})": loop(donate, thread)
        for donate in (True, False)
        for thread in (False, True)
    }


def interleaved_rounds(loops: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[Any]]:
    """Seconds per step of each loop in each round, after one untimed round (compiles and
    first-call caches).

    A shared machine's speed drifts slowly: one loop's time swings by 40% over a minute,
    and two runs a second apart are 0.9 correlated (2026-11-29, 2 cores). So each round
    runs the loops forward and then backward (A B C C B A) and takes each loop's mean:
    a drift that is linear over the round adds the same to every loop and cancels in
    their ratio, whatever the order. The order also rotates from round to round. A loop
    may return a tuple of timings (wall and CPU seconds): each is averaged."""
    for run in loops.values():
        run()
    names = list(loops)
    times: dict[str, list[Any]] = {name: [] for name in loops}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        forward = {name: loops[name]() for name in order}
        for name in reversed(order):
            times[name].append(_mean_of_two(forward[name], loops[name]()))
    return times


def _mean_of_two(a: Any, b: Any) -> Any:
    if isinstance(a, tuple):
        return tuple((x + y) / 2 for x, y in zip(a, b, strict=True))
    return (a + b) / 2


def interleaved(loops: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Median seconds per step of each loop over ``interleaved_rounds``."""
    times = interleaved_rounds(loops, rounds)
    return {name: statistics.median(values) for name, values in times.items()}


def paired_ratio(times: list[float], floor_times: list[float]) -> float:
    """The median over rounds of each round's ratio: two loops run back to back in a
    round share that moment's load, so their ratio drifts less than either time does."""
    return statistics.median([t / f for t, f in zip(times, floor_times, strict=True)])


def floor(medians: dict[str, float]) -> tuple[str, float]:
    """The fastest hand-written loop of ``medians``: (its name, its seconds per step)."""
    hand = {name: seconds for name, seconds in medians.items() if name.startswith(PREFIX)}
    name = min(hand, key=hand.__getitem__)
    return name, hand[name]


def held_out_ratio(times: dict[str, list[float]], ours: str) -> tuple[str, float]:
    """``ours`` against the floor with the floor chosen on other rounds than those read.

    ``floor`` picks the fastest hand loop by the medians of the very rounds the ratio is
    then read on: where the hand loops are within noise of each other (the CPU), that
    minimum is biased low. Here the even rounds choose the floor and the ratio is the
    median of the odd rounds' per-round ratios. Returns (the floor's name, the ratio)."""
    even = {name: values[0::2] for name, values in times.items()}
    name, _ = floor({name: statistics.median(values) for name, values in even.items()})
    return name, paired_ratio(times[ours][1::2], times[name][1::2])
