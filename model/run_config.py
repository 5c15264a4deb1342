"""A training run's options, every one checked once before any work: `check_options` turns the
composed Hydra config into a RunConfig (the typed groups, the prepared data, the checkpoint it
resumes or starts from) or raises an error that names the option to fix.
"""

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from data.prepare import DataConfig, load_prepared, prepare
from data.tokenizer import describe_tokenizer, meta_vocab_size, same_tokenizer
from model import checkpoint
from model.command_line import check_keys, config_object, naming, resumed_config
from model.config import GPTConfig
from model.device import check_processes, memory_bytes, pick_device, print0
from model.optimizer import optimizer_name
from model.run_dir import WANDB_MODES

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ConfigStore.instance().store(group="model", name="schema", node=GPTConfig)  # configs/model/base.yaml


@dataclass
class RunConfig:
    """A run's options, every one checked (check_options): what train() needs and nothing else."""

    config: dict                  # the resolved config, as checkpoints save it
    train: Any                    # train.py's TrainConfig
    data: DataConfig
    model: GPTConfig              # the model trained: the data's vocabulary, init_from's architecture
    device: torch.device
    data_dir: Path                # the prepared token arrays
    meta: dict                    # their tokenizer
    source: checkpoint.Checkpoint | None = None   # the checkpoint resumed or started from

    def tokens_per_step(self, world_size: int) -> int:
        """Tokens one optimizer step trains on, over all processes."""
        return self.train.batch_size * world_size * self.train.grad_accum * self.model.block_size


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
            checkpoint.check_weights(source.model, source.model_config)
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
    check_fits(model, train_cfg.batch_size, device)
    config = OmegaConf.to_container(cfg, resolve=True) | {"model": dataclasses.asdict(model)}
    return RunConfig(config, train_cfg, data_cfg, model, device, data_dir, meta, source)


def check_fits(model: GPTConfig, batch_size: int, device: torch.device) -> None:
    """The model and a batch fit in the device's memory by a lower bound of what training takes:
    16 bytes a parameter (float32 weights, gradients and AdamW's two moments; the parameters counted
    from the config, at least 10 n_embd^2 a layer), and 4 bytes a number of a batch's logits and of
    one residual stream a layer. A run past it could only fail, or be killed, once it has started."""
    c = model
    positions = c.block_size * (c.pos_emb == "learned")
    params = (c.vocab_size + positions) * c.n_embd + 10 * c.n_layer * c.n_embd**2
    batch = 4 * batch_size * c.block_size * (c.vocab_size + c.n_layer * c.n_embd)
    if (need := 16 * params + batch) > (have := memory_bytes(device)):
        raise ValueError(f"training this model takes at least {need / 2**30:,.1f} GiB ({params:,} "
                         f"parameters, batches of {batch_size} x {c.block_size} tokens), more than the "
                         f"{have / 2**30:,.1f} GiB of {device}: lower train.batch_size or the model's size "
                         f"(model.n_layer, n_embd, block_size, vocab_size)")


def model_config(node, vocab_size: int) -> GPTConfig:
    """The `model` group as a GPTConfig: `vocab_size` (the data's) unless model.vocab_size is set."""
    fields = OmegaConf.to_container(node, resolve=True)
    check_keys(fields, GPTConfig, "model.")
    with naming("model", "GPTConfig"):
        return GPTConfig(**fields | {"vocab_size": fields.get("vocab_size") or vocab_size})


def check_resumable(ckpt: checkpoint.Checkpoint, model: GPTConfig, train_cfg, option: str) -> None:
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
