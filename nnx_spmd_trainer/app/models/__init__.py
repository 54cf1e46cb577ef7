"""Example models, annotated for the strategies, a module each:

- ``annotations``: the mesh-axis annotation the models' initialisers carry;
- ``gpt``: a small GPT (``GPT``, ``TransformerBlock``) and its state converted between
  stacked and unrolled blocks;
- ``gpt_losses``: the GPT's losses, over the whole logits or a chunk of positions at a time;
- ``gpt2_hf``: GPT-2 as Hugging Face computes it, and the map of its files;
- ``mlp``: an MLP and a CNN.
"""

from nnx_spmd_trainer.app.models import gpt, mlp
from nnx_spmd_trainer.app.models.gpt import GPT, TransformerBlock
from nnx_spmd_trainer.app.models.mlp import CNN, MLP

__all__ = ["CNN", "GPT", "MLP", "TransformerBlock", "gpt", "mlp"]
