"""``python -m nnx_spmd_trainer``: the same as ``nnx-spmd-train``."""

from nnx_spmd_trainer.app.cli import main

if __name__ == "__main__":
    main()
