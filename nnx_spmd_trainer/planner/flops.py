"""FLOPs: what a compiled step costs by its own count, what a transformer costs by the
formula, and what a device can do at its peak.

Three small answers, each used where speed is shown:

* ``step_flops`` / ``cost_flops``: the FLOPs per device of a compiled step, read from
  XLA's ``cost_analysis()`` of the program itself (every operation it runs: the
  optimizer's update, the loss, and a remat policy's recomputation included, so the
  utilisation it gives leans towards hardware FLOPs where a policy recomputes);
* ``transformer_flops_per_token``: the model FLOPs of a decoder-only transformer
  (PaLM's and nanoGPT's count), the cross-check of the compiler's figure;
* ``PEAK_FLOPS`` / ``peak_flops``: dense peaks per device and dtype, by
  ``jax.Device.device_kind``. A device missing from the table has no peak: no MFU is
  better than a wrong one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from nnx_spmd_trainer.planner import flop_count

#: Dense peak FLOP/s of one device (one GPU, one TPU chip) by dtype: never the
#: "with sparsity" figures datasheets print first (2x the dense ones). ``"fp32"`` is
#: the rate a float32 matmul runs at under JAX's default precision
#: (``jax.lax.Precision.DEFAULT``): TF32 tensor cores on these GPUs, one bf16 pass
#: on TPUs. Under ``jax_default_matmul_precision="highest"`` give the plain FP32
#: figure yourself (``Trainer(peak_flops=...)``; noted beside each GPU).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: BF16 1,979 and TF32 989
    # TFLOPS "with sparsity", so 989.4 and 494.7 dense (plain FP32: 67).
    "H100 SXM": {"bf16": 989.4e12, "fp32": 494.7e12},
    # Same datasheet, H100 PCIe column: BF16 1,513, TF32 756 with sparsity (FP32: 51).
    "H100 PCIe": {"bf16": 756.5e12, "fp32": 378e12},
    # Same datasheet, H100 NVL column: BF16 1,671, TF32 835 with sparsity (FP32: 60).
    "H100 NVL": {"bf16": 835.5e12, "fp32": 417.5e12},
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: BF16 1,979, TF32 989 with
    # sparsity (FP32: 67): the H100 SXM's compute with more memory.
    "H200 SXM": {"bf16": 989.4e12, "fp32": 494.7e12},
    # Same datasheet, H200 NVL column: BF16 1,671, TF32 835 with sparsity (FP32: 60).
    "H200 NVL": {"bf16": 835.5e12, "fp32": 417.5e12},
    # NVIDIA A100 Tensor Core GPU datasheet (40 and 80 GB, SXM and PCIe alike): BF16 312
    # and TF32 156 dense (624 and 312 with sparsity; FP32: 19.5).
    "A100": {"bf16": 312e12, "fp32": 156e12},
    # NVIDIA HGX B200 datasheet, per GPU (the 8-GPU board's 36 PFLOPS FP16/BF16 and
    # 18 PFLOPS TF32 are with sparsity): 2.25 and 1.125 PFLOPS dense.
    "B200": {"bf16": 2.25e15, "fp32": 1.125e15},
    # Cloud TPU documentation, system architecture, per chip: bf16 peak. TPUs publish
    # no separate fp32 figure: JAX's default precision multiplies fp32 in one bf16 pass.
    "TPU v4": {"bf16": 275e12, "fp32": 275e12},
    "TPU v5e": {"bf16": 197e12, "fp32": 197e12},
    "TPU v5p": {"bf16": 459e12, "fp32": 459e12},
    "TPU v6e": {"bf16": 918e12, "fp32": 918e12},
}

#: ``device_kind`` strings (lower case, ``-``/``_`` as spaces) to a ``PEAK_FLOPS`` name,
#: first match wins: the PCIe and NVL variants before the plain name they contain
#: ("NVIDIA H100 80GB HBM3" is the SXM part), and whole TPU names only ("TPU v4 lite",
#: the inference v4i, is not a v4; "TPU v5" is JAX's name for a v5p).
_KINDS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), name)
    for pattern, name in (
        (r"\bh100\b.*\bnvl\b", "H100 NVL"),
        (r"\bh100\b.*\bpcie\b", "H100 PCIe"),
        (r"\bh100\b", "H100 SXM"),
        (r"\bh200\b.*\bnvl\b", "H200 NVL"),
        (r"\bh200\b", "H200 SXM"),
        (r"\ba100\b", "A100"),
        (r"\bb200\b", "B200"),
        (r"^tpu v4$", "TPU v4"),
        (r"^tpu v5( lite|e)$", "TPU v5e"),
        (r"^tpu v5p?$", "TPU v5p"),
        (r"^tpu v6( lite|e)$", "TPU v6e"),
    )
)

#: The dtype names ``peak_flops`` takes, and the table column each reads.
_DTYPES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "bf16",  # the same tensor-core rate as bf16 on every device in the table
    "float16": "bf16",
    "fp32": "fp32",
    "float32": "fp32",
}


def device_name(device_kind: str) -> str | None:
    """The ``PEAK_FLOPS`` name of a ``jax.Device.device_kind``; ``None`` where unknown.

    >>> device_name("NVIDIA H100 80GB HBM3"), device_name("TPU v5 lite"), device_name("cpu")
    ('H100 SXM', 'TPU v5e', None)
    """
    kind = re.sub(r"[-_\s]+", " ", device_kind.strip().lower())
    return next((name for pattern, name in _KINDS if pattern.search(kind)), None)


def peak_flops(device_kind: str, dtype: str = "bf16") -> float | None:
    """Dense peak FLOP/s of one device of ``device_kind`` computing in ``dtype``
    (``"bf16"``, ``"fp32"``, or a NumPy name such as ``"bfloat16"``); ``None`` for a
    device not in ``PEAK_FLOPS`` (the CPU, for one).

    >>> peak_flops("NVIDIA H100 PCIe")
    756500000000000.0
    >>> peak_flops("cpu") is None
    True
    """
    column = _DTYPES.get(str(dtype).lower())
    if column is None:
        raise ValueError(
            f"peak_flops: unknown dtype {dtype!r}; use one of {', '.join(sorted(_DTYPES))}."
        )
    name = device_name(device_kind)
    return None if name is None else PEAK_FLOPS[name][column]


def cost_flops(compiled: Any) -> float | None:
    """FLOPs per device of a compiled program (``jax.stages.Compiled``), from its
    ``cost_analysis()`` (a dict, or a one-element list on some versions); ``None``
    where the backend reports none."""
    cost = compiled.cost_analysis()
    if isinstance(cost, Sequence):
        cost = cost[0] if cost else {}
    flops = (cost or {}).get("flops")
    return float(flops) if flops is not None and math.isfinite(flops) and flops > 0 else None


def abstract_args(args: Any) -> Any:
    """``args`` (arrays) as ``jax.ShapeDtypeStruct`` s with their shardings: what lowers
    a step again after its first call took (donated) the arrays."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        args,
    )


def step_flops(jitted: Callable[..., Any], shapes: Sequence[Any], devices: int = 1) -> float | None:
    """FLOPs per device of ``jitted`` called on arguments shaped as ``shapes``
    (``abstract_args``) on a mesh of ``devices``: its matrix multiplies counted from its
    jaxpr (``flop_count.matmul_flops``: each scan's body times its length, which XLA's
    cost analysis counts once) over the devices; the compiled program's count where the
    jaxpr has none. ``None`` for a step that cannot be traced (a strategy's own ``jit=``
    returning a plain function).

    Called after the step ran once with such arguments, the tracing is JAX's cache hit:
    the FLOPs are read, not compiled again. Call it inside the step's mesh
    (``jax.set_mesh``), as the step itself runs."""
    trace = getattr(jitted, "trace", None)
    if trace is None:
        return None
    traced = trace(*shapes)
    counted = flop_count.matmul_flops(traced.jaxpr)
    if counted > 0:
        return counted / devices
    return cost_flops(traced.lower().compile())


def batch_tokens(batch: Any) -> int | None:
    """Tokens in a global batch: rows x length of its first integer leaf of rank 2
    (``[batch, seq]`` token ids, the inputs of a language model's batch); ``None``
    for a batch with no such leaf (images, features).

    >>> tokens = np.zeros((8, 64), np.int32)
    >>> batch_tokens({"inputs": tokens, "targets": tokens})
    512
    >>> batch_tokens({"x": np.zeros((8, 4)), "y": np.zeros(8, np.int32)}) is None
    True
    """
    for leaf in jax.tree.leaves(batch):
        shape: tuple[int, ...] = tuple(getattr(leaf, "shape", ()))
        if len(shape) == 2 and np.issubdtype(getattr(leaf, "dtype", np.float32), np.integer):
            return int(shape[0]) * int(shape[1])
    return None


def transformer_flops_per_token(
    *,
    num_layers: int,
    embed_dim: int,
    ff_dim: int,
    seq_len: int,
    vocab_size: int,
    causal_skip: bool = False,
) -> float:
    """Model FLOPs of one training token (forward and backward) of a decoder-only
    transformer: ``6 N + 12 L T d`` (PaLM's appendix B, nanoGPT's ``estimate_mfu``).

    ``N`` counts the matmul parameters: per layer the query, key, value and output
    projections (``4 d^2``) and the feed-forward pair (``2 d f``), and the head
    (unembedding, ``d V``); not the embedding tables, which are gathered, not
    multiplied, nor biases and norms. ``12 L T d`` is the attention itself: the scores
    and their weighted sum, ``2 T d`` FLOPs each per token and layer forward, three
    times that with the backward pass. It is the full ``T x T`` product, as XLA
    computes it with a causal mask applied (masked entries still multiplied); with
    ``causal_skip`` the half, for a kernel that skips the blocks above the diagonal.

    >>> transformer_flops_per_token(num_layers=12, embed_dim=768, ff_dim=3072,
    ...                             seq_len=1024, vocab_size=50304) / 1e6
    854.654976
    """
    matmul_params = num_layers * (4 * embed_dim**2 + 2 * embed_dim * ff_dim)
    matmul_params += embed_dim * vocab_size
    attention = 12 * num_layers * seq_len * embed_dim
    return 6.0 * matmul_params + (attention / 2 if causal_skip else attention)
