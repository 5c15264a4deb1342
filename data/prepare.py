"""Get a corpus (local copy or verified download), split it 90/10 by character, tokenize it with
Hugging Face `datasets`, and write uint16/uint32 token arrays plus meta.json. Idempotent.

    python -m data.prepare data=shakespeare_char     # or data=shakespeare_bpe, data=text_files ...

`DataConfig` is the schema of the `data` config group (configs/data/); `prepare(DataConfig)`
returns the folder of the prepared arrays and `load_prepared` reads it back.
"""

import glob
import hashlib
import json
import os
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import hydra
import numpy as np
from hydra.core.config_store import ConfigStore

from data.errors import config_object, run_guarded
from data.tokenizer import BPETokenizer, CharTokenizer

FORMAT_VERSION = 1
TOKENIZERS = ("char", "bpe")
TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


@dataclass
class DataConfig:
    """The `data` group: which corpus, how it is tokenized and split, where the result goes."""

    name: str = "shakespeare"
    tokenizer: str = "char"
    path: Any = None  # a file, a list of files or a glob; None: download `url`
    url: str | None = TINYSHAKESPEARE_URL
    sha256: str | None = TINYSHAKESPEARE_SHA256  # of the corpus: a file that does not match is never used
    bpe_path: str | None = None  # a local gpt2.tiktoken; None: tiktoken downloads it
    cache_dir: str = "~/.cache/kvgpt"
    val_fraction: float = 0.1
    on_device: bool = True  # keep the token arrays on the training device

    def __post_init__(self):
        if self.path is not None:  # the command line may hand over a number
            self.path = [str(p) for p in self.path] if isinstance(self.path, list) else str(self.path)
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"data.tokenizer={self.tokenizer!r} is not one of {', '.join(TOKENIZERS)}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")


ConfigStore.instance().store(group="data", name="schema", node=DataConfig)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def offline() -> bool:
    return any(os.environ.get(v) == "1" for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def cache_dir(cfg: DataConfig) -> Path:
    return Path(os.path.expanduser(str(cfg.cache_dir)))


def corpus_files(cfg: DataConfig) -> list[Path]:
    """The corpus as local files: data.path (a file, a list, or a glob), else a verified download."""
    if cfg.path:
        patterns = [cfg.path] if isinstance(cfg.path, str | os.PathLike) else list(cfg.path)
        files = []
        for pattern in map(os.path.expanduser, map(str, patterns)):
            matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
            if not matches or not all(os.path.isfile(m) for m in matches):
                raise FileNotFoundError(f"data.path: no such file: {pattern}")
            files += map(Path, matches)
        return files
    if cfg.url:
        return [download(cfg.url, cfg.sha256, cache_dir(cfg) / "downloads")]
    raise ValueError("data.path is not set: give a text file, a list of files or a glob")


def download(url: str, sha256: str | None, dest_dir: Path) -> Path:
    """Fetch url into dest_dir once; a copy whose sha256 does not match is never written."""
    dest = dest_dir / Path(urlparse(url).path).name
    if dest.is_file() and (sha256 is None or sha256_bytes(dest.read_bytes()) == sha256):
        return dest
    hint = f"set data.path=/path/to/{dest.name} to use a local copy"
    if offline():
        raise ConnectionError(f"offline (HF_DATASETS_OFFLINE=1) and no local copy of {url}: {hint}")
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            data = response.read()
    except OSError as e:  # URLError, timeouts, refused connections
        raise ConnectionError(f"could not download {url} ({getattr(e, 'reason', e)}): {hint}") from None
    if sha256 is not None and sha256_bytes(data) != sha256:
        raise ValueError(f"{url} has sha256 {sha256_bytes(data)}, expected {sha256}: not used; {hint}")
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=dest_dir, delete=False) as f:
        f.write(data)
    os.replace(f.name, dest)
    return dest


def prepare(cfg: DataConfig) -> Path:
    """Prepare the corpus described by a `data` config; returns the folder of the token arrays.
    The folder's name carries a hash of the inputs, so identical inputs are prepared once."""
    files = corpus_files(cfg)
    raw = b"".join(f.read_bytes() for f in files)
    source_sha256 = sha256_bytes(raw)
    if cfg.sha256 and source_sha256 != cfg.sha256:
        raise ValueError(f"{', '.join(map(str, files))} has sha256 {source_sha256}, expected "
                        f"{cfg.sha256}: not used; point data.path at a good copy")
    key = sha256_bytes(json.dumps([FORMAT_VERSION, source_sha256, cfg.tokenizer,
                                   cfg.val_fraction]).encode())[:16]
    out_dir = cache_dir(cfg) / f"{cfg.name}-{cfg.tokenizer}-{key}"
    if (out_dir / "meta.json").is_file():
        return out_dir

    from datasets import Dataset, load_dataset  # slow to import: only when there is work

    corpus = load_dataset("text", data_files={"corpus": [str(f) for f in files]},
                          sample_by="document", keep_linebreaks=True,
                          cache_dir=str(cache_dir(cfg) / "hf"))["corpus"]
    text = "".join(corpus["text"])
    if not text:
        raise ValueError(f"the corpus is empty: {', '.join(map(str, files))}")
    tokenizer = CharTokenizer.from_text(text) if cfg.tokenizer == "char" else BPETokenizer(cfg.bpe_path)

    cut = int(len(text) * (1 - cfg.val_fraction))  # first 90% of the characters train
    parts = Dataset.from_dict({"split": ["train", "val"], "text": [text[:cut], text[cut:]]})
    parts = parts.map(lambda batch: {"ids": [tokenizer.encode(t) for t in batch["text"]]},
                      batched=True, remove_columns=["text"], keep_in_memory=True,
                      new_fingerprint=f"{key}-tokens")
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32

    cache_dir(cfg).mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(dir=cache_dir(cfg), prefix=f".{out_dir.name}-"))
    counts = {}
    for row in parts:
        ids = np.asarray(row["ids"], dtype=dtype)
        np.save(tmp_dir / f"{row['split']}.npy", ids)
        counts[f"{row['split']}_tokens"] = len(ids)
    meta = {
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "vocab": tokenizer.chars if tokenizer.name == "char" else None,
        "dtype": np.dtype(dtype).name,
        **counts,
        "source_sha256": source_sha256,
        "source_files": [str(f) for f in files],
        "val_fraction": cfg.val_fraction,
        "version": FORMAT_VERSION,
    }
    (tmp_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        os.replace(tmp_dir, out_dir)
    except OSError:  # another process prepared the same inputs first
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def load_prepared(prepared_dir: Path):
    """meta, train and val token arrays (memory-mapped) of a prepared folder."""
    prepared_dir = Path(prepared_dir)
    try:
        meta = json.loads((prepared_dir / "meta.json").read_text())
        train, val = (np.load(prepared_dir / f"{s}.npy", mmap_mode="r") for s in ("train", "val"))
    except ValueError as e:  # json's or numpy's complaint about a damaged file
        raise ValueError(f"{prepared_dir} is damaged ({e}): delete it and it is prepared again") from e
    return meta, train, val


def report(cfg) -> None:
    """`python -m data.prepare`: prepare cfg.data and say what is where."""
    out_dir = prepare(config_object(cfg.data, "data."))
    meta = load_prepared(out_dir)[0]
    print(f"{out_dir}: {meta['tokenizer']} vocab {meta['vocab_size']}, "
          f"{meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens")


@hydra.main(config_path="../configs", config_name="prepare", version_base="1.3")
def main(cfg) -> None:
    run_guarded(report, cfg)


if __name__ == "__main__":
    main()
