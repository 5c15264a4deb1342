"""`python -m cli.convert <run dir or checkpoint> --n-kv-head N --out <file>`: an MHA (or GQA)
checkpoint converted to N key/value heads by mean-pooling each group (model.convert)."""

import os
from pathlib import Path

from cli.errors import ArgumentParser, exit_on_user_error, naming
from model.convert import convert_checkpoint


def convert(ckpt, n_kv_head: int, out: str):
    """convert_checkpoint, never over an existing file, nor into a file named as a folder: --out is
    the file to write, so an --out ending in / (as `cp` reads it, a folder) is refused, not written
    as a file of the folder's name. Its errors name --n-kv-head as typed."""
    path = Path(out).expanduser()
    if path.exists():
        example = path / "converted.pt" if path.is_dir() else path.with_name(f"{path.stem}_converted.pt")
        raise FileExistsError(f"--out {path} already exists (nothing is overwritten): give a new file "
                              f"name, e.g. --out {example}")
    if out.endswith(("/", os.sep)):
        raise IsADirectoryError(f"--out {out} names a folder: give the file to write, e.g. --out "
                                f"{path / 'converted.pt'}")
    with naming("--n-kv-head", "n_kv_head"):
        return convert_checkpoint(ckpt, n_kv_head, path)


def main(argv=None) -> None:
    p = ArgumentParser(description="Convert an MHA (or GQA) checkpoint to fewer KV heads.")
    p.add_argument("ckpt", help="a run dir or checkpoint file")
    p.add_argument("--n-kv-head", type=int, required=True, help="the target number of key/value heads")
    p.add_argument("--out", required=True, help="where to write the converted checkpoint")
    args = p.parse_args(argv)
    old, new = exit_on_user_error(convert, args.ckpt, args.n_kv_head, args.out)
    print(f"{args.out}: n_kv_head {old.n_kv_head} -> {new.n_kv_head} (KV cache "
          f"{old.n_kv_head / new.n_kv_head:g}x smaller); uptrain with train.py init_from={args.out}")


if __name__ == "__main__":
    main()
