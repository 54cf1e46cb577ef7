"""The command line of ``nnx-spmd-train``: ``--config`` resolved to a file, the flags parsed,
``--help``, and a refused flag or key as one line on stderr with exit status 2."""

from __future__ import annotations

import argparse
import importlib.resources
import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from absl import flags

#: The shipped configs, wherever the install put them (package-dir mapping of configs/).
CONFIGS_DIR = Path(str(importlib.resources.files("nnx_spmd_trainer.configs")))


def _embedded(value: str) -> str:
    """A config path, or the embedded file when it names a shipped config missing from the cwd."""
    path, colon, rest = value.partition(":")  # config_flags passes "file.py:arg" on to get_config
    name = Path(path).name.removesuffix(".py")
    embedded = CONFIGS_DIR / f"{name}.py"
    if Path(path).is_file():  # a file of the user's wins; a folder of that name does not
        return value
    if embedded.exists() and not name.startswith("_"):
        return f"{embedded}{colon}{rest}"
    fail(f"--config={value} is neither a config file nor a shipped config ({_shipped()}).")


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """Resolves ``--config`` (a path, or ``tp`` / ``configs/tp.py`` from any cwd) and makes
    it explicit: ``--config=<embedded default.py>`` is inserted when absent, so every
    override is checked against the config at parse time."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            argv[i] = "--config=" + _embedded(arg.removeprefix("--config="))
            return argv
        if arg == "--config" and i + 1 < len(argv):
            argv[i + 1] = _embedded(argv[i + 1])
            return argv
    return [*argv[:1], f"--config={CONFIGS_DIR / 'default.py'}", *argv[1:]]


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parser; a flag it refuses (an unknown flag or config key, a value of the wrong
    type) is one line on stderr and exit status 2, as every configuration error."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:  # e.g. "flag --config.max_steps=abc: invalid literal ..."
        fail(f"{str(error).removeprefix('flag ')} (see --help for the keys and their values)")
    except (AttributeError, KeyError) as error:  # ml_collections raises these, not flags.Error
        detail: object = error
        while isinstance(detail, BaseException) and detail.args:
            detail = detail.args[0]
        key, _, hint = str(detail).partition("\n")
        overrides = [a.split("=", 1)[0] for a in argv if a.startswith("--config.")]
        name = key.strip("'\"")
        flag = next((o for o in overrides if o.endswith(f".{name}")), ", ".join(overrides))
        files = [a.removeprefix("--config=") for a in argv if a.startswith("--config=")]
        fail(
            f"{flag}: the config has no key {key}; an override must name a key defined in "
            f"{', '.join(files)} (see --help).{' ' + hint if hint else ''}"
        )


@dataclass(frozen=True)
class LaunchArgs:
    """What decides a launch on this machine, read from argv before the run's flags exist."""

    num_processes: int
    coordinator_address: str | None
    #: argv without ``--num_processes`` and ``--coordinator_address`` (argv[0] first):
    #: the command each launched process runs.
    rest: list[str]


def launch_args(argv: Sequence[str]) -> LaunchArgs:
    """``--num_processes`` and ``--coordinator_address`` read by absl's own parser, so every
    form it accepts counts (``--num_processes=2``, ``--num_processes 2``, ``-num_processes
    2``, a ``--flagfile``), and taken out of argv; every other argument is left as it was.

    A value absl refuses (``--num_processes two``) is one line on stderr and exit status 2.
    ``--undefok`` is consumed by the parse, and with it the flags it names: a launch's
    processes receive neither.
    """
    launch = flags.FlagValues()  # apart from flags.FLAGS: the run's flags are defined later
    flags.DEFINE_integer("num_processes", 1, "", flag_values=launch)
    flags.DEFINE_string("coordinator_address", None, "", flag_values=launch)
    try:
        rest = launch(list(argv), known_only=True)
    except flags.Error as error:
        fail(f"{str(error).removeprefix('flag ')} (see --help)")
    return LaunchArgs(launch.num_processes, launch.coordinator_address, rest)


def _shipped() -> str:
    return ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.py") if not p.stem.startswith("_")))


def fail(message: str, status: int = 2) -> NoReturn:
    """An error the user can act on: one line on stderr, exit status 2 (a configuration
    error, as argparse does) unless ``status`` says otherwise."""
    line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    sys.stderr.write(f"nnx-spmd-train: error: {line}\n")
    sys.exit(status)


class OneLineParser(argparse.ArgumentParser):
    """argparse for a command of ``nnx-spmd-train`` (``prog="nnx-spmd-train generate"``)
    whose refusals are one line naming the command, and exit 2, as every refusal of the CLI."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("nnx-spmd-train ")
        fail(f"{command}: {message} ({self.prog} --help lists the arguments)")


def checkpoint_step(value: str) -> str | int:
    """A ``--step`` argument: ``latest``, ``best`` or a step number."""
    if value in ("latest", "best"):
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--step={value!r}: give latest, best or a step number"
        ) from None


def _config_keys(config_file: str) -> list[str]:
    """``key = default`` for every key of the config in ``config_file``."""
    spec = importlib.util.spec_from_file_location("_config_for_help", config_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def flat(prefix: str, node: Any) -> list[str]:
        if isinstance(node, dict):
            return [line for key, value in node.items() for line in flat(f"{prefix}{key}.", value)]
        return [f"  --config.{prefix[:-1]}={node!r}"]

    return flat("", module.get_config().to_dict())


def usage(argv: Sequence[str]) -> str:
    """``--help``: the flags, the shipped configs and the keys of the chosen config."""
    config_file = next(a.removeprefix("--config=") for a in argv if a.startswith("--config="))
    config_file = config_file.partition(":")[0]
    return "\n".join(
        [
            "usage: nnx-spmd-train [--config=NAME|FILE] [--config.KEY=VALUE ...] "
            "[--workdir=DIR] [--export=DIR] [--num_processes=N]",
            "",
            "Trains the model a config describes on every device (8 simulated CPU devices",
            "when there is no accelerator); running it again resumes from --workdir.",
            "",
            f"  --config=NAME|FILE  a shipped config ({_shipped()}) or a config file;",
            "                      default: default (a small GPT on pydoc text)",
            "  --workdir=DIR       logs, TensorBoard events and checkpoints "
            "(default: runs/<config name>)",
            "  --export=DIR        write the trained parameters as a plain Orbax checkpoint",
            "  --export_format=safetensors  ... or as DIR/model.safetensors under the task's",
            "                      weight map's names (gpt2_hf: Hugging Face's GPT-2)",
            "  --export_ema        ... the average of the weights (--config.ema_decay) instead",
            "  --num_processes=N   run as N processes of one JAX job on this machine",
            "                      (on a cluster: one per host, with --coordinator_address",
            "                      and --process_id, or JAX's cluster detection)",
            "  --helpfull          every flag, the libraries' too",
            "",
            "  nnx-spmd-train corpus IN... --out DIR [--tokenizer PATH | --vocab_size N]",
            "                      tokenize text files into a corpus for --config.data.corpus",
            "  nnx-spmd-train evaluate WORKDIR [--step N] [--max_eval_batches N]",
            "                      evaluate a run's checkpoint; trains and writes nothing",
            "  nnx-spmd-train generate WORKDIR --prompt TEXT [--step latest|best|N]",
            "                      [--weights FILE.safetensors] [--tokenizer FILE] [--json]",
            "                      [--max_new_tokens N --temperature T --top_k K --top_p P]",
            "                      continue prompts with a run's model; writes nothing",
            "  nnx-spmd-train generate --weights HF_GPT2_DIR --prompt TEXT",
            "                      ... with a Hugging Face GPT-2 folder's model and tokenizer",
            "  nnx-spmd-train lm_eval WORKDIR --tasks T1,T2 [--include_path DIR] [--step N]",
            "                      [--limit N] [--num_fewshot N] [--json]",
            "                      score a run's checkpoint on lm-evaluation-harness tasks",
            "",
            f"Keys of {Path(config_file).name}, with their values (override any with "
            "--config.KEY=VALUE):",
            *_config_keys(config_file),
        ]
    )
