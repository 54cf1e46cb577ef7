"""tensorboardX's insides that the TensorBoard callback needs, in one place (checked
against tensorboardX 2.6.5).

Public to ``callbacks/`` (``TensorBoard``). ``tests/test_adapters.py`` checks the
assumption against the installed tensorboardX.
"""

from __future__ import annotations

from typing import Any

from tensorboardX import SummaryWriter


def event_file_writer(writer: SummaryWriter) -> Any:
    """The ``FileWriter`` of ``writer``'s own event file (made when not yet), to which a
    ready ``Summary`` proto is added with ``add_summary(summary, step)``.

    Private (``SummaryWriter._get_file_writer``) because the public ``add_hparams``
    writes into a new run of its own, which repeats the scalars under a second name;
    the hparams summary belongs in the run's own event file."""
    return writer._get_file_writer()
