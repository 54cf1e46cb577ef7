"""The planner: everything decided before a step runs.

- ``plan.py``: ``Plan``, a strategy bound to its mesh; the core's one asker of the strategy
- ``settings.py``: ``PlanSettings``, a plan's settings and their defaults
- ``step.py``: pure train, eval and predict steps over split state; accumulation
- ``microbatch.py``: accumulation's microbatches, cut without moving data
- ``step_compiler.py``: the plan's one cache of compiled steps
- ``state.py``: the state born sharded (``ShardedInit``) and kept live (``LiveState``)
- ``plan_report.py``: ``PlanReport``, what a plan costs per device before anything runs
- ``hlo_runs.py``: how many times each line of compiled HLO runs (a loop's body, its trips)
- ``flops.py``: a step's FLOPs, the transformer formula, ``PEAK_FLOPS`` by device
- ``flop_count.py``: the FLOPs of a step's matrix multiplies, counted from its jaxpr
- ``auto.py``: ``strategy="auto"``, candidates planned from shapes, timed, one kept
- ``auto_choice.py``: ``Candidate``, ``Choice``: what ``auto`` found
- ``auto_table.py``: ``auto``'s ranking as text
- ``backend_defaults.py``: prefetch and donation, measured per backend
- ``compile_cache.py``: JAX's persistent compilation cache (where, off, hits), per process
- ``forward.py``: ``Plan.forward_program``, forward-only programs kept per shape
- ``saved_step.py``: a compiled train step saved beside its plan, loaded for a later run
- ``target.py``: ``Target``, TPU chips (or GPUs) that are not here, compiled for there
- ``target_gpu.py``: H100s described to XLA's GPU compiler through jax's CUDA plugin
- ``target_chips.py``: HBM, FLOP/s and bandwidths per chip kind, with sources
- ``target_choice.py``: ``choose`` and ``largest_batch`` for a target
- ``target_report.py``: the plan report on a target: fits, ICI/DCN, roofline

What wraps the optimizer (EMA, spike and non-finite skipping) is ``optim/``'s.
"""
