"""WandbLogger: the run's metrics, config and plan in a W&B run that resumes with it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from typing_extensions import override

from .tracker import TrackerLogger, import_tracker


class WandbLogger(TrackerLogger):
    """Logs to Weights & Biases what TensorBoard shows, on process 0 only.

    * every value that reaches ``logs`` at its global step (``run.log(..., step=)``);
    * the run config (``trainer.config``) flattened as the run's config;
    * the plan report of the train step as the run file ``plan.txt`` and, with
      ``strategy="auto"``, the ranking of the layouts as ``layout.md``.

    A resumed run writes into the same W&B run: its id is in the callback's
    ``state_dict``, saved with every checkpoint, and the run is re-opened with
    ``resume="allow"``. Online, W&B knows the run's last step: steps the killed
    attempt logged after its last checkpoint are not logged again (the first
    attempt's values stay). Offline (``mode="offline"``), each attempt writes its own
    directory under ``dir``, with the same run id, and ``wandb sync`` puts them
    together; there a replayed step is in both.

    A W&B that fails (no network, no login) warns once and training goes on without
    it.

    Args:
      project: the W&B project (``WANDB_PROJECT`` or W&B's default for ``None``).
      mode: ``"online"``, ``"offline"`` or ``"disabled"``; ``None``: ``WANDB_MODE``,
        else online.
      name: the name of a new run.
      entity: the W&B team or user.
      dir: where W&B writes its files (``WANDB_DIR``, else the working directory).
      tags: tags of the run.
      **init_kwargs: anything else for ``wandb.init`` (``group=``, ``settings=``).

    Needs ``pip install nnx-spmd-trainer[wandb]``.

    Example::

        Trainer(..., config=config, callbacks=[
            MetricsLogger(50), OrbaxCheckpoint("runs/a/ckpt", save_every_n_steps=200),
            WandbLogger(project="gpt", name="a")])
    """

    tracker = "W&B"

    def __init__(
        self,
        project: str | None = None,
        *,
        mode: str | None = None,
        name: str | None = None,
        entity: str | None = None,
        dir: str | os.PathLike[str] | None = None,  # noqa: A002 - wandb.init's own name
        tags: list[str] | None = None,
        **init_kwargs: Any,
    ) -> None:
        super().__init__()
        import_tracker("wandb", "wandb")  # a missing package is known when the run is built
        if mode not in (None, "online", "offline", "disabled"):
            raise ValueError(
                f"WandbLogger(mode={mode!r}): use 'online', 'offline', 'disabled' or None "
                "(WANDB_MODE, else online)."
            )
        self.project = project
        self.mode = mode
        self.name = name
        self.entity = entity
        self.dir = None if dir is None else os.fspath(dir)
        self.tags = tags
        self.init_kwargs = init_kwargs
        self.run: Any = None  # the wandb Run while fit runs, on process 0

    @override
    def _open(self, run_id: str | None) -> str:
        wandb = import_tracker("wandb", "wandb")
        if self.dir is not None:
            Path(self.dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.name,
            mode=self.mode,
            dir=self.dir,
            tags=self.tags,
            id=run_id,
            resume="allow" if run_id is not None else None,
            reinit="create_new",  # two loggers, or two fits, in one process
            **self.init_kwargs,
        )
        return str(self.run.id)

    @override
    def _logged_steps(self) -> dict[str, int]:
        # W&B counts a resumed run's steps itself (``_step``): the next one it accepts.
        return {"_step": int(self.run.step) - 1}

    @override
    def _is_new(self, key: str, step: int) -> bool:
        return step > self._logged_through.get("_step", -1)  # W&B's rows are whole steps

    @override
    def _log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    @override
    def _log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    @override
    def _log_text(self, name: str, text: str) -> None:
        path = Path(self.run.dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)  # "samples/step_0000200.txt"
        path.write_text(text)
        self.run.save(str(path), base_path=self.run.dir, policy="now")

    @override
    def _close(self, failed: bool) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.finish(exit_code=1 if failed else 0)
