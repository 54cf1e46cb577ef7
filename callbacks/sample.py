"""SampleCallback: what the model says while it trains, from fixed prompts."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
from tensorboardX import SummaryWriter

from nnx_spmd_trainer import Callback, Generation, Logs, Sampler, Sampling

from .tensorboard import event_file_suffix
from .tracker import TrackerLogger


class SampleCallback(Callback):
    """Every ``every_n_steps`` steps, continues ``prompts`` with the model being trained
    (``Sampler`` on the trainer's mesh and plan) and reports the text from process 0: one
    console line per prompt (``print_fn``); with ``logdir``, TensorBoard's text plugin
    (tag ``samples/<i>``); and, where the run has an ``MLflowLogger`` or a
    ``WandbLogger``, a file ``samples/step_<step>.txt`` in its tracker run. The sampler's
    speed goes to every writer as ``sample/prefill_tokens_per_s`` and
    ``sample/decode_tokens_per_s``. The training state is only read, so the run's losses
    are those of a run without it, bitwise.

    Args:
      prompts: text (with a ``tokenizer``) or token ids.
      every_n_steps: the steps sampled at (``step % every_n_steps == 0``).
      max_new_tokens, temperature, top_k, top_p, seed, end_token, stop: as
        ``Sampler.generate``; the seed is the same at every step, so samples differ
        only as the weights do.
      sampling: a ``Sampling`` (temperature, top_k, top_p in one value) instead of
        those three keywords; giving both is refused.
      tokenizer: encodes text prompts and decodes the samples (``encode``/``decode``);
        without one the text logged is the token ids.
      logdir: where the TensorBoard text goes (its own event file beside the
        ``TensorBoard`` callback's); ``None``: the console only.
      print_fn: the console; ``None``: silent.

    Attributes:
      samples: ``(step, Generation)`` of every sampling so far.

    Example::

        trainer.fit(batches, max_steps=1000, callbacks=[
            SampleCallback(["Once upon a time"], every_n_steps=200, tokenizer=tokenizer,
                           logdir="runs/a", max_new_tokens=48,
                           sampling=Sampling(temperature=0.8, top_p=0.95))])
    """

    def __init__(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        *,
        every_n_steps: int,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        end_token: int | None = None,
        stop: Sequence[str] = (),
        sampling: Sampling | None = None,
        tokenizer: Any = None,
        logdir: str | os.PathLike[str] | None = None,
        print_fn: Callable[[str], None] | None = print,
    ) -> None:
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"SampleCallback: every_n_steps={every_n_steps}; it must be >= 1.")
        if not prompts:
            raise ValueError("SampleCallback: no prompts; give at least one.")
        if sampling is None:
            sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
        elif (temperature, top_k, top_p) != (0.0, 0, 1.0):
            raise TypeError(
                "SampleCallback: give either sampling= or temperature/top_k/top_p, not both."
            )
        self.prompts = prompts
        self.sampling = sampling
        self.every_n_steps = every_n_steps
        self.options: dict[str, Any] = {
            "max_new_tokens": max_new_tokens, "temperature": sampling.temperature,
            "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": seed,
            "end_token": end_token, "stop": tuple(stop),
        }  # fmt: skip
        self.tokenizer = tokenizer
        self.logdir = None if logdir is None else os.fspath(logdir)
        self.print_fn = print_fn
        self.samples: list[tuple[int, Generation]] = []
        self._sampler: Sampler | None = None
        self._writer: SummaryWriter | None = None

    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        if step % self.every_n_steps:
            return
        if self._sampler is None:  # the plan and mesh are the trainer's from its first step
            self._sampler = Sampler(
                self.trainer.model,
                self.trainer.plan,
                tokenizer=self.tokenizer,
                print_fn=self.print_fn,
                phase_timing=True,  # the run's logs show prefill and decode speeds apart
            )
        out = self._sampler.generate(self.prompts, **self.options)
        self.samples.append((step, out))
        if jax.process_index() == 0:
            self._report(step, out)
        speed = {
            "sample/prefill_tokens_per_s": out.prefill_tokens_per_second,
            "sample/decode_tokens_per_s": out.decode_tokens_per_second,
        }
        self.trainer.callbacks.on_logs(step, speed)  # the writers log from process 0

    def _texts(self, out: Generation) -> list[str]:
        return out.text if out.text is not None else [" ".join(map(str, t)) for t in out.tokens]

    def _report(self, step: int, out: Generation) -> None:
        for i, (prompt, text) in enumerate(zip(self.prompts, self._texts(out), strict=True)):
            if self.print_fn is not None:
                self.print_fn(f"sample {i} at step {step}: {prompt!r} -> {text!r}")
            if self.logdir is not None:
                if self._writer is None:
                    self._writer = SummaryWriter(
                        self.logdir, filename_suffix=event_file_suffix(".samples")
                    )
                self._writer.add_text(f"samples/{i}", f"{prompt} → {text}", step)
        if self._writer is not None:
            self._writer.flush()
        trackers = [c for c in self.trainer.callbacks.callbacks if isinstance(c, TrackerLogger)]
        if trackers:
            page = "\n\n".join(
                f"{prompt!r} -> {text!r}"
                for prompt, text in zip(self.prompts, self._texts(out), strict=True)
            )
            for tracker in trackers:
                tracker.log_text(f"samples/step_{step:07d}.txt", page + "\n")

    def on_train_end(self, logs: Logs) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
