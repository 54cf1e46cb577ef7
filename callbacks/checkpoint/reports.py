"""Reports: where ``OrbaxCheckpoint``'s lines go, each event through one channel only.

A user who gives ``print_fn`` reads the checkpoint's lines there (the CLI prints them);
a warning on top of the same line would say it twice. Without ``print_fn``, what needs
attention (a step set aside) is a ``RuntimeWarning``, and news (a run resumed) is not
reported at all.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable


class Reports:
    """One report per event: ``print_fn`` when given, else a warning for trouble.

    >>> lines = []
    >>> Reports(lines.append).trouble("step 4 is damaged; moved to 4.damaged.")
    >>> lines
    ['step 4 is damaged; moved to 4.damaged.']
    """

    def __init__(self, print_fn: Callable[[str], None] | None) -> None:
        self.print_fn = print_fn

    def news(self, line: str) -> None:
        """What happened as asked (resumed, preempted and saved): ``print_fn`` only."""
        if self.print_fn is not None:
            self.print_fn(line)

    def trouble(self, line: str) -> None:
        """What went wrong and how it was handled (a step set aside): ``print_fn``, or a
        ``RuntimeWarning`` without one."""
        if self.print_fn is not None:
            self.print_fn(line)
        else:
            warnings.warn(line, RuntimeWarning, stacklevel=3)
