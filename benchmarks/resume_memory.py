"""Live device bytes while a resumed fit restores its checkpoint, in units of one state.

Eight simulated CPU devices, FSDP x TP, an MLP of 1.6M parameters with Adam:
the peak of distinct device buffers (polled from a thread) from building the
trainer to the end of the checkpoint's restore, and in the final save.

    python benchmarks/resume_memory.py
"""

import gc
import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import jax  # noqa: E402
import optax  # noqa: E402
from live_memory import PeakLiveBytes, live_bytes  # noqa: E402
from toy_models import Net, classification_loss, make_batches  # noqa: E402

from nnx_spmd_trainer import FSDP, Callback, Hybrid, TensorParallel, Trainer  # noqa: E402
from nnx_spmd_trainer.callbacks import OrbaxCheckpoint  # noqa: E402

WIDE = {"din": 512, "hidden": 1024, "dout": 16}


def main() -> None:
    directory = tempfile.mkdtemp()
    batches = make_batches(4, batch_size=16, din=WIDE["din"], classes=WIDE["dout"])

    def trainer(*callbacks: Callback) -> Trainer:
        return Trainer(
            lambda rngs: Net(rngs, **WIDE),
            optax.adam(1e-3),
            strategy=Hybrid(FSDP(4, min_size=64), TensorParallel(2)),
            loss_fn=classification_loss,
            callbacks=[OrbaxCheckpoint(directory), *callbacks],
        )

    first = trainer()
    first.fit(batches[:2], max_steps=2)
    one_state = sum(x.nbytes for x in jax.tree.leaves(first.state))
    del first
    gc.collect()  # the first run's arrays are gone before the baseline

    class RestoreEnds(Callback):
        def on_fit_start(self, logs: dict) -> None:
            restoring.stop()

    baseline = live_bytes()
    restoring = PeakLiveBytes().start()
    resumed = trainer(RestoreEnds())
    resumed.fit(batches, max_steps=3)
    fitting_after = PeakLiveBytes().start()  # the last fit's end: a step and the final save
    resumed.fit(batches, max_steps=4)
    print(
        f"one state: {one_state / 1e6:.1f} MB; live device bytes / one state: "
        f"{(restoring.stop() - baseline) / one_state:.2f} from construction to the end of "
        f"the restore, {(fitting_after.stop() - baseline) / one_state:.2f} in a step and "
        "the final save"
    )


if __name__ == "__main__":
    main()
