"""``nnx-spmd-train lm_eval``: lm-evaluation-harness tasks scored on a workdir's
checkpoint, on the mesh the run trained on; nothing trained and nothing written.

    nnx-spmd-train lm_eval runs/dpo --tasks hellaswag --limit 100
    nnx-spmd-train lm_eval runs/sft --tasks my_task --include_path tasks/ --step 200

The model, tokenizer and layout are the run's (``loader.load_run``: any run, a DPO or
GRPO run's too); lm_eval's requests are scored through ``HarnessLM``. ``--include_path``
names a folder of task YAML files (local tasks, over local data): only those are then
indexed, not lm_eval's thousands of shipped ones (``--include_defaults`` adds them).
It prints one line per task and metric (``--json``: the results as one JSON line on
stdout, everything else on stderr). Each refusal is one line on stderr and exit status 2.
Needs the ``lm-eval`` extra: ``pip install 'nnx-spmd-trainer[lm-eval]'``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import nnx_spmd_trainer

# callbacks/ is mapped onto nnx_spmd_trainer.callbacks at install time; mypy reads the tree.
from nnx_spmd_trainer.app import loader, tasks
from nnx_spmd_trainer.app.command_line import OneLineParser, checkpoint_step, fail
from nnx_spmd_trainer.app.console import say
from nnx_spmd_trainer.app.host_devices import simulate_host_devices

__all__ = ["evaluate_tasks", "main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    commands = OneLineParser(
        prog="nnx-spmd-train lm_eval",
        description="Score a workdir's checkpoint on lm-evaluation-harness tasks (trains "
        "nothing, writes nothing).",
    )
    add = commands.add_argument
    add("workdir", help="the --workdir of a run (its config.json, checkpoints/)")
    add("--tasks", required=True, help="task names, comma-separated")
    add("--include_path", default=None, help="a folder of task YAML files (local tasks)")
    add("--include_defaults", action="store_true",
        help="with --include_path, lm_eval's shipped tasks indexed too")  # fmt: skip
    add(
        "--step",
        type=checkpoint_step,
        default="latest",
        help="latest (default), best or a step number",
    )
    add("--limit", type=int, default=None, help="at most this many examples a task")
    add("--num_fewshot", type=int, default=None, help="examples in each prompt")
    add("--batch_size", type=int, default=8, help="rows scored per compiled call")
    add("--json", action="store_true", help="the results as one JSON line on stdout")
    return commands


class _TextOf:
    """A chat run's codec as lm_eval's text codec: its text encoded as it is
    (``encode_text``), not rendered as a conversation."""

    def __init__(self, codec: Any) -> None:
        self.codec = codec
        self.eos_id = getattr(codec, "eos_id", None)

    def encode(self, text: str) -> list[int]:
        return list(self.codec.encode_text(text))

    def decode(self, ids: Any) -> str:
        return str(self.codec.decode(ids))


def evaluate_tasks(
    workdir: str | os.PathLike[str],
    task_names: Sequence[str],
    *,
    step: int | str = "latest",
    include_path: str | os.PathLike[str] | None = None,
    include_defaults: bool = False,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    print_fn: Callable[[str], None] = say,
) -> dict[str, dict[str, Any]]:
    """lm_eval's results of ``task_names`` (``{task: {metric: value}}``) on ``workdir``'s
    checkpoint ``step``, its model read by ``loader.load_run``."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise tasks.ConfigError(
            "lm_eval needs lm-evaluation-harness: pip install 'nnx-spmd-trainer[lm-eval]'"
        ) from None
    if include_path is not None and not Path(include_path).is_dir():
        raise tasks.ConfigError(f"--include_path={include_path}: there is no folder there.")
    manager = TaskManager(
        include_path=None if include_path is None else str(include_path),
        include_defaults=include_defaults or include_path is None,
    )
    unknown = [name for name in task_names if name not in manager.all_tasks]
    if unknown:
        where = f" in {include_path}" if include_path is not None else ""
        raise tasks.ConfigError(
            f"--tasks: {', '.join(unknown)} is not a task lm_eval knows{where}; "
            "name a task, or give --include_path DIR with its YAML file."
        )
    run = loader.load_run(workdir, step=step, print_fn=print_fn)
    if run.tokenizer is None:
        raise tasks.ConfigError(
            f"{workdir}: its task (config.model={run.config.model!r}) is not text; lm_eval "
            "scores a language model (gpt, gpt2_hf)."
        )
    codec = _TextOf(run.tokenizer) if hasattr(run.tokenizer, "encode_text") else run.tokenizer
    model = nnx_spmd_trainer.HarnessLM(run.trainer, codec, batch_size=batch_size)
    print_fn(f"lm_eval: {', '.join(task_names)} on {run.source}")
    results = lm_eval.simple_evaluate(
        model=model,
        tasks=list(task_names),
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
    )
    scores: dict[str, dict[str, Any]] = results["results"] if results else {}
    return scores


def _lines(scores: dict[str, dict[str, Any]]) -> list[str]:
    """One line a task: its metrics (lm_eval's ``acc,none`` read as ``acc``)."""
    lines = []
    for task, metrics in sorted(scores.items()):
        shown = [
            f"{name.removesuffix(',none')}={value:.4f}"
            for name, value in sorted(metrics.items())
            if "," in name
            and isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
        ]  # fmt: skip  (lm_eval's metrics are "name,filter"; sample_len, alias are not)
        lines.append(f"{task}: {' '.join(shown)}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Prints each task's scores; returns 0, or exits 2 with one line."""
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    workdir = Path(args.workdir)
    names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    if not names:
        fail("lm_eval: --tasks names no task; give one or more, comma-separated.")
    if not loader.saved_steps(workdir):
        fail(
            f"lm_eval: no checkpoint in {workdir / 'checkpoints'}: train first "
            f"(nnx-spmd-train --workdir={workdir}), or name the workdir of a run that saved one."
        )
    for key in ("limit", "batch_size"):
        value = getattr(args, key)
        if value is not None and value < 1:
            fail(f"lm_eval: --{key}={value}; it must be >= 1.")
    try:
        config = loader.run_config(workdir)
    except tasks.ConfigError as error:
        fail(f"lm_eval: {error}")
    simulate_host_devices(config.get("num_devices", 8))  # before JAX starts its backend
    note = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else say
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # lm_eval forks: no warning
    try:
        scores = evaluate_tasks(
            workdir, names, step=args.step, include_path=args.include_path,
            include_defaults=args.include_defaults, limit=args.limit,
            num_fewshot=args.num_fewshot, batch_size=args.batch_size, print_fn=note,
        )  # fmt: skip
    except loader.NOT_READ as error:
        fail(f"lm_eval: {error}")
    if args.json:
        print(json.dumps(scores, default=str), flush=True)
    else:
        for line in _lines(scores):
            say(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
