"""Python's own insides that a prompt exit after Ctrl-C needs, in one place (checked against
CPython 3.11).

The app's own fence, as ``adapters/`` is the core's: ``app/`` imports only the library's
public names, so Python's private name it needs lives here (``app/interrupts.py`` uses it).
``tests/test_adapters.py`` checks the assumption against the running Python.
"""

from __future__ import annotations

import atexit


def run_exit_handlers() -> None:
    """Runs the functions registered with ``atexit`` (JAX's, the logs'), once, now.

    Private (``atexit._run_exitfuncs``) because the public ways to run them are ``sys.exit``
    and a normal return, and both first wait for every non-daemon thread
    (``threading._shutdown``): after Ctrl-C inside an Orbax save, one of its threads may
    wait forever. The handlers are cleared after they ran, so a later exit does not run
    them again."""
    atexit._run_exitfuncs()
