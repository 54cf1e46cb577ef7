"""Renamed names keep working for a release, warning once and naming the new spelling."""

import warnings

import optax
import pytest
from toy_models import Net, classification_loss

from nnx_spmd_trainer import Auto, Trainer, deprecation
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint


def caught_once(old, use):
    """What ``use()`` returns, after checking it warned once that ``old`` is deprecated."""
    deprecation._warned.discard(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = use()
        use()  # a second use does not warn again
    (warning,) = caught
    assert warning.category is DeprecationWarning and old in str(warning.message)
    return value, str(warning.message)


def test_the_metric_accumulators_were_called_report():
    trainer = Trainer(Net, optax.sgd(0.1), loss_fn=classification_loss)
    value, message = caught_once("Trainer.report", lambda: trainer.report)
    assert value is trainer.metric_log and "trainer.metric_log" in message
    value, message = caught_once("Run.report", lambda: trainer.run.report)
    assert value is trainer.run.metric_log and "run.metric_log" in message


def test_the_print_sinks_were_called_report(tmp_path):
    lines = []
    auto, message = caught_once("Auto(report=...)", lambda: Auto(report=lines.append))
    assert auto.print_fn == lines.append and "Auto(print_fn=...)" in message
    assert caught_once("Auto.report", lambda: auto.report)[0] == lines.append
    checkpoint, message = caught_once(
        "OrbaxCheckpoint(report=...)",
        lambda: OrbaxCheckpoint(tmp_path, report=lines.append),
    )
    assert checkpoint.print_fn == lines.append and "OrbaxCheckpoint(print_fn=...)" in message
    with pytest.raises(TypeError, match="print_fn= only"):
        Auto(report=print, print_fn=print)
