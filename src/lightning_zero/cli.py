"""``lightning-zero`` command line: ``train``, ``plan`` and ``export``.

    lightning-zero train [OVERRIDES]      compose conf/ (+ recipe=NAME) with Hydra and run Trainer.fit
    lightning-zero plan  [OVERRIDES]      print the predicted bytes and step time per rank for the same config
    lightning-zero plan calibrate [...]   measure this machine's links and compute into a hardware YAML
    lightning-zero export CKPT OUT        consolidate a sharded checkpoint into one state dict

``python -m lightning_zero ...`` is the same. ``train`` and ``plan`` take Hydra overrides and
flags (``-m`` multirun, ``--cfg job``, ``--help``); every knob is described in docs/cli.md.

[Note: relaunch] Lightning's default launcher starts local ranks 1..N-1 by re-executing
``sys.argv`` with ``hydra.run.dir=<this run's dir>`` appended (``_hydra_subprocess_cmd``). Hydra
itself only ever sees the overrides, so the task functions put the subcommand back into
``sys.argv`` before Lightning reads it, and in a multirun they replace the sweep by this job's own
overrides (and point ``hydra.run.dir`` at this job's directory), so every child re-runs exactly
this job, in this job's directory.

[Note: light command line] ``lightning-zero --help``, a bad argument and ``plan`` answer in well
under a second: this module imports omegaconf and the Hydra schema (``hydra_config``) where a
command needs them, Lightning and torch only inside ``train``, and the planner imports neither
(``tests/test_structure.py`` checks the plan path).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:
    from omegaconf import DictConfig

USAGE = """\
usage: lightning-zero COMMAND [ARGS]

commands:
  train [OVERRIDES]    train with Hydra overrides, e.g. recipe=tiny trainer.max_steps=200
  plan  [OVERRIDES]    print the planned bytes per rank and step time (plan.search=true: rank layouts)
  plan calibrate [--out FILE.yaml] [--quick]   measure this machine into a hardware config
  export CKPT OUT [--format hf] [--dtype bf16|fp32] [--max-shard-size 50GB]
                       consolidate a (sharded) checkpoint into one plain state dict at OUT, or
                       write a Hugging Face Llama directory (--format hf)
  prepare-data INPUT... OUT --tokenizer PATH
                       tokenize text files into the token file data=memmap reads

Hydra flags work after train/plan: -m (multirun sweep), --cfg job (print the config), --help.
Docs: README.md, docs/cli.md.
"""

RESOLVED_CONFIG = "resolved_config.yaml"

log = logging.getLogger(__name__)

# Hydra overrides that belong to the parent's sweep, not to the job a child re-runs.
_SWEEP_ONLY_PREFIXES = (
    "hydra.mode",
    "hydra.sweep",
    "hydra.sweeper",
    "hydra/sweeper",
    "hydra.launcher",
    "hydra/launcher",
    "hydra.run.dir",
    "hydra.job.name",
    "hydra.output_subdir",
)
# Command-line flags that take a value and must travel to the children unchanged.
_FLAGS_WITH_VALUE = ("--config-dir", "-cd", "--config-name", "-cn", "--config-path", "-cp")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of the ``lightning-zero`` console script and of ``python -m lightning_zero``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return
    command, rest = args[0], args[1:]
    if command == "train":
        _run_hydra(command, _train_task, rest)
    elif command == "plan" and rest[:1] == ["calibrate"]:
        from lightning_zero.planner.calibrate import main as calibrate

        calibrate(rest[1:])
    elif command == "plan":
        # A plan writes nothing: no run directory, no log files (the user's overrides still win).
        quiet = ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled"]
        _run_hydra(command, _plan_task, [*quiet, *rest])
    elif command == "export":
        _export(rest)
    elif command == "prepare-data":
        _prepare_data(rest)
    else:
        _fail(f"unknown command {command!r}; expected train, plan, export or prepare-data")


def _fail(message: str) -> None:
    print(USAGE, file=sys.stderr, end="")
    print(f"lightning-zero: error: {message}", file=sys.stderr)
    raise SystemExit(2)


# --------------------------------------------------------------------------------------------
# Hydra plumbing
# --------------------------------------------------------------------------------------------


def _run_hydra(command: str, task: Callable[[DictConfig], Any], args: list[str]) -> None:
    """Run ``task`` under ``hydra.main`` with ``args`` as Hydra's command line."""
    from lightning_zero.hydra_config import check_recipe_overrides, register_recipes

    try:
        check_recipe_overrides([arg for arg in args if not arg.startswith("-")])
    except ValueError as error:
        _fail(str(error))
    import hydra  # after the recipe check: an unknown recipe fails without loading Hydra

    register_recipes()
    program = sys.argv[0]
    saved_argv = sys.argv
    sys.argv = [program, *args]  # what Hydra's argparse reads
    _CommandState.full_argv = [program, command, *args]
    try:
        hydra.main(config_path="conf", config_name="config", version_base="1.3")(task)()
    finally:
        sys.argv = saved_argv


class _CommandState:
    """The command line a task function restores for Lightning's relaunch (see [Note: relaunch])."""

    full_argv: list[str] = []


def child_argv(full_argv: Sequence[str], hydra_cfg: Any) -> list[str]:
    """The command line a local rank > 0 runs to repeat *this* job (see [Note: relaunch]).

    Keeps the program, the subcommand and ``--config-*`` flags; drops ``-m`` and the sweep; adds
    this job's Hydra overrides (minus sweep-only ones) and its task overrides. Lightning appends
    ``hydra.run.dir=...`` (this job's output dir), ``hydra.job.name`` and ``hydra.output_subdir=null``.
    """
    program, command, *args = full_argv
    flags: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if arg in _FLAGS_WITH_VALUE and index + 1 < len(args):
            flags += [arg, args[index + 1]]
            index += 2
            continue
        if arg.split("=", 1)[0] in _FLAGS_WITH_VALUE:
            flags.append(arg)
        index += 1
    hydra_overrides = [
        override for override in hydra_cfg.overrides.hydra if not override.lstrip("+~").startswith(_SWEEP_ONLY_PREFIXES)
    ]
    return [program, command, *flags, *hydra_overrides, *hydra_cfg.overrides.task]


def _prepare_relaunch() -> Path:
    """Point ``sys.argv`` and Hydra's ``run.dir`` at this job for Lightning's launcher; return the dir."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict, read_write

    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir).resolve()
    sys.argv = child_argv(_CommandState.full_argv, hydra_cfg)
    with read_write(hydra_cfg), open_dict(hydra_cfg):
        hydra_cfg.run.dir = str(output_dir)
    return output_dir


# --------------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------------


def _train_task(cfg: DictConfig) -> None:
    from lightning_zero.hydra_config import validate

    run_dir = _prepare_relaunch()
    saved_environ = dict(os.environ)
    try:
        train(validate(cfg), run_dir)
    finally:
        _forget_process_group(saved_environ)


def train(cfg: DictConfig, run_dir: Path) -> Any:
    """Build model, data, strategy and trainer from a validated config; fit; return the trainer."""
    import lightning as L

    _log_lightning_once()
    _set_threads(cfg)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module = build_module(cfg)
    module.strict_loading = bool(cfg.get("strict_loading", True))  # see [Note: strict loading] in checkpoint/load.py
    datamodule = build_datamodule(cfg, vocab_size=module.config.vocab_size)
    trainer = build_trainer(cfg, run_dir)
    if _is_global_rank_zero():
        write_resolved_config(cfg, run_dir)
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    if trainer.is_global_zero:
        _print_summary(trainer, run_dir)
    return trainer


def build_module(cfg: DictConfig) -> Any:
    """``LlamaLM`` (``MoELM`` for a mixture-of-experts preset: docs/moe.md) from the ``model`` and
    ``optim`` groups; the cosine ends at ``trainer.max_steps``."""
    from omegaconf import OmegaConf

    from lightning_zero.models import LlamaLM

    model_conf = OmegaConf.to_object(cfg.model)
    if model_conf.init_from == "required":  # what the *_finetune recipes set: no silent random init
        raise ValueError(
            "model.init_from=required: this recipe fine-tunes published weights; set "
            "model.init_from=/path/to/a/Hugging-Face/Llama/directory (config.json + safetensors)"
        )
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    max_steps = cfg.trainer.max_steps if cfg.trainer.max_steps > 0 else None
    if max_steps is not None and optim["warmup_steps"] > max_steps:
        # A recipe shrunk for a smoke test (warmup 2000, max_steps 5) still runs its schedule shape.
        log.warning(
            "optim.warmup_steps (%d) > trainer.max_steps (%d): warming up over all %d steps",
            optim["warmup_steps"],
            max_steps,
            max_steps,
        )
        optim["warmup_steps"] = max_steps
    from lightning_zero.models.moe import MoELM, moe_preset_names

    module_class = MoELM if str(model_conf.name).lower() in moe_preset_names() else LlamaLM
    return module_class(
        config=model_conf.llama_fields(),
        activation_checkpointing=model_conf.activation_checkpointing,
        init_from=model_conf.init_from,
        max_steps=max_steps,
        **optim,
    )


def build_datamodule(cfg: DictConfig, vocab_size: int) -> Any:
    """``TokenDataModule`` from the ``data`` group; ``data.vocab_size: null`` takes the model's."""
    from hydra.utils import instantiate

    data_vocab = cfg.data.vocab_size if cfg.data.vocab_size is not None else vocab_size
    if data_vocab > vocab_size:
        raise ValueError(
            f"data.vocab_size ({data_vocab}) exceeds the model's vocab_size ({vocab_size}): token ids "
            "would index past the embedding; lower data.vocab_size or raise model.vocab_size"
        )
    return instantiate(cfg.data, vocab_size=data_vocab)


def build_trainer(cfg: DictConfig, run_dir: Path) -> Any:
    """``Trainer`` with the strategy, CSV (+ TensorBoard) loggers and checkpoints under ``run_dir``."""
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    loggers: list[Any] = [CSVLogger(save_dir=str(run_dir), name="logs", version="")]
    try:
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(save_dir=str(run_dir), name="logs", version=""))
    except ModuleNotFoundError:  # tensorboard is optional
        pass
    checkpoint = ModelCheckpoint(
        dirpath=cfg.checkpoint.get("dir") or str(run_dir / "checkpoints"),
        every_n_train_steps=cfg.checkpoint.every_n_train_steps,
        save_last=cfg.checkpoint.save_last,
        save_top_k=cfg.checkpoint.save_top_k,
    )
    callbacks = [checkpoint, LearningRateMonitor(logging_interval="step")]
    if cfg.trainer.enable_progress_bar:
        from lightning_zero.trainer._lightning_compat import step_progress_bar

        callbacks.append(step_progress_bar())  # "Step 40/300", not Lightning's "Epoch 0/-2"
    if cfg.checkpoint.save_last:
        callbacks.append(_save_last_on_train_end(checkpoint))
    strategy = instantiate(cfg.strategy)
    return instantiate(
        cfg.trainer,
        strategy=strategy,
        logger=loggers,
        callbacks=callbacks,
        default_root_dir=str(run_dir),
    )


def _save_last_on_train_end(checkpoint: Any) -> Any:
    """A callback that saves ``last.ckpt`` when fit ends on a step ``checkpoint`` did not save
    (``max_steps`` rarely falls on ``every_n_train_steps``), so ``ckpt_path=last`` resumes there."""
    from lightning.pytorch.callbacks import Callback

    class SaveLastOnTrainEnd(Callback):
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            from lightning_zero.trainer._lightning_compat import last_saved_step, mark_saved

            if last_saved_step(checkpoint) == trainer.global_step or trainer.global_step == 0:
                return
            path = os.path.join(checkpoint.dirpath, checkpoint.CHECKPOINT_NAME_LAST + checkpoint.FILE_EXTENSION)
            trainer.save_checkpoint(path)
            mark_saved(checkpoint, trainer.global_step, path)

    return SaveLastOnTrainEnd()


def write_resolved_config(cfg: DictConfig, run_dir: Path) -> Path:
    """Write the fully resolved config to ``run_dir/resolved_config.yaml`` (re-runnable as is)."""
    from omegaconf import OmegaConf

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RESOLVED_CONFIG
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return path


def local_process_count(cfg: DictConfig) -> int:
    """Processes this machine runs: ``trainer.devices`` (an int, a list, or ``auto`` = 1 on CPU)."""
    from omegaconf import OmegaConf

    devices = cfg.trainer.devices
    if isinstance(devices, int):
        return max(1, devices)
    if isinstance(devices, str) and devices.strip().isdigit():
        return max(1, int(devices))
    if OmegaConf.is_list(devices) or isinstance(devices, (list, tuple)):
        return max(1, len(devices))
    return 1


def threads_per_process(cfg: DictConfig) -> Optional[int]:
    """``threads: auto`` -> ``max(1, cpus // local processes)`` on CPU, else ``None`` (leave torch's)."""
    if cfg.threads != "auto":
        return int(cfg.threads)
    if cfg.trainer.accelerator != "cpu":
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // local_process_count(cfg))


def _set_threads(cfg: DictConfig) -> None:
    import torch

    threads = threads_per_process(cfg)
    if threads is not None:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # Lightning's launcher then leaves it alone


def _log_lightning_once() -> None:
    """Lightning's logger prints through its own console handler *and* propagates to the root
    logger Hydra configured, so every Lightning message (and the monitor's table) showed twice.
    Keep Lightning's handler (its plain format) and stop the propagation."""
    lightning_logger = logging.getLogger("lightning")
    if lightning_logger.handlers:
        lightning_logger.propagate = False


def _is_global_rank_zero() -> bool:
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def _print_summary(trainer: Any, run_dir: Path) -> None:
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items() if "/" not in key}
    shown = ", ".join(f"{key}={value:.4f}" for key, value in sorted(metrics.items()) if not key.startswith("lr"))
    print(f"lightning-zero: {trainer.global_step} steps; {shown}; run dir: {run_dir}")


def _forget_process_group(saved_environ: dict[str, str]) -> None:
    """After a job: destroy the process group and restore the environment Lightning's launcher
    changed, so the next job of a multirun sweep starts a fresh group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key in set(os.environ) - set(saved_environ):
        del os.environ[key]
    os.environ.update(saved_environ)


# --------------------------------------------------------------------------------------------
# plan, export
# --------------------------------------------------------------------------------------------


def _plan_task(cfg: DictConfig) -> None:
    from lightning_zero.hydra_config import validate

    try:
        from lightning_zero.planner import run_plan
    except ImportError as error:
        raise RuntimeError(f"`lightning-zero plan` needs lightning_zero.planner.run_plan ({error})") from error
    run_plan(validate(cfg))


def _export(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="lightning-zero export",
        description="Consolidate a (sharded) lightning_zero checkpoint into one plain state dict.",
    )
    parser.add_argument("ckpt", help="checkpoint path (a sharded checkpoint directory or a .ckpt file)")
    parser.add_argument("out", help="output: a file (--format plain) or a directory (--format hf)")
    parser.add_argument(
        "--format", choices=("plain", "hf"), default="plain",
        help="plain: one state dict with the model's own keys; hf: a Hugging Face directory (Llama, or "
        "Mixtral / Qwen3-MoE for an MoELM checkpoint: config.json, safetensors shards, index) that transformers loads",
    )  # fmt: skip
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="--format hf: tensor dtype (default: the saved fp32)",
    )
    parser.add_argument(
        "--max-shard-size",
        default=None,
        help="--format hf: largest shard, e.g. 5GB (10^9 bytes), 500MB, 2GiB (default 50GB, transformers 5's save_pretrained default)",
    )
    parsed = parser.parse_args(args)
    if parsed.format == "plain" and (parsed.dtype is not None or parsed.max_shard_size is not None):
        _fail("--dtype and --max-shard-size apply to --format hf only")
    from lightning_zero.checkpoint import export
    from lightning_zero.checkpoint.dcp import CheckpointError
    from lightning_zero.models.llama.hf import export_hf
    from lightning_zero.models.moe.hf import export_hf as export_moe_hf
    from lightning_zero.models.moe.hf import is_moe_checkpoint

    try:
        if parsed.format == "hf":
            exporter = export_moe_hf if is_moe_checkpoint(parsed.ckpt) else export_hf
            path = exporter(parsed.ckpt, parsed.out, dtype=parsed.dtype, max_shard_size=parsed.max_shard_size or "50GB")
        else:
            path = export(parsed.ckpt, parsed.out)
    except (CheckpointError, ValueError) as error:
        print(f"lightning-zero export: error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"lightning-zero: exported {parsed.ckpt} -> {path if path is not None else parsed.out}")


def _prepare_data(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="lightning-zero prepare-data",
        description="Tokenize text into the token file data=memmap reads (raw uint16/uint32 ids + OUT.json).",
    )
    parser.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="text files (one document each) or .jsonl files (one per line)"
    )
    parser.add_argument("out", help="the token file to write, e.g. data/train.bin")
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json, or a model directory holding one")
    parser.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: min(8, cpus))")
    parser.add_argument("--text-key", default="text", help="field of a .jsonl line holding the text (default: text)")
    parser.add_argument("--eos-token", default=None, help="end-of-document token (default: </s>, <|endoftext|>, ...)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parsed = parser.parse_args(args)
    from lightning_zero.data import prepare_tokens

    try:
        meta = prepare_tokens(parsed.inputs, parsed.out, parsed.tokenizer, workers=parsed.workers, text_key=parsed.text_key,
                              eos_token=parsed.eos_token, progress=not parsed.no_progress)  # fmt: skip
    except ValueError as error:
        print(f"lightning-zero prepare-data: error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    print(
        f"lightning-zero: {meta['num_documents']} documents -> {meta['num_tokens']} tokens ({meta['dtype']}, vocab "
        f"{meta['vocab_size']}) in {parsed.out}; train with data=memmap data.path={parsed.out}"
    )


if __name__ == "__main__":
    main()
