"""The ``nnx-spmd-train`` command's entry point: a SIGTERM is remembered from its first instant.

Importing the package (JAX, Flax, Orbax) takes seconds, and a scheduler may preempt a job
that has just started: a SIGTERM then killed the process (exit 143) before the CLI
listened. This module imports nothing before it installs a handler that remembers the
notice; the CLI hands it on (``callbacks.preemption.listen_early``), and ``fit`` acts
on it at its first check: "stopped by SIGTERM before any step", exit 0.
"""

import signal

__all__ = ["main"]


def main() -> None:
    noticed: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: noticed.append(signum))
    from nnx_spmd_trainer.app import cli  # the slow part

    cli.main(sigterm_noticed=lambda: bool(noticed))
