"""A small GPT: the seed's GPT-2 TransformerBlock, annotated for tensor parallelism.

Annotations are physical mesh-axis names, as the seed writes them
(``nnx.with_metadata(init, sharding=(...))``); an axis the current mesh lacks
replicates that dimension, so one model runs under every strategy. Unlike the
seed, which splits dimension 0 of every kernel, the block is laid out the
Megatron way: the query/key/value and first feed-forward projections are split
along their output (heads, ff) dimension and the output projections along
their input dimension, so each device computes whole heads and a slice of the
feed-forward layer. The sharded dimensions (``num_heads``, ``ff_dim``, the
padded vocabulary, and ``embed_dim`` for the layer norms, kept sharded as the
seed has them) must be divisible by the ``model`` axis size.

Mixed precision: ``dtype`` is the compute dtype (``jnp.bfloat16`` for speed on
GPUs and TPUs) and ``param_dtype`` the parameters' (fp32 master weights; the
optimizer state follows the parameters); the logits come back in fp32.
Attention is ``nnx_spmd_trainer.nn.attention.causal_attention``:
``jax.nn.dot_product_attention`` with a causal mask, cuDNN's fused kernel on a
GPU computing in bf16/fp16, XLA's everywhere else; exact under
``SequenceParallel`` too (keys and values gathered along the split sequence),
with the position embedding read at global positions.

Packed rows: a batch with ``segment_ids`` (``[batch, seq]``, 0 = padding) and
``positions`` (restarting at 0 at each document) keeps every document to itself:
the attention masks other segments (``causal_attention(..., segment_ids=...)``),
the position embedding is read at ``positions``, and ``loss_fn`` (``target_weights``,
in ``gpt_losses``) counts no padding target and no target across a document boundary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_spmd_trainer import moe as moe_lib
from nnx_spmd_trainer import remat as remat_lib
from nnx_spmd_trainer import stack as stack_lib
from nnx_spmd_trainer.app.models.annotations import MODEL, annotated

# The losses live in gpt_losses.py; named here too, where callers have always found them.
from nnx_spmd_trainer.app.models.gpt_losses import chunked_loss_fn, loss_fn
from nnx_spmd_trainer.nn import (
    MaskedAttention,
    attention_implementation,
    causal_attention,
    packed_inputs,
    set_cache_mask,
    target_weights,
)

LAYERS = stack_lib.LAYERS  # the stacked layer dimension's logical name

__all__ = [
    "GPT",
    "LAYERS",
    "TransformerBlock",
    "attention_implementation",
    "causal_attention",
    "chunked_loss_fn",
    "loss_fn",
    "packed_inputs",
    "stack_blocks",
    "target_weights",
    "stacked_blocks",
    "unstack_blocks",
]


def _layer_norm(num_features: int, rngs: nnx.Rngs, dtype: jnp.dtype) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        epsilon=1e-6,
        num_features=num_features,
        scale_init=annotated(nnx.initializers.ones_init(), MODEL),
        bias_init=annotated(nnx.initializers.zeros_init(), MODEL),
        dtype=dtype,
        rngs=rngs,
    )


class TransformerBlock(nnx.Module):
    """The seed's GPT-2 block: pre-norm causal self-attention and a gelu MLP.

    Dropout follows ``model.train()`` / ``model.eval()`` (the Trainer sets them).

    >>> with nnx.use_eager_sharding(False):  # outside a mesh; the Trainer builds it inside one
    ...     block = TransformerBlock(64, 8, 256, 0.1, rngs=nnx.Rngs(0))
    >>> block.eval()
    >>> block(jnp.ones((2, 16, 64))).shape
    (2, 16, 64)
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        ff_dim: int,
        dropout_rate: float,
        rngs: nnx.Rngs,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        moe_experts: int = 0,
        moe_top_k: int = 2,
        moe_capacity_factor: float | None = 1.25,
    ) -> None:
        xavier = nnx.initializers.xavier_uniform()
        zeros = nnx.initializers.zeros_init()
        precision: dict[str, Any] = {"dtype": dtype, "param_dtype": param_dtype}
        self.layer_norm1 = _layer_norm(embed_dim, rngs, dtype)
        self.mha = MaskedAttention(  # nnx.MultiHeadAttention; decoding, hides padding
            num_heads=num_heads,
            in_features=embed_dim,
            attention_fn=causal_attention,
            **precision,
            # query/key/value kernels are (embed, heads, head_dim): split the heads.
            kernel_init=annotated(xavier, None, MODEL),
            bias_init=annotated(zeros, MODEL),
            # the output kernel is (heads, head_dim, embed): split the heads again.
            out_kernel_init=annotated(xavier, MODEL),
            # (None,): replicated as unannotated, but annotated so that a stacked copy's
            # layer dimension is marked (see GPT's scan_layers)
            out_bias_init=annotated(zeros, None),
            keep_rngs=False,  # no attention dropout: the block's own Dropouts carry the RNG
            decode=False,  # nn.kv_cache.init_caches turns it on in a sampler's copy
            rngs=rngs,
        )
        self.dropout1 = nnx.Dropout(dropout_rate, rngs=rngs)
        self.layer_norm2 = _layer_norm(embed_dim, rngs, dtype)
        if moe_experts:  # a mixture of experts in place of the MLP (moe.MoE)
            self.moe = moe_lib.MoE(
                embed_dim, ff_dim, moe_experts, top_k=moe_top_k,
                capacity_factor=moe_capacity_factor, rngs=rngs, **precision,
            )  # fmt: skip
            self.dropout2 = nnx.Dropout(dropout_rate, rngs=rngs)
            return
        self.linear1 = nnx.Linear(
            in_features=embed_dim,
            out_features=ff_dim,
            kernel_init=annotated(xavier, None, MODEL),
            bias_init=annotated(zeros, MODEL),
            rngs=rngs,
            **precision,
        )
        self.linear2 = nnx.Linear(
            in_features=ff_dim,
            out_features=embed_dim,
            kernel_init=annotated(xavier, MODEL, None),
            bias_init=annotated(zeros, None),
            rngs=rngs,
            **precision,
        )
        self.dropout2 = nnx.Dropout(dropout_rate, rngs=rngs)

    def attend(self, x: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        """``self.mha(x)`` with each query kept to its own segment: the module's own
        projections around ``causal_attention`` (``nnx.MultiHeadAttention`` passes its
        ``attention_fn`` nothing per call beyond a mask)."""
        if segment_ids is None:
            return self.mha(inputs_q=x)  # decoding: a prompt or one position against its cache
        mha = self.mha
        q, k, v = mha.query(x), mha.key(x), mha.value(x)
        return mha.out(causal_attention(q, k, v, segment_ids=segment_ids))

    def __call__(self, inputs: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        attention_output = self.attend(self.layer_norm1(inputs), segment_ids)
        x = inputs + self.dropout1(attention_output)
        if hasattr(self, "moe"):
            mlp_output = self.moe(self.layer_norm2(x))
        else:
            mlp_output = self.linear2(nnx.gelu(self.linear1(self.layer_norm2(x))))
        mlp_output = self.dropout2(mlp_output)
        return x + mlp_output


#: ``stack.stacked``: the blocks as one stack (kept under this name for existing code).
stacked_blocks = stack_lib.stacked


class GPT(nnx.Module):
    """Token + position embeddings, ``num_layers`` TransformerBlocks, a final norm, a head.

    Returns logits ``(batch, seq, vocab_size)``; ``features`` gives the normed
    hidden states before the head. The token embedding and the head are split
    along the vocabulary, so ``vocab_size`` must be divisible by the ``model``
    axis (``CharTokenizer`` pads its vocabulary to a multiple of 8).

    With ``scan_layers``, the blocks are one stacked block (parameters
    ``blocks/linear1/kernel`` of shape ``(num_layers, ...)`` instead of
    ``blocks/0/linear1/kernel``, ...) run by ``nnx.scan``: the step is traced
    and compiled for one layer, not ``num_layers``, with the same maths. The two
    forms initialise differently from one seed and their checkpoints do not load
    into each other; ``stack_blocks`` / ``unstack_blocks`` convert a state.

    ``remat`` names an activation-checkpointing policy (``remat.POLICIES``:
    ``"full"``, ``"dots_with_no_batch_dims_saveable"``, ...) applied to each block
    (``remat.remat``): the backward pass recomputes what the policy does not
    save, block by block. ``"none"``: everything is kept.

    ``moe_experts``: every ``moe_every``-th block routes each token to ``moe_top_k`` of
    that many expert MLPs (``moe.MoE``), each taking ``moe_capacity_factor`` times its
    even share of tokens; ``None``: every token is routed (dropless).

    >>> with nnx.use_eager_sharding(False):
    ...     model = GPT(vocab_size=16, seq_len=8, embed_dim=32, num_heads=4, ff_dim=64,
    ...                 num_layers=2, dropout_rate=0.0, rngs=nnx.Rngs(0), scan_layers=True)
    >>> model(jnp.zeros((2, 8), jnp.int32)).shape
    (2, 8, 16)
    >>> model.blocks.linear1.kernel.shape
    (2, 32, 64)
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        embed_dim: int,
        num_heads: int,
        ff_dim: int,
        num_layers: int,
        dropout_rate: float,
        rngs: nnx.Rngs,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        scan_layers: bool = False,
        remat: str = "none",
        moe_experts: int = 0,
        moe_top_k: int = 2,
        moe_every: int = 1,
        moe_capacity_factor: float | None = 1.25,
    ) -> None:
        if moe_experts and scan_layers:
            raise ValueError("GPT: moe_experts with scan_layers=True is not supported yet.")
        embed_init = nnx.initializers.normal(stddev=0.02)
        precision: dict[str, Any] = {"dtype": dtype, "param_dtype": param_dtype}
        self.seq_len = seq_len
        self.token_embed = nnx.Embed(
            vocab_size,
            embed_dim,
            embedding_init=annotated(embed_init, MODEL, None),
            rngs=rngs,
            **precision,
        )
        # Small ((seq_len, embed_dim)) and read whole by every device: left to the
        # strategy (replicated, or split by FSDP when large enough).
        self.pos_embed = nnx.Embed(
            seq_len, embed_dim, embedding_init=embed_init, rngs=rngs, **precision
        )
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

        # Each block's __call__ checkpointed; scanned, nnx.scan runs the checkpointed block
        # (the usual pattern: the backward pass recomputes one layer at a time).
        block_class = remat_lib.remat(TransformerBlock, remat)

        def make_block(block_rngs: nnx.Rngs, experts: int = 0) -> TransformerBlock:
            return block_class(
                embed_dim, num_heads, ff_dim, dropout_rate, block_rngs, **precision,
                moe_experts=experts, moe_top_k=moe_top_k, moe_capacity_factor=moe_capacity_factor,
            )  # fmt: skip

        def experts_of(layer: int) -> int:  # every moe_every-th block is a MoE block
            return moe_experts if (layer + 1) % moe_every == 0 else 0

        self.blocks: TransformerBlock | nnx.List[TransformerBlock] = (
            stacked_blocks(make_block, num_layers, rngs)
            if scan_layers
            else nnx.List([make_block(rngs, experts_of(i)) for i in range(num_layers)])
        )
        self.layer_norm = _layer_norm(embed_dim, rngs, dtype)
        self.head = nnx.Linear(
            embed_dim,
            vocab_size,
            kernel_init=annotated(nnx.initializers.xavier_uniform(), None, MODEL),
            bias_init=annotated(nnx.initializers.zeros_init(), MODEL),
            rngs=rngs,
            **precision,
        )

    @property
    def context_length(self) -> int:
        """The most positions it takes (``generate.ContextLength``: a sampler refuses more)."""
        return self.seq_len

    def features(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """The final layer-normed hidden states ``(batch, seq, embed_dim)``, before the head.

        Args:
          tokens: ``(batch, seq)`` token ids.
          segment_ids: packed rows' document of each token (0 = padding); each token
            attends to its own document only.
          positions: each token's position in its document, read by the position
            embedding (default ``0..seq-1``).
        """
        seq_len = tokens.shape[-1]
        if seq_len > self.seq_len:
            raise ValueError(
                f"GPT was built for seq_len={self.seq_len}; got tokens of length {seq_len}."
            )
        where = jnp.arange(seq_len) if positions is None else positions
        x = self.token_embed(tokens) + self.pos_embed(where)
        x = self.dropout(x)
        side = () if segment_ids is None else (segment_ids,)
        # scan_layers: one stacked block, a scan (a pipeline under PipelineParallel)
        x = stack_lib.run_layers(self.blocks, x, *side)
        return self.layer_norm(x)

    def __call__(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """Logits ``(batch, seq, vocab)`` in float32. ``mask`` (``[batch, 1, 1, cache]``,
        decoding only: a prompt's block of positions or one): the cached keys each row may
        attend to (a sampler's padding hidden); causality is the cache's."""
        if mask is not None:
            set_cache_mask(self, mask)
        return self.head(self.features(tokens, segment_ids, positions)).astype(jnp.float32)


def stack_blocks(state: Any) -> Any:
    """An unrolled GPT's state with each ``blocks`` list stacked as
    ``GPT(scan_layers=True)`` holds it; the same for any nested dict holding such
    lists under ``blocks`` keys (Adam's moments mirror the parameters).

    Takes and returns pure nested dicts (``nnx.to_pure_dict``); put the result into
    a scanned model with ``nnx.replace_by_pure_dict``. ``unstack_blocks`` undoes it.
    """
    if not isinstance(state, Mapping):
        return state
    out = {}
    for key, value in state.items():
        if key == "blocks" and isinstance(value, Mapping) and _is_layer_list(value):
            layers = [value[i] for i in range(len(value))]
            out[key] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
        else:
            out[key] = stack_blocks(value)
    return out


def unstack_blocks(state: Any, num_layers: int) -> Any:
    """The inverse of ``stack_blocks``: each stacked ``blocks`` split into ``num_layers``."""
    if not isinstance(state, Mapping):
        return state
    out = {}
    for key, value in state.items():
        if key == "blocks" and isinstance(value, Mapping) and not _is_layer_list(value):
            out[key] = {i: jax.tree.map(lambda x, i=i: x[i], value) for i in range(num_layers)}
        else:
            out[key] = unstack_blocks(value, num_layers)
    return out


def _is_layer_list(node: Mapping[Any, Any]) -> bool:
    return bool(node) and set(node) == set(range(len(node)))
