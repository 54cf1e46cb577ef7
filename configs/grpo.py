"""GRPO from a reward function: ``nnx-spmd-train --config=grpo --config.data.prompts=FILE
--config.grpo.reward=module:function``.

``FILE`` is a JSONL of ``{"prompt": text, <fields>}`` rows (``post_training.read_prompts``);
the reward function (``post_training.rewards``) is called as ``reward(prompts,
completions, **fields) -> one float a completion`` on the decoded text, each row's other
fields handed over as lists. Each rollout takes ``batch_size`` prompts and samples
``grpo.group_size`` completions of each (at most ``grpo.max_new_tokens`` tokens) on the
training mesh, then makes ``grpo.num_iterations`` updates on them: ``max_steps`` and
``checkpoint_every_n_steps`` count updates, so both are multiples of it. ``grpo.beta``
weighs the KL term to the starting model (0: none, no reference built); ``grpo.epsilon``
clips the ratio. The model is the default job's GPT at its sizes, with its BPE, so
``--config.init_from=<the default job's workdir>`` needs no override.
"""

import ml_collections

from nnx_spmd_trainer.configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.post_training = "grpo"  # app/post_training_job.py runs it
    config.strategy = "data"
    config.max_steps = 8  # updates: 4 rollouts of 2
    config.batch_size = 8  # prompts a rollout
    config.learning_rate = 1e-3
    config.warmup_steps = 0
    config.weight_decay = 0.0
    config.log_every_n_steps = 2
    config.eval_every_n_steps = 0
    config.checkpoint_every_n_steps = 4
    # The model and its tokenizer are the default job's (configs/default.py: its GPT, its
    # BPE of data.vocab_size ids), so --config.init_from=<a default run's workdir> (or of
    # its chat fine-tune) reads it with no size overridden.
    config.data.prompts = ""  # the JSONL of prompts
    config.grpo = ml_collections.ConfigDict()
    config.grpo.reward = ""  # module:function, importable from PYTHONPATH
    config.grpo.group_size = 4  # completions a prompt (>= 2)
    config.grpo.num_iterations = 2  # updates a rollout
    config.grpo.max_new_tokens = 8
    config.grpo.stop = ()  # strings that end a completion (besides the end token)
    config.grpo.temperature = 1.0
    config.grpo.top_k = 0
    config.grpo.top_p = 1.0
    config.grpo.epsilon = 0.2
    config.grpo.beta = 0.0  # the KL term's weight
    return config
