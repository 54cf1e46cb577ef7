"""Training settings every config shares; not a run config itself.

Strategy spec (``config.strategy``): comma-separated ``axis=size`` members in
mesh order. ``data`` (or ``dp``) -> DataParallel, ``fsdp`` -> FSDP, ``model``
(or ``tp``) -> TensorParallel; a missing size or ``-1`` means "all devices
left". One member gives that strategy, several give a Hybrid::

    "data"                     DataParallel over every device
    "fsdp=4,model=2"           Hybrid(FSDP(4), TensorParallel(2))
    "data=2,fsdp=2,model=2"    Hybrid(DataParallel(2), FSDP(2), TensorParallel(2))
    "fsdp=-1,model=2"          the default job: beside a -1, a size is a wish that
                               shrinks to fit (model=1 on one device), and the -1
                               member takes the rest (fsdp=4 on 8 devices)
    "fsdp=2,seq=4"             Hybrid(FSDP(2), SequenceParallel(4)) (``seq`` or ``sp``)
    "seq=8" with sequence_attention="ring"
                               SequenceParallel(8, attention="ring"): keys and values
                               passed round the seq axis, not gathered along it
    "auto"                     every layout the devices allow, planned, those that fit
                               ``memory_budget_bytes`` timed; the fastest trains

``compute_dtype`` ("float32" or "bfloat16") is the models' compute dtype; the
parameters and optimizer state stay float32, and the metrics accumulate in float32.
"""

import ml_collections


def training_config() -> ml_collections.ConfigDict:
    """The keys the CLI reads for any model; model configs add theirs."""
    config = ml_collections.ConfigDict()
    config.model = ""  # "gpt", "mlp" or "cnn": selects the model, its data and loss
    config.strategy = "data"
    # How a seq member attends over the split sequence: "all_gather" or "ring"
    config.sequence_attention = "all_gather"
    # Mesh axes placed across hosts by hand: "data=2" (axis=hosts it spans, comma-separated;
    # Hybrid(across_hosts=)). "": the mesh follows the hosts by itself.
    config.across_hosts = ""
    config.memory_budget_bytes = 0  # per device, for strategy "auto"; 0: the device's own
    config.num_devices = 8  # simulated on the CPU when no accelerator is present
    # --dry_run for TPU chips that are not here, compiled by the TPU compiler on this CPU
    # (the tpu-plan extra): "v5e-16", "v5p:4x4x4", "2xv5e-256"; "": the devices present.
    # target_batch="max": also the largest global batch that fits them (doubling, bisection)
    config.target = ""
    config.target_batch = ""
    config.seed = 0
    config.max_steps = 300
    config.batch_size = 32  # global: split over the data-parallel axes
    config.grad_accum_steps = 1
    config.compute_dtype = "float32"  # "bfloat16": mixed precision, fp32 master weights
    # One device's peak FLOP/s, for perf/mfu; 0: the dense peak of the device's kind in
    # compute_dtype (planner/flops.py's table), and no MFU on a device it lacks (the CPU)
    config.peak_flops = 0.0
    config.max_steps_in_flight = 2
    # AdamW, linear warmup then cosine decay to end_lr_fraction * learning_rate.
    # "muon": Muon for the hidden matrices (nnx_spmd_trainer.optim.muon, Newton-Schulz once
    # per matrix across the mesh), AdamW for embeddings, biases and norms, one learning
    # rate for both (Moonlight's consistent_rms=0.2 matches Muon's update RMS to AdamW's)
    config.optimizer = "adamw"
    config.learning_rate = 3e-3
    config.warmup_steps = 30
    config.end_lr_fraction = 0.1
    config.weight_decay = 0.01
    config.grad_clip_norm = 1.0
    # Spike skipping (SpikeSkip): a step whose loss or gradient norm is more than
    # skip_spikes_z standard deviations above the last skip_spikes_window accepted steps'
    # is skipped on the devices (train/skipped_spikes counts them); 0: off
    config.skip_spikes_z = 0.0
    config.skip_spikes_window = 100
    # An average of the weights (EMA, with warmup) kept on the devices and in every
    # checkpoint; 0: off. Trainer.ema_weights() puts it in the model
    config.ema_decay = 0.0
    # A step whose loss or new parameters are not finite changes nothing (weights, optimizer)
    config.skip_nonfinite_updates = False
    config.log_every_n_steps = 50
    config.eval_every_n_steps = 100
    config.max_eval_batches = 8  # cap on held-out batches per evaluation (0: all)
    # Orbax checkpoints under <workdir>/checkpoints; 0: only at the end of the run
    config.checkpoint_every_n_steps = 50
    # Also save when this many seconds passed since the last save, checked at log points
    # (process 0's clock decides for all processes); 0: by steps only
    config.save_every_n_seconds = 0.0
    # Continue from the latest checkpoint in the workdir, if any; False moves them aside
    config.resume = True
    # A resume whose learning-rate schedule differs from the checkpoints' run (another
    # max_steps, learning_rate, warmup_steps or end_lr_fraction) is refused; True resumes
    # on the new schedule anyway (the lr jumps where they differ), saying so in one line
    config.replan_schedule = False
    # What writes the metrics: any of tensorboard, csv, mlflow, wandb, comma-separated.
    # mlflow: to mlflow_uri ("": sqlite:///<workdir>/mlflow.db); wandb: to
    # wandb_project (WANDB_MODE=offline keeps it on disk). Both continue their run on resume.
    config.loggers = "tensorboard,csv"
    config.mlflow_uri = ""
    config.wandb_project = ""
    # The first state from a weights file (safetensors, or a directory of them) through the
    # task's weight map (the gpt2_hf task reads HF's GPT-2 files), or from an earlier run of
    # this library (its workdir, checkpoints/ or a step's directory: the newest finished
    # step's model, the optimizer fresh); "": random. A resume from the run's own
    # checkpoints wins and never reads it.
    config.init_from = ""
    # LoRA fine-tuning: adapters of rank lora.rank (0: off, the whole model trains) beside
    # the layers whose paths match lora.targets (a regex over NNX paths, "h/0/attn/q"; "":
    # the attention's q, k and v), scaled lora.alpha / lora.rank; only they train.
    # --export_format=peft writes them as a PEFT adapter, =merged folds them into the base.
    config.lora = ml_collections.ConfigDict()
    config.lora.rank = 0
    config.lora.alpha = 16.0
    config.lora.targets = ""
    config.lora.dropout = 0.0
    # A run started from a LoRA run (init_from=<its workdir>): "merge" folds that run's
    # adapters into its base first (the start is the model it trained, DPO's and GRPO's
    # reference that model itself; lora.rank adds fresh adapters over it), "keep" trains
    # the same adapters on (their rank, alpha and targets are that run's; with DPO/GRPO the
    # reference is then the base under them, the model before that run).
    config.lora.init_from_adapters = "merge"
    # JAX's persistent compilation cache: a directory, "off", or "auto" (the environment's
    # NNX_SPMD_TRAINER_COMPILE_CACHE, else JAX's own setting, else
    # $XDG_CACHE_HOME/nnx_spmd_trainer/jax): a rerun reads its compiled programs back
    config.compile_cache = "auto"
    return config
