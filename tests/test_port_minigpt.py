"""The JAX AI Stack miniGPT (``examples/port_minigpt.py``), a model the library did not write,
trains through the ``Trainer`` to its own ``nnx.jit`` loop's losses, in the tutorial's layout.

Speed lives in ``benchmarks/minigpt_overhead.py``; this checks only what it trains to.
"""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

SCRIPT = Path(__file__).parent.parent / "examples" / "port_minigpt.py"


def load_port():
    spec = importlib.util.spec_from_file_location("port_minigpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclass looks its module up there
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def test_the_minigpt_port_trains_to_its_own_loops_losses_in_its_own_layout():
    port = load_port()  # its mesh: 4 "batch" x 2 "model", as the tutorial's
    sizes = dataclasses.replace(
        port.TINY, embed_dim=32, feed_forward_dim=32, num_transformer_blocks=1, steps=16
    )
    batches = port.token_batches(sizes)
    tutorial = port.tutorial_loop(sizes, batches)  # the tutorial's @nnx.jit loop
    trainer = port.ported_trainer(sizes)
    ported = trainer.fit(batches, max_steps=sizes.steps).history["train/loss"]
    assert len(tutorial) == len(ported) == sizes.steps // port.LOG_EVERY
    np.testing.assert_allclose(ported, tutorial, rtol=1e-6)
    assert ported[-1] < ported[0]
    # Laid out as the tutorial's NamedSharding annotations say, on the trainer's mesh.
    assert dict(trainer.mesh.shape) == {"batch": 4, "model": 2}
    model = trainer.model
    assert model.output_layer.kernel[...].sharding.spec == P(None, "model")
    assert model.transformer_blocks[0].linear1.bias[...].sharding.spec == P("model")
    # The unannotated token table: its features over "model", the layout XLA gives it
    # under the tutorial's nnx.jit loop (TensorParallel's split of a large matrix).
    table = nnx.state(model, nnx.Param)["embedding_layer"]["token_emb"]["embedding"]
    assert table[...].sharding.spec == P(None, "model")
