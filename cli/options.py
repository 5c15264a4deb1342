"""A training run's command line: every option of a job checked once, before any work, into a
RunConfig (`check_options`), with errors that name the option typed; a resumed run's config (its
checkpoint's, plus what the command line set); the recipe a run without experiment=... gets; and
the run itself (`train_run`), whose run dir's errors name the option too.
"""

import dataclasses
import os
from contextlib import nullcontext
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from cli.configs import CONFIGS, check_keys, config_object
from cli.errors import naming
from data.prepare import load_prepared, prepare
from data.tokenizer import describe_tokenizer, meta_vocab_size, same_tokenizer
from model import GPTConfig, checkpoint
from model.checkpoint import Checkpoint
from model.device import pick_device
from training.distributed import check_processes, print0
from training.loop import train
from training.optimizer import optimizer_name
from training.options import RunConfig, check_fits
from training.run_dir import WANDB_MODES


def train_run(run: RunConfig, run_dir) -> dict:
    """training.loop.train, the errors of its run dir (`run_dir: cannot write checkpoint ...`: a full
    disk) named as the option that sets it, hydra.run.dir."""
    with naming("hydra.run.dir", "run_dir"):
        return train(run, run_dir)


def check_options(cfg: DictConfig, overrides: list[str] | None = None) -> RunConfig:
    """Every option of a run, checked before any work (the command line checks each job so before
    Hydra creates its run dir). With train.resume and the command line's `overrides`, the run
    continues with its checkpoint's saved config plus what the command line set."""
    source, option = None, ""
    if cfg.train.resume:
        option = f"train.resume={cfg.train.resume}"
        with naming("train.resume"):
            source = checkpoint.load(cfg.train.resume)
        if overrides is not None:
            cfg = resumed_config(cfg, source.config, overrides, CONFIGS)
    train_cfg, data_cfg = config_object(cfg.train, "train."), config_object(cfg.data, "data.")
    model = model_config(cfg.model, vocab_size=1)  # the data's vocabulary is known further down
    if cfg.wandb.mode not in WANDB_MODES:
        raise ValueError(f"wandb.mode={cfg.wandb.mode!r} is not one of {', '.join(WANDB_MODES)}")
    with naming("train.device", "device"):
        device = pick_device(train_cfg.device)
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's --nproc_per_node
        check_processes(device, local_processes, torch.cuda.device_count() if device.type == "cuda" else 0)
    processes = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's, over every machine
    if train_cfg.cuda_graph is True and (device.type != "cuda" or processes > 1):
        raise ValueError(f"train.cuda_graph=true replays a step on one CUDA device, not on {device} with "
                         f"{processes} process{'es' * (processes > 1)}: leave it auto or false")
    if source is None and cfg.init_from:
        option = f"init_from={cfg.init_from}"
        with naming("init_from"):
            source = checkpoint.init_from(cfg.init_from)
    data_dir = prepare(data_cfg)
    meta = load_prepared(data_dir)[0]
    if source is not None:
        with naming(option):
            meta_vocab_size(source.data_meta)  # names a tokenizer, or says what is wrong
    if source is not None and not same_tokenizer(source.data_meta, meta):
        raise ValueError(f"{option} was trained with {describe_tokenizer(source.data_meta)}, but this data "
                         f"has {describe_tokenizer(meta)}: its token ids would mean other text")
    if source is not None:
        with naming(option):
            checkpoint.check_weights(source.model, checkpoint.expected_weights(source.model_config))
    model = dataclasses.replace(model, vocab_size=cfg.model.get("vocab_size") or meta["vocab_size"])
    if train_cfg.resume:
        check_resumable(source, model, train_cfg, option)
    elif source is not None:
        model = dataclasses.replace(source.model_config, dropout=model.dropout)
        print0(f"init_from {cfg.init_from}: its architecture, dropout={model.dropout}")
    if model.vocab_size < meta["vocab_size"]:
        raise ValueError(f"model.vocab_size={model.vocab_size} is smaller than the data's "
                         f"vocabulary ({meta['vocab_size']})")
    for split in ("train", "val"):
        if meta[f"{split}_tokens"] <= model.block_size:
            raise ValueError(f"model.block_size={model.block_size} is too long for the {split} split "
                             f"({meta[f'{split}_tokens']:,} tokens): lower it, or give more text "
                             f"(data.path, data.val_fraction)")
    check_fits(model, train_cfg.batch_size, device, train_cfg.dtype)
    config = OmegaConf.to_container(cfg, resolve=True) | {"model": dataclasses.asdict(model)}
    return RunConfig(config, train_cfg, data_cfg, model, device, data_dir, meta, source)


def model_config(node, vocab_size: int) -> GPTConfig:
    """The `model` group as a GPTConfig: `vocab_size` (the data's) unless model.vocab_size is set."""
    fields = OmegaConf.to_container(node, resolve=True)
    check_keys(fields, GPTConfig, "model.")
    with naming("model", "GPTConfig"):
        return GPTConfig(**fields | {"vocab_size": fields.get("vocab_size") or vocab_size})


def check_resumable(ckpt: Checkpoint, model: GPTConfig, train_cfg, option: str) -> None:
    """A resumed run keeps its model (dropout aside), its optimizer and its steps."""
    for name, value in dataclasses.asdict(model).items():
        saved = getattr(ckpt.model_config, name)
        if name != "dropout" and saved != value:
            raise ValueError(f"{option}: its model has model.{name}={saved!r} but this run asks for "
                             f"{value!r}: a resumed run keeps its model (drop that override, or start "
                             f"a new run from it with init_from=...)")
    if ckpt.optimizer is None:
        raise ValueError(f"{option} holds no training state (a converted checkpoint?): start from it "
                         f"with init_from instead")
    if "processes" not in (ckpt.rng or {}):
        raise ValueError(f"{option} was saved by an older kvgpt, without each process's RNG state: "
                         f"start a new run from it with init_from instead")
    if (saved := optimizer_name(ckpt.optimizer)) != train_cfg.optimizer:
        raise ValueError(f"{option} was trained with train.optimizer={saved}, not {train_cfg.optimizer}: "
                         f"resume with train.optimizer={saved}")
    if ckpt.step > train_cfg.max_iters:
        raise ValueError(f"train.max_iters={train_cfg.max_iters} is below the step train.resume reached "
                         f"({ckpt.step}): set train.max_iters={ckpt.step} or more")


# ----------------------------------------------------------------------------- resuming a run

# What a resumed run takes from this machine, not from the checkpoint: where things are and run.
MACHINE_KEYS = ("data.cache_dir", "train.device", "train.compile", "wandb.mode")


def resumed_config(cfg: DictConfig, saved: dict, overrides: list[str], config_dir) -> DictConfig:
    """The config a resumed run continues with: the one saved in its checkpoint, except the keys
    the command line's `overrides` set and MACHINE_KEYS, which keep cfg's values. A key the saved
    config lacks (an older checkpoint) keeps cfg's value too. Saved values are resolved."""
    changed = changed_on_command_line(cfg, overrides, config_dir)
    cfg, keys = cfg.copy(), flat(OmegaConf.to_container(cfg)).keys()
    for key, value in flat(saved).items():
        if key in keys and key not in changed and key not in MACHINE_KEYS:
            OmegaConf.update(cfg, key, value, merge=False)
    print(f"train.resume: the saved config of {cfg.train.resume}, changed here: "
          f"{', '.join(sorted(changed - {'train.resume'})) or 'nothing'}", flush=True)
    return cfg


def flat(config: dict, prefix: str = "") -> dict:
    """{"a.b": leaf} for every leaf of a nested dict (lists are leaves)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_on_command_line(cfg: DictConfig, overrides: list[str], config_dir) -> set[str]:
    """The config keys the overrides set: each key typed, and every key a group option sets
    (attention=mha its four keys, ~attention what its default set), composed over the primary
    config's groups with none chosen."""
    import hydra
    from hydra.core.config_store import ConfigStore
    from hydra.core.override_parser.overrides_parser import OverridesParser

    changed, leaves, options = set(), flat(OmegaConf.to_container(cfg)), []
    primary = OmegaConf.load(Path(config_dir) / "train.yaml").defaults
    groups = {key: option for entry in primary if not isinstance(entry, str) for key, option in entry.items()}
    ConfigStore.instance().store(name="no_groups", node={"defaults": [
        entry if isinstance(entry, str) else dict.fromkeys(entry) for entry in primary]})
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if key not in groups:  # a value, or a node of values (wandb={mode: offline})
            changed |= {key} | {leaf for leaf in leaves if leaf.startswith(f"{key}.")}
        elif override.is_delete():  # ~attention: what its default set is unset
            options += [f"{key}={groups[key]}"] if groups[key] else []
        else:  # as typed: attention=mha, +attention@model=gqa, experiment=...
            options.append(override.input_line)
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    # Inside @hydra.main Hydra is initialized already; before it (the command line's checks), not.
    initialized = GlobalHydra.instance().is_initialized()
    with nullcontext() if initialized else initialize_config_dir(str(config_dir), version_base="1.3"):
        alone = hydra.compose(config_name="no_groups", overrides=options)
    return changed | flat(OmegaConf.to_container(alone)).keys()


# ----------------------------------------------------------------------------- the recipe

AUTO_RECIPES = {
    "cuda": ("shakespeare_char_gpu", "training on CUDA: the GPU recipe"),
    "cpu": ("shakespeare_char_cpu_fast", "training on the CPU: the CPU recipe, 1-3 minutes on 2 cores"),
    "mps": ("shakespeare_char_cpu_fast", "training on Apple's MPS: the CPU recipe's small model"),
}


def with_default_experiment(argv: list[str], cuda_available: bool | None = None) -> list[str]:
    """Without experiment=..., the recipe for the device the run trains on, said: train.device's
    kind when the command line sets it, else CUDA when it is available (not when resuming: a
    resumed run continues with its own config)."""
    import torch

    given = dict(a.lstrip("+").partition("=")[::2] for a in argv)
    if "experiment" in given or given.get("train.resume") not in (None, "", "null"):
        return argv
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    device = given.get("train.device", "auto").strip("'\"")
    kind = "cuda" if device.startswith("cuda") or (device == "auto" and cuda) else device
    recipe, why = AUTO_RECIPES.get(kind, AUTO_RECIPES["cpu"])
    print(f"recipe: experiment={recipe} ({why}); choose another with experiment=...", flush=True)
    return [*argv, f"experiment={recipe}"]
