"""`python -m cli.convert <run dir or checkpoint> --n-kv-head N --out <file>`: an MHA (or GQA)
checkpoint converted to N key/value heads by mean-pooling each group (model.convert)."""

import argparse
from pathlib import Path

from cli.errors import exit_on_user_error
from model.convert import convert_checkpoint


def convert(ckpt, n_kv_head: int, out):
    """convert_checkpoint, never over an existing file."""
    out = Path(out).expanduser()
    if out.exists():
        example = out / "converted.pt" if out.is_dir() else out.with_name(f"{out.stem}_converted.pt")
        raise FileExistsError(f"--out {out} already exists (nothing is overwritten): give a new file "
                              f"name, e.g. --out {example}")
    return convert_checkpoint(ckpt, n_kv_head, out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Convert an MHA (or GQA) checkpoint to fewer KV heads.")
    p.add_argument("ckpt", help="a run dir or checkpoint file")
    p.add_argument("--n-kv-head", type=int, required=True, help="the target number of key/value heads")
    p.add_argument("--out", required=True, help="where to write the converted checkpoint")
    args = p.parse_args(argv)
    old, new = exit_on_user_error(convert, args.ckpt, args.n_kv_head, args.out)
    print(f"{args.out}: n_kv_head {old.n_kv_head} -> {new.n_kv_head} (KV cache "
          f"{old.n_kv_head / new.n_kv_head:g}x smaller); uptrain with train.py init_from={args.out}")


if __name__ == "__main__":
    main()
