"""Ready-made run configs for ``nnx-spmd-train`` (ml_collections ``get_config()`` files).

Each module is also a file the command line loads by path::

    nnx-spmd-train --config=configs/tp.py --config.max_steps=20

``default`` is the run with no arguments: the small GPT on the pydoc topics,
FSDP x tensor parallel on 8 devices. ``dp``, ``fsdp``, ``tp`` and ``hybrid``
are the same job under other strategies; ``mlp`` and ``cnn`` train classifiers
on synthetic data. ``gpt2_small``, ``gpt2_medium`` and ``gpt2_large`` have
GPT-2's shapes in bf16, for GPUs (medium and large with scanned layers, per-block
remat and the chunked loss). ``gpt2_hf`` is Hugging Face's GPT-2 on the pydoc text
as GPT-2's byte tokens, to fine-tune from HF's file (``--config.init_from=FILE``).
``_base`` holds the training settings they share.
"""
