"""The engine: the loop that runs a plan, the run it mutates, the callbacks it calls.

``loop`` (the order things happen), ``run`` and ``run_state`` (every mutable piece of a
run, and its checkpointable snapshot), ``metric_log`` (device accumulators, reported at log
points), ``callback`` (``Callback``, ``CallbackList``), ``predict``, and ``layout`` (the
plan a ``Trainer`` runs, given or chosen by ``strategy="auto"``).
"""
