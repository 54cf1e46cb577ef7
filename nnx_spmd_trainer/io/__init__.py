"""What a run writes outside its checkpoints: ``export`` (parameters gathered to the
host) and ``run_lock`` (one run per work directory)."""
