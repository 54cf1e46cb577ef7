"""Other libraries' insides, fenced: the one module per library that touches a private name.

Everything else in the package (and ``callbacks/``) uses only public names of JAX,
Orbax and Grain, and reaches the few private ones it needs through these modules:

* ``jax_private``: the coordination service's client (its key-value store) and the
  cluster detection ``jax.distributed.initialize`` runs.
* ``orbax_private``: a JSON item written in Orbax's background commit, a
  ``CheckpointManager`` whose own preemption checks stay away from JAX's, the
  commit marker of a finished step, a step's own metadata file (a half-deleted step
  lacks it), and Orbax's notes quieted while a manager opens or a step is read.
* ``grain_private``: the layout of a Grain iterator's saved position (``next_index``)
  and of the per-process files Grain checkpoints it into.
* ``tensorboardx_private``: the ``FileWriter`` of a ``SummaryWriter``'s own event file
  (the hparams summary goes there, not into a run of its own).
* ``optax_private``: the pieces ``optax.contrib.muon`` is built from (its Newton-Schulz
  iterations, its scale by shape, its coefficient presets), which ``optim.muon`` reuses.

Each function or class names the private thing it touches and why no public API
does the job; ``tests/test_adapters.py`` checks every assumption against the
installed library and names the version it was checked against (jax 0.10.2,
orbax-checkpoint 0.12.8, grain 0.2.18, tensorboardX 2.6.5, CPython 3.11: pyproject.toml
caps Orbax and Grain at the next minor). Orbax's, Grain's and tensorboardX's are on the
allow-list of ``callbacks/`` (pyproject.toml's ``callbacks-public-names-only``); users need
not touch them. (Python's own exit handlers, which ``app/`` needs, are fenced in the app:
``app/python_private.py``, since the app imports the library's public names only.)
"""
