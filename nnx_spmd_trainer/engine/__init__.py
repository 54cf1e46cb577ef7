"""The engine: the loop that runs a plan, the run it mutates, the callbacks it calls.

``loop`` (the order things happen), ``run`` and ``run_state`` (every mutable piece of a
run, and its checkpointable snapshot), ``metric_log`` (device accumulators, reported at log
points), ``hooks`` (the hooks' base, ``CallbackList``, ``History``: the user's ``Callback``
is ``nnx_spmd_trainer.callback``, above the trainer), ``predict``, and ``layout`` (the
plan a ``Trainer`` runs, given or chosen by ``strategy="auto"``).
"""
