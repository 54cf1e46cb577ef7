"""Sampler speed against a hand-written while-loop decode of the same model, in the same run.

    python benchmarks/generate_speed.py [--devices 8] [--batches 1,8] [--prompt 32]
        [--new 32] [--rounds 301] [--out benchmarks/results] [--quick]

The model is the CLI's default job's GPT (``configs/default.py``: 2 layers, 128 wide,
8 heads, ff 512, 64 positions, the BPE's 1024 ids), laid out by that job's strategy
fitted to the devices (``fsdp=-1,model=2``: FSDP(4) x TensorParallel(2) on 8, one
device as is), with random weights: speed does not depend on them. Prompts of
``--prompt`` random tokens are continued greedily by ``--new`` tokens (no end token:
every step runs).

Two ways, each timed for **a whole call** (prompt ids in, every row's tokens and
log-probabilities on the host out):

- **library**: ``Sampler.generate`` (prefill, then the decode steps in one
  ``lax.while_loop``, one program a call: ``generate.programs``);
- **hand-written**: one ``jax.jit`` function a user would write over the same model
  and weights (as placed by the trainer): ``nnx.merge``, the model's own caches
  (``nn.kv_cache.init_caches``), the prompt in one pass, then a ``lax.while_loop`` of
  greedy steps, each keeping the token and its log-probability; the prompts placed with
  their rows split as the plan splits a batch where they divide, else replicated.

Each batch size is called once each way to compile (not timed), then ``--rounds``
rounds, each timing the library and the hand-written call back to back (which goes
first alternates): the machine's load drifts, so the ratio is read within a round,
and the median ratio is reported (with the smallest and largest), and the ratio of
each way's best round ("best / best": the least disturbed calls). Then as many calls of
a ``Sampler(phase_timing=True)`` (prefill and the loop as two programs, timed apart;
not in the ratio): prefill and decode tokens/s and the decode step's time
(``Sampler.last_timing``, ``generate.DecodeTiming``).

**Outside any program**: profiles (``jax.profiler``) of five more calls each way: the
time of the call during which no compiled program runs on any device (the XLA CPU
client's ``ThunkExecutor::Execute`` spans, any thread; the CPU only: elsewhere
``nan``), the least of the five (a loaded machine's gaps hold the time the process
waited for a core), per decode step as a share of the median decode step, and as a
share of the median whole call. The profiler's own cost is in it, and so is the CPU
runtime's own time between a while loop's iterations, which the hand-written loop
pays too: the **library's own** share is its time outside programs less the
hand-written call's.

``--out`` appends the run's table to ``generate_speed.md`` and the run to the list in
``generate_speed_<devices>dev.json``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _devices_from_argv() -> int:
    for i, arg in enumerate(sys.argv):
        if arg.startswith("--devices="):
            return int(arg.split("=", 1)[1])
        if arg == "--devices" and i + 1 < len(sys.argv):
            return int(sys.argv[i + 1])
    return 8


# The device count is fixed when JAX starts: set it before importing it.
# Simulated CPU devices, and JAX kept on the CPU where no accelerator is (the tpu-plan
# extra's libtpu would start and print its warnings); a GPU or TPU machine is left as is.
from nnx_spmd_trainer.app.host_devices import simulate_host_devices  # noqa: E402

simulate_host_devices(_devices_from_argv())

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from nnx_spmd_trainer import Sampler, Trainer  # noqa: E402
from nnx_spmd_trainer.app.models.gpt import GPT  # noqa: E402
from nnx_spmd_trainer.app.run_config import fit_to_devices, parse_strategy  # noqa: E402
from nnx_spmd_trainer.configs import default  # noqa: E402
from nnx_spmd_trainer.nn.kv_cache import init_caches  # noqa: E402

#: The trace annotation around one timed call (``outside_programs``).
CALL = "generate-speed call"
#: Profiles of each call whose least time outside programs is read (a descheduled thread
#: reads as time outside: on 2 cores five left the library's own share at 2-8% a run).
PROFILES = 11
VOCAB = 1024  # the default job's BPE (data.vocab_size), a multiple of 8 already


def default_trainer(quick: bool) -> tuple[Trainer, str]:
    """The default job's GPT, laid out by its strategy on this process's devices."""
    config = default.get_config()
    sizes = config.gpt
    spec, _ = fit_to_devices(config.strategy, jax.device_count())
    width = 32 if quick else sizes.embed_dim

    def factory(rngs: Any) -> GPT:
        return GPT(
            vocab_size=64 if quick else VOCAB, seq_len=sizes.seq_len, embed_dim=width,
            num_heads=sizes.num_heads, ff_dim=2 * width if quick else sizes.ff_dim,
            num_layers=sizes.num_layers, dropout_rate=0.0, rngs=rngs,
            scan_layers=sizes.scan_layers,
        )  # fmt: skip

    trainer = Trainer(
        factory, optax.sgd(0.1), strategy=parse_strategy(spec), loss_fn=lambda m, b: (0.0, {})
    )
    return trainer, spec


def hand_written(trainer: Trainer, batch: int, prompt: int, new: int) -> Any:
    """``call(prompts) -> (tokens, log_probs)`` on the host: one jitted prefill and
    ``lax.while_loop`` greedy decode of the trainer's model, written as a user would."""
    mesh = trainer.plan.mesh
    graphdef, state = nnx.split(trainer.model)
    length = -(-(prompt + new) // 16) * 16  # the sampler's bucket, for the same cache
    rows = tuple(a for a in trainer.plan.batch_axes() if mesh.shape[a] > 1)
    split = int(np.prod([mesh.shape[a] for a in rows]))
    placed = NamedSharding(mesh, P(rows or None, None) if batch % split == 0 else P())

    @jax.jit
    def run(state: Any, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(graphdef, state)
        model.eval()
        init_caches(model, batch, length)
        cache_graph, cache, rest = nnx.split(model, nnx.Cache, ...)
        seen = jnp.arange(length) < prompt  # [length]: the prompt's positions, then each step's
        mask = jnp.broadcast_to(seen, (batch, 1, 1, length))
        positions = jnp.broadcast_to(jnp.arange(prompt), (batch, prompt))

        def forward(cache: Any, tokens: jax.Array, positions: jax.Array, mask: jax.Array) -> Any:
            model = nnx.merge(cache_graph, cache, rest)
            logits = model(tokens, positions=positions, mask=mask)[:, -1]
            return nnx.state(model, nnx.Cache), logits

        def pick(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
            token = jnp.argmax(logits, -1).astype(jnp.int32)
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))
            return token, jnp.take_along_axis(logp, token[:, None], -1)[:, 0]

        cache, logits = forward(cache, tokens, positions, mask)
        token, logp = pick(logits)
        out = jnp.zeros((batch, new), jnp.int32).at[:, 0].set(token)
        out_logp = jnp.zeros((batch, new), jnp.float32).at[:, 0].set(logp)

        def step(carry: Any) -> Any:
            i, cache, token, out, out_logp = carry
            mask = jnp.broadcast_to(jnp.arange(length) < prompt + i, (batch, 1, 1, length))
            position = jnp.full((batch, 1), prompt + i - 1)
            cache, logits = forward(cache, token[:, None], position, mask)
            token, logp = pick(logits)
            return i + 1, cache, token, out.at[:, i].set(token), out_logp.at[:, i].set(logp)

        carry = (jnp.int32(1), cache, token, out, out_logp)
        _, _, _, out, out_logp = jax.lax.while_loop(lambda c: c[0] < new, step, carry)
        return out, out_logp

    def call(prompts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with jax.set_mesh(mesh):
            tokens, logp = run(state, jax.device_put(prompts, placed))
        return np.asarray(tokens), np.asarray(logp)

    return call


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    """The nanoseconds covered by at least one of ``intervals``."""
    covered, reach = 0, None
    for begin, end in sorted(intervals):
        if reach is None or begin > reach:
            covered, reach = covered + end - begin, end
        elif end > reach:
            covered, reach = covered + end - reach, end
    return covered


def outside_programs(call: Callable[[], Any]) -> float:
    """The nanoseconds of one ``call()`` during which no compiled program runs on any
    device (the XLA CPU client's ``ThunkExecutor::Execute`` spans, any thread), from a
    profile with the Python tracer off; ``nan`` where the profile has no such span."""
    folder = tempfile.mkdtemp(prefix="generate-speed-profile-")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    jax.profiler.start_trace(folder, profiler_options=options)
    with jax.profiler.TraceAnnotation(CALL):
        call()
    jax.profiler.stop_trace()
    (path,) = Path(folder).rglob("*.xplane.pb")
    calls, runs = [], []
    for plane in jax.profiler.ProfileData.from_file(str(path)).planes:
        for line in plane.lines:
            for event in line.events:
                if event.name == CALL:
                    calls.append((event.start_ns, event.end_ns))
                elif event.name == "ThunkExecutor::Execute":
                    runs.append((event.start_ns, event.end_ns))
    shutil.rmtree(folder, ignore_errors=True)
    if len(calls) != 1 or not runs:
        return float("nan")
    ((begin, end),) = calls
    inside = _union_ns([(max(a, begin), min(b, end)) for a, b in runs if a < end and b > begin])
    return float(end - begin - inside)


def _spread(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    return {"median": statistics.median(values), "min": values[0], "max": values[-1]}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    trainer, spec = default_trainer(args.quick)
    sampler = Sampler(trainer.model, trainer.plan)
    phased = Sampler(trainer.model, trainer.plan, phase_timing=True)
    rng = np.random.default_rng(0)
    vocab = 64 if args.quick else VOCAB
    rows = []
    for batch in args.batches:
        prompts = rng.integers(0, vocab, (batch, args.prompt)).astype(np.int32)
        hand = hand_written(trainer, batch, args.prompt, args.new)
        ours = sampler.generate(prompts.tolist(), max_new_tokens=args.new)  # compiles
        phased.generate(prompts.tolist(), max_new_tokens=args.new)  # compiles its two
        theirs = hand(prompts)  # compiles
        # The same model, the same greedy tokens (a check that both do the same work).
        same = float(np.mean(np.asarray(ours.tokens) == theirs[0]))
        runs: dict[str, list[float]] = {}
        for r in range(args.rounds):
            order = ("library", "hand") if r % 2 == 0 else ("hand", "library")
            seconds = {}
            for who in order:
                start = time.perf_counter()
                if who == "library":
                    sampler.generate(prompts.tolist(), max_new_tokens=args.new)
                else:
                    hand(prompts)
                seconds[who] = time.perf_counter() - start
            tokens = batch * args.new
            for key, value in (
                ("call_tokens_per_s", tokens / seconds["library"]),
                ("hand_tokens_per_s", tokens / seconds["hand"]),
                ("ratio", seconds["hand"] / seconds["library"]),
            ):
                runs.setdefault(key, []).append(value)
        # The phases, timed apart after the rounds (their two programs between the
        # rounds' calls would disturb the calls that follow them).
        for _ in range(args.rounds):
            phased.generate(prompts.tolist(), max_new_tokens=args.new)
            timing = phased.last_timing
            assert timing is not None and timing.decode_steps == args.new - 1
            for key, value in (
                ("prefill_tokens_per_s", timing.prefill_tokens_per_second),
                ("decode_tokens_per_s", timing.decode_tokens_per_second),
                ("decode_step_ms", 1e3 * timing.decode_seconds / timing.decode_steps),
                ("host_share", 1 - timing.decode_seconds / timing.decode_loop_seconds),
            ):
                runs.setdefault(key, []).append(value)
        row: dict[str, Any] = {
            "batch": batch,
            "rows": sampler.bucket(prompts.tolist(), args.new)[0],
        }
        row.update({key: _spread(values) for key, values in runs.items()})
        # Best of the rounds each way (timeit's reading: the least disturbed call).
        row["best_ratio"] = max(runs["call_tokens_per_s"]) / max(runs["hand_tokens_per_s"])
        row["same_tokens"] = same
        # The least of several profiles each way: on a loaded machine a profile's gaps
        # include the time this process waited for a core, which is not the sampler's.
        # The library's own share is the median of paired differences (profiles taken in
        # turns, library then hand-written), steadier than the difference of two minima.
        step_ns = 1e6 * row["decode_step_ms"]["median"]
        calls = {
            "": functools.partial(sampler.generate, prompts.tolist(), max_new_tokens=args.new),
            "hand_": functools.partial(hand, prompts),
        }
        profiled: dict[str, list[float]] = {who: [] for who in calls}
        for _ in range(2 if args.quick else PROFILES):
            for who, call in calls.items():
                profiled[who].append(outside_programs(call))
        for who, outside in profiled.items():
            tokens_per_s = row[f"{who or 'call_'}tokens_per_s"]["median"]
            row[f"{who}outside_per_step_share"] = min(outside) / (args.new - 1) / step_ns
            row[f"{who}outside_call_share"] = min(outside) / (1e9 * batch * args.new / tokens_per_s)
        own = statistics.median(a - b for a, b in zip(*profiled.values(), strict=True))
        row["own_outside_per_step_share"] = own / (args.new - 1) / step_ns
        row["program_share"] = 1 - row["outside_call_share"]
        rows.append(row)
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", "benchmarks/generate_speed.py", *sys.argv[1:]]),
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "cpu_cores": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "strategy": spec,
        "prompt_tokens": args.prompt,
        "new_tokens": args.new,
        "rounds": args.rounds,
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    def cell(value: dict[str, float], scale: float = 1.0, digits: int = 0) -> str:
        median, low, high = (scale * value[k] for k in ("median", "min", "max"))
        return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"

    header = ("batch (rows)", "library tokens/s (call)", "hand-written tokens/s",
              "library / hand-written", "best / best", "prefill tokens/s", "decode tokens/s",
              "decode step ms", "outside any program, per step, % of a step",
              "hand-written: the same", "the library's own (median of paired differences)",
              "outside any program, % of the call")  # fmt: skip
    lines = [
        f"{result['date']}, {result['devices']} {result['backend']} device(s) on "
        f"{result['cpu_cores']} cores, strategy `{result['strategy']}`, load "
        f"{result['load_average']:.1f}: `{result['command']}`",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['batch']} ({row['rows']}) | {cell(row['call_tokens_per_s'])} "
            f"| {cell(row['hand_tokens_per_s'])} | {cell(row['ratio'], digits=3)} "
            f"| {row['best_ratio']:.3f} "
            f"| {cell(row['prefill_tokens_per_s'])} | {cell(row['decode_tokens_per_s'])} "
            f"| {cell(row['decode_step_ms'], digits=3)} "
            f"| {100 * row['outside_per_step_share']:.1f} "
            f"| {100 * row['hand_outside_per_step_share']:.1f} "
            f"| {100 * row['own_outside_per_step_share']:.1f} "
            f"| {100 * row['outside_call_share']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--batches", default="1,8", help="prompts a call, comma-separated")
    parser.add_argument("--prompt", type=int, default=32, help="tokens a prompt")
    parser.add_argument("--new", type=int, default=32, help="tokens generated a prompt")
    parser.add_argument("--rounds", type=int, default=301, help="timed rounds, each both ways")
    parser.add_argument("--out", type=Path, help="append to generate_speed.md, write JSON here")
    parser.add_argument("--quick", action="store_true", help="tiny: the script runs, no more")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        args.prompt, args.new, args.rounds = 8, 4, 2
    result = measure(args)
    text = table(result)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"generate_speed_{result['devices']}dev.json"
        runs = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps([*runs, result], indent=2) + "\n")
        with open(args.out / "generate_speed.md", "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
