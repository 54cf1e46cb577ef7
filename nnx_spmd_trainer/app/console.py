"""The run's report on stdout: one line at a time, from process 0 only."""

from __future__ import annotations

import sys

import jax
from tqdm.auto import tqdm


def say(line: str) -> None:
    """A line of the run's report, from process 0 only."""
    if jax.process_index() == 0:
        tqdm.write(line, file=sys.stdout)  # does not tear a progress bar on a terminal
