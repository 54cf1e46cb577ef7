"""The engine: the loop that runs a plan, the run it mutates, the callbacks it calls.

- ``loop.py``: ``Loop``, the order things happen (epochs, steps, evaluation, prediction)
- ``loop_host.py``: ``LoopHost``, what the loop is handed of the trainer, and no more
- ``run.py``: ``Run``, the one owner of a run's mutable state; its snapshots
- ``run_state.py``: ``RunState``, what a resumed run needs, as a value; ``Progress``
- ``run_access.py``: ``RunAccess``, the ``Trainer``'s members that read and write the run
- ``plan_holder.py``: ``PlanHolder``, the plan a trainer runs (given, or ``strategy="auto"``'s)
- ``metric_log.py``: the log schedule, the device metric accumulators, compile and data time
- ``step_record.py``: ``StepRecord``, what one training step hands the hooks
- ``speed.py``: ``Speed``, tokens/s, FLOP/s per device and MFU between log points
- ``hooks.py``: the hooks' no-op base, ``CallbackList``, ``History`` (``Callback``: above)
- ``predict.py``: ``Trainer.predict``'s outputs, batch by batch, padding trimmed
- ``timing.py``: a candidate layout's steps timed as ``fit`` takes them
"""
