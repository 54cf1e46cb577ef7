"""The planner: everything decided before a step runs.

``plan`` (mesh + strategy bound together; the one compile cache), ``step`` (pure train and
eval step builders), ``state`` (state born sharded), ``plan_report`` (what a plan costs, per
device, before anything runs), ``auto`` (enumerate and rank candidate layouts).
"""
