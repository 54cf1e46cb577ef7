"""EvalHarnessCallback: lm-evaluation-harness tasks scored while a run trains."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import Any

from nnx_spmd_trainer import Callback, Logs


class EvalHarnessCallback(Callback):
    """Every ``every_n_steps`` steps (and at the end of training), runs ``tasks`` of
    lm-evaluation-harness against the model being trained, on its mesh
    (``generate.harness.HarnessLM``), and hands the scores to the run's writers
    (TensorBoard, CSV, MLflow, W&B) as ``lm_eval/<task>/<metric>``.

    Args:
      tasks: lm_eval task names (``["hellaswag"]``, or tasks of ``include_path``).
      every_n_steps: the steps evaluated at (``step % every_n_steps == 0``).
      tokenizer: the run's tokenizer (``encode``/``decode``, ``eos_id``).
      include_path: a folder of task YAML files (local tasks, offline).
      limit: at most this many examples per task (lm_eval's ``limit``).
      harness_options: more keywords for ``HarnessLM`` (``batch_size``, ``prefix_token``,
        ``forward``...).
      print_fn: one console line per evaluation; ``None``: silent.

    Every process runs the tasks (the forward passes run on the whole mesh) and gets the
    same scores; the writers log them from process 0 as they do every metric.

    Attributes:
      scores: ``(step, {name: value})`` of every evaluation so far.
    """

    def __init__(
        self,
        tasks: Sequence[str],
        *,
        every_n_steps: int,
        tokenizer: Any,
        include_path: str | os.PathLike[str] | None = None,
        limit: int | float | None = None,
        harness_options: dict[str, Any] | None = None,
        print_fn: Callable[[str], None] | None = print,
    ) -> None:
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(
                f"EvalHarnessCallback: every_n_steps={every_n_steps}; it must be >= 1."
            )
        if not tasks:
            raise ValueError("EvalHarnessCallback: no tasks; name at least one lm_eval task.")
        if importlib.util.find_spec("lm_eval") is None:  # said now, not at step N
            raise ImportError(
                "EvalHarnessCallback needs lm-evaluation-harness, which is not installed: "
                "pip install 'nnx-spmd-trainer[lm-eval]'"
            )
        import nnx_spmd_trainer

        self._harness_lm = nnx_spmd_trainer.HarnessLM
        self.tasks = list(tasks)
        self.every_n_steps = every_n_steps
        self.tokenizer = tokenizer
        self.include_path = None if include_path is None else os.fspath(include_path)
        self.limit = limit
        self.harness_options = dict(harness_options or {})
        self.print_fn = print_fn
        self.scores: list[tuple[int, dict[str, float]]] = []
        self._model: Any = None
        self._task_manager: Any = None
        self._evaluated_at: int | None = None

    def evaluate(self) -> dict[str, float]:
        """The tasks' scores for the model as it is now, ``{"lm_eval/<task>/<metric>": v}``."""
        import lm_eval
        from lm_eval.tasks import TaskManager

        if self._model is None:
            self._model = self._harness_lm(self.trainer, self.tokenizer, **self.harness_options)
        if self._task_manager is None:  # built once: it indexes every YAML lm_eval ships (~5 s)
            self._task_manager = TaskManager(include_path=self.include_path)
        results = lm_eval.simple_evaluate(
            model=self._model,
            tasks=self.tasks,
            task_manager=self._task_manager,
            limit=self.limit,
            log_samples=False,
            verbosity="ERROR",
        )
        scores = {}
        for task, metrics in results["results"].items():
            for key, value in metrics.items():
                metric, _, _filter = key.partition(",")
                number = isinstance(value, int | float) and not isinstance(value, bool)
                if number and not metric.endswith("_stderr"):
                    scores[f"lm_eval/{task}/{metric}"] = float(value)
        return scores

    def _run(self, step: int) -> None:
        scores = self.evaluate()
        self.scores.append((step, scores))
        self._evaluated_at = step
        if self.print_fn is not None:
            shown = ", ".join(f"{k.removeprefix('lm_eval/')}={v:.4g}" for k, v in scores.items())
            self.print_fn(f"lm_eval at step {step}: {shown}")
        self.trainer.callbacks.on_logs(step, scores)

    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        if step % self.every_n_steps == 0:
            self._run(step)

    def on_train_end(self, logs: Logs) -> None:
        step = self.trainer.step
        if self._evaluated_at != step:
            self._run(step)
