"""Example models, annotated for the strategies: a small GPT, an MLP and a CNN."""

from nnx_spmd_trainer.app.models import gpt, mlp
from nnx_spmd_trainer.app.models.gpt import GPT, TransformerBlock
from nnx_spmd_trainer.app.models.mlp import CNN, MLP

__all__ = ["CNN", "GPT", "MLP", "TransformerBlock", "gpt", "mlp"]
