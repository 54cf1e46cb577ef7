"""DPO on preference pairs: ``nnx-spmd-train --config=dpo --config.data.preferences=FILE``.

``FILE`` is a JSONL of ``{"prompt", "chosen", "rejected"}`` rows, text or chat messages
(rendered with ``--config.data.chat_template=chatml``; ``post_training.read_preferences``):
a row without one of them is refused, naming the file and line; a row whose ``chosen``
equals its ``rejected`` is counted and skipped.
The model is the default job's GPT at its sizes, the text tokenized with its BPE
(``config.data.tokenizer`` / ``vocab_size``), so ``--config.init_from=<the default job's
workdir>`` needs no override (a model of other sizes: ``--config.gpt.embed_dim=...``,
as a refusal names them); each step takes
``batch_size`` pairs, cut or padded to ``config.gpt.seq_len`` tokens. ``config.dpo``:
the loss (``post_training.DPOTrainer``): ``beta``, ``loss_type`` ("sigmoid": DPO, or
"ipo") and ``label_smoothing`` (sigmoid only). Checkpoints, TensorBoard and
metrics.csv as any run (``train/rewards/accuracies``, ``train/rewards/margins``, ...).
"""

import ml_collections

from nnx_spmd_trainer.configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.post_training = "dpo"  # app/post_training_job.py runs it
    config.strategy = "fsdp=-1,model=2"
    config.max_steps = 20
    config.batch_size = 8  # pairs a step
    config.learning_rate = 1e-3
    config.warmup_steps = 0
    config.weight_decay = 0.0
    config.log_every_n_steps = 5
    config.eval_every_n_steps = 0
    config.checkpoint_every_n_steps = 10
    # The model and its tokenizer are the default job's (configs/default.py: its GPT, its
    # BPE of data.vocab_size ids), so --config.init_from=<a default run's workdir> (or of
    # its chat fine-tune) reads it with no size overridden.
    config.data.preferences = ""  # the JSONL of pairs
    config.dpo = ml_collections.ConfigDict()
    config.dpo.beta = 0.1
    config.dpo.loss_type = "sigmoid"  # or "ipo"
    config.dpo.label_smoothing = 0.0
    return config
