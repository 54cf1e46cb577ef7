"""GPT-2 exactly as Hugging Face's ``GPT2LMHeadModel`` computes it, and the map of its files.

The architecture of the published GPT-2: learned token (``wte``) and position
(``wpe``) embeddings; ``n_layer`` pre-LayerNorm blocks (LayerNorm epsilon
``1e-5``) of causal self-attention scaled by ``1/sqrt(head_dim)`` and an MLP of
``4 * n_embd`` with the tanh-approximate GELU (HF's ``gelu_new``); a final
LayerNorm; and the head tied to the token embedding (logits ``= x @ wte^T``).

Parameters keep HF's names, so ``h/3/mlp/c_fc/kernel`` is ``h.3.mlp.c_fc.weight``:
HF's ``Conv1D`` stores ``(in, out)``, as ``nnx.Linear`` does, so no kernel is
transposed. Two things differ from the file, each a transform of the map
(``gpt2_weight_map``): the fused ``c_attn`` is three projections ``q``, ``k``,
``v`` here (so a ``model`` axis splits whole heads, Megatron's way), and the
vocabulary may be padded (``pad_vocab_to``) so that a ``model`` axis divides it;
the padded tokens' logits are the dtype's lowest value. Under ``scan_layers`` the
blocks are one stack (``stack.stacked``: ``h/mlp/c_fc/kernel`` of shape
``(n_layer, n_embd, 4 * n_embd)``), run by ``stack.run`` (pipelined under
``PipelineParallel``); the map stacks the
file's per-layer tensors.

Dropout (``dropout``) follows HF's ``resid_pdrop``/``embd_pdrop``; the attention
weights themselves are not dropped (``attn_pdrop`` is not modelled), which
changes nothing in eval mode, where the logits equal HF's.

Packed rows: ``segment_ids`` (0 = padding) keep each document's attention to itself
and ``positions`` (restarting per document) index ``wpe``; ``loss_fn`` (the GPT's)
reads both from the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_spmd_trainer import OutputHead
from nnx_spmd_trainer import stack as stack_lib
from nnx_spmd_trainer.app.models.annotations import MODEL, annotated
from nnx_spmd_trainer.app.models.gpt_losses import loss_fn
from nnx_spmd_trainer.nn import causal_attention, set_cache_mask, update_cache
from nnx_spmd_trainer.weights import Expr, WeightMap, pad, split, stack, tensor

__all__ = ["GPT2", "GPT2Block", "GPT2Config", "gpt2_weight_map", "loss_fn"]


@dataclass(frozen=True)
class GPT2Config:
    """The sizes of a GPT-2 (HF's ``GPT2Config`` names; defaults: GPT-2 small).

    ``pad_vocab_to``: the embedding has ``vocab_size`` rounded up to a multiple of it
    (64: 50257 -> 50304, which a ``model`` axis of 2, 4 or 8 divides).
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5
    dropout: float = 0.1
    pad_vocab_to: int = 1

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / self.pad_vocab_to) * self.pad_vocab_to


def _layer_norm(config: GPT2Config, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        config.n_embd,
        epsilon=config.layer_norm_epsilon,
        # (None,): replicated, annotated so that a stacked copy's layer dimension is marked
        scale_init=annotated(nnx.initializers.ones_init(), None),
        bias_init=annotated(nnx.initializers.zeros_init(), None),
        rngs=rngs,
    )


def _linear(n_in: int, n_out: int, split_dim: str, rngs: nnx.Rngs) -> nnx.Linear:
    """A Conv1D: ``split_dim`` ``"out"`` splits the output features over ``model`` (q, k, v,
    c_fc), ``"in"`` the input features (the projections back, whose bias is whole)."""
    kernel = (None, MODEL) if split_dim == "out" else (MODEL, None)
    bias = MODEL if split_dim == "out" else None
    return nnx.Linear(
        n_in,
        n_out,
        kernel_init=annotated(nnx.initializers.normal(0.02), *kernel),
        bias_init=annotated(nnx.initializers.zeros_init(), bias),
        rngs=rngs,
    )


class GPT2Attention(nnx.Module):
    """Causal self-attention: ``c_attn``'s q, k, v as three projections, then ``c_proj``."""

    #: Decoding, a call takes a block of positions (a whole prompt: one prefill pass).
    decodes_blocks = True

    def __init__(self, config: GPT2Config, rngs: nnx.Rngs) -> None:
        d = config.n_embd
        self.n_head = config.n_head
        self.q = _linear(d, d, "out", rngs)
        self.k = _linear(d, d, "out", rngs)
        self.v = _linear(d, d, "out", rngs)
        self.c_proj = _linear(d, d, "in", rngs)
        # Flax's decode-cache convention (nnx.MultiHeadAttention's): nn.kv_cache.init_caches
        # turns decode on in a sampler's copy and gives it a cache.
        self.decode = False
        self.cached_key: nnx.Cache[jax.Array] | None = nnx.data(None)
        self.cached_value: nnx.Cache[jax.Array] | None = nnx.data(None)
        self.cache_index: nnx.Cache[jax.Array] | None = nnx.data(None)
        self.cache_mask: nnx.Cache[jax.Array] | None = nnx.data(None)

    def init_cache(self, input_shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32) -> None:
        """An empty cache for ``input_shape[:-1]`` (``(batch, length)``), as Flax's attention."""
        shape = (*input_shape[:-1], self.n_head, self.q.out_features // self.n_head)
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_index = nnx.Cache(jnp.array(0, dtype=jnp.int32))

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        batch, length, d = x.shape
        q, k, v = (
            p(x).reshape(batch, length, self.n_head, d // self.n_head)
            for p in (self.q, self.k, self.v)
        )
        if self.decode:  # a block of positions (a prompt, or one step) against the cache
            k, v, written = update_cache(self, k, v)
            out = causal_attention(q, k, v, mask=written)
        else:
            out = causal_attention(q, k, v, segment_ids=segment_ids)
        return self.c_proj(out.reshape(batch, length, d))


class GPT2MLP(nnx.Module):
    """``c_fc``, the tanh-approximate GELU (``gelu_new``), ``c_proj``."""

    def __init__(self, config: GPT2Config, rngs: nnx.Rngs) -> None:
        self.c_fc = _linear(config.n_embd, 4 * config.n_embd, "out", rngs)
        self.c_proj = _linear(4 * config.n_embd, config.n_embd, "in", rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=True))


class GPT2Block(nnx.Module):
    """``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``, with residual dropout."""

    def __init__(self, config: GPT2Config, rngs: nnx.Rngs) -> None:
        self.ln_1 = _layer_norm(config, rngs)
        self.attn = GPT2Attention(config, rngs)
        self.ln_2 = _layer_norm(config, rngs)
        self.mlp = GPT2MLP(config, rngs)
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        x = x + self.dropout(self.attn(self.ln_1(x), segment_ids))
        return x + self.dropout(self.mlp(self.ln_2(x)))


class GPT2(nnx.Module):
    """GPT-2 returning logits ``(batch, seq, padded_vocab_size)`` for token ids.

    >>> config = GPT2Config(vocab_size=10, n_positions=8, n_embd=16, n_layer=2, n_head=2,
    ...                     pad_vocab_to=4)
    >>> with nnx.use_eager_sharding(False):  # shapes only; the Trainer builds it in a mesh
    ...     model = nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0), scan_layers=True))
    ...     logits = nnx.eval_shape(lambda m: m(jnp.zeros((1, 8), jnp.int32)), model)
    >>> logits.shape
    (1, 8, 12)
    >>> model.h.mlp.c_fc.kernel.shape
    (2, 16, 64)
    """

    def __init__(self, config: GPT2Config, rngs: nnx.Rngs, *, scan_layers: bool = False) -> None:
        self.config = config
        self.wte = nnx.Embed(
            config.padded_vocab_size,
            config.n_embd,
            embedding_init=annotated(nnx.initializers.normal(0.02), MODEL, None),
            rngs=rngs,
        )
        self.wpe = nnx.Embed(
            config.n_positions,
            config.n_embd,
            embedding_init=nnx.initializers.normal(0.01),
            rngs=rngs,
        )
        self.drop = nnx.Dropout(config.dropout, rngs=rngs)
        self.h: GPT2Block | nnx.List[GPT2Block] = (
            stack_lib.stacked(lambda r: GPT2Block(config, r), config.n_layer, rngs)
            if scan_layers
            else nnx.List([GPT2Block(config, rngs) for _ in range(config.n_layer)])
        )
        self.ln_f = _layer_norm(config, rngs)

    @property
    def context_length(self) -> int:
        """The most positions it takes (``generate.ContextLength``: a sampler refuses more)."""
        return self.config.n_positions

    def features(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """The final LayerNorm's output ``[rows, seq, n_embd]``, before the tied head
        (``nn.logprob_model``'s protocol, with ``output_head``)."""
        length = tokens.shape[-1]
        if length > self.config.n_positions:
            raise ValueError(f"GPT-2 has {self.config.n_positions} positions; got {length}.")
        where = jnp.arange(length) if positions is None else positions
        x = self.drop(self.wte(tokens) + self.wpe(where))
        side = () if segment_ids is None else (segment_ids,)
        x = stack_lib.run_layers(
            self.h, x, *side
        )  # stacked: a scan; under PipelineParallel, the stages
        return self.ln_f(x)

    def output_head(self) -> OutputHead:
        """The head tied to the token embedding (``wte^T``), its padded columns past
        ``vocab_size``: what ``nn.logprob.token_log_probs`` projects a chunk at a time."""
        return OutputHead(
            self.wte.embedding[...].T, dtype=self.wte.dtype, vocab_size=self.config.vocab_size
        )

    def __call__(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """Logits for ``tokens``; packed rows pass ``segment_ids`` and ``positions``;
        decoding, ``mask`` (``[batch, 1, 1, cache]``) the cached keys a row may attend to."""
        if mask is not None:
            set_cache_mask(self, mask)
        x = self.features(tokens, segment_ids, positions)
        logits = self.wte.attend(x).astype(jnp.float32)
        padding = jnp.arange(logits.shape[-1]) >= self.config.vocab_size
        return jnp.where(padding, jnp.finfo(logits.dtype).min, logits)


def gpt2_weight_map(
    config: GPT2Config, *, scan_layers: bool = False, dtype: np.dtype | type = np.float32
) -> WeightMap:
    """How ``GPT2(config, scan_layers=...)`` is made from Hugging Face's GPT-2 safetensors.

    The names are ``GPT2Model``'s (``wte.weight``, ``h.0.attn.c_attn.weight``, ...);
    a ``GPT2LMHeadModel`` file's ``transformer.`` prefix is accepted, and its tied
    ``lm_head.weight`` and the old causal-mask buffers (``h.0.attn.bias``,
    ``h.0.attn.masked_bias``) are skipped. ``c_attn`` is split into q, k, v, the
    vocabulary padded, and under ``scan_layers`` the layers stacked; exported, the
    file has HF's names and shapes again.

    >>> m = gpt2_weight_map(GPT2Config(n_layer=2), scan_layers=True)
    >>> m.targets["h/attn/q/kernel"].shape
    (2, 768, 768)
    """
    d, vocab = config.n_embd, config.vocab_size

    def t(name: str, *shape: int) -> Expr:
        return tensor(name, shape, dtype)

    def layer(i: int) -> dict[str, Expr]:
        h = f"h.{i}."
        qkv_w, qkv_b = t(h + "attn.c_attn.weight", d, 3 * d), t(h + "attn.c_attn.bias", 3 * d)
        out: dict[str, Expr] = {}
        for j, part in enumerate("qkv"):
            out[f"attn/{part}/kernel"] = split(qkv_w, axis=1, parts=3, index=j)
            out[f"attn/{part}/bias"] = split(qkv_b, axis=0, parts=3, index=j)
        sizes = {"attn.c_proj": (d, d), "mlp.c_fc": (d, 4 * d), "mlp.c_proj": (4 * d, d)}
        for name, (n_in, n_out) in sizes.items():
            path = name.replace(".", "/")
            out[f"{path}/kernel"] = t(h + name + ".weight", n_in, n_out)
            out[f"{path}/bias"] = t(h + name + ".bias", n_out)
        for ln in ("ln_1", "ln_2"):
            out[f"{ln}/scale"], out[f"{ln}/bias"] = t(h + ln + ".weight", d), t(h + ln + ".bias", d)
        return out

    targets: dict[str, Expr] = {
        "wte/embedding": pad(t("wte.weight", vocab, d), axis=0, size=config.padded_vocab_size),
        "wpe/embedding": t("wpe.weight", config.n_positions, d),
        "ln_f/scale": t("ln_f.weight", d),
        "ln_f/bias": t("ln_f.bias", d),
    }
    layers = [layer(i) for i in range(config.n_layer)]
    for key in layers[0]:
        if scan_layers:
            targets[f"h/{key}"] = stack([one[key] for one in layers])
        else:
            targets.update({f"h/{i}/{key}": one[key] for i, one in enumerate(layers)})
    return WeightMap(
        targets,
        ignore=(r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias", r"lm_head\.weight"),
        prefixes=("transformer.",),
    )
