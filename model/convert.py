"""Convert an MHA checkpoint to GQA or MQA by mean-pooling key/value heads.

    python -m model.convert outputs/<run> --n-kv-head 2 --out gqa.pt
    python train.py init_from=gqa.pt ...      # then uptrain briefly

Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
Checkpoints", §2.1: each new key (value) head is the mean of the original heads in its group.
"""

import argparse
import dataclasses
import sys

import torch

from model.config import GPTConfig


def mean_pool_kv(state: dict, config: GPTConfig, n_kv_head: int) -> tuple[dict, GPTConfig]:
    """Weights and config of the model with n_kv_head key/value heads, each the mean of a group
    of consecutive heads (query head h keeps reading the group that holds its old K/V head)."""
    new_config = dataclasses.replace(config, n_kv_head=n_kv_head)  # validates n_kv_head
    if config.n_kv_head % n_kv_head:
        raise ValueError(f"n_kv_head={n_kv_head} must divide the checkpoint's n_kv_head={config.n_kv_head}")
    C, hd, old = config.n_embd, config.head_dim, config.n_kv_head
    group = old // n_kv_head

    def pool(t):  # (old * hd, ...) -> (n_kv_head * hd, ...)
        grouped = t.reshape(n_kv_head, group, hd, *t.shape[1:])    # (n_kv_head, group, hd, ...)
        return grouped.mean(dim=1).reshape(n_kv_head * hd, *t.shape[1:])

    new_state = dict(state)
    for name, tensor in state.items():
        if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
            q, k, v = tensor.split([C, old * hd, old * hd], dim=0)
            new_state[name] = torch.cat([q, pool(k), pool(v)], dim=0)
    return new_state, new_config


def convert_checkpoint(src, n_kv_head: int, out) -> tuple[GPTConfig, GPTConfig]:
    """Read our checkpoint `src` (a run dir's best.pt, or a file), write the converted one to
    `out`; returns the old and new model configs."""
    from pathlib import Path

    from train import checkpoint_file, load_checkpoint, save_checkpoint

    ckpt = load_checkpoint(checkpoint_file(src, prefer="best.pt"))
    config = GPTConfig(**ckpt["model_config"])
    state, new_config = mean_pool_kv(ckpt["model"], config, n_kv_head)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out, {"model": state, "model_config": dataclasses.asdict(new_config),
                          "data_meta": ckpt["data_meta"], "config": ckpt.get("config", {}),
                          "converted_from": {"path": str(src), "n_kv_head": config.n_kv_head}})
    return config, new_config


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Convert an MHA (or GQA) checkpoint to fewer KV heads.")
    p.add_argument("ckpt", help="a run dir or checkpoint file")
    p.add_argument("--n-kv-head", type=int, required=True, help="the target number of key/value heads")
    p.add_argument("--out", required=True, help="where to write the converted checkpoint")
    args = p.parse_args(argv)

    from train import RunError

    try:
        old, new = convert_checkpoint(args.ckpt, args.n_kv_head, args.out)
    except (RunError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"{args.out}: n_kv_head {old.n_kv_head} -> {new.n_kv_head} (KV cache "
          f"{old.n_kv_head / new.n_kv_head:g}x smaller); uptrain with train.py init_from={args.out}")


if __name__ == "__main__":
    main()
