"""Tokenizers with one small interface: encode, decode, vocab_size, name."""

import os

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

# tiktoken's own hash for the GPT-2 (r50k_base) ranks file; it checks it on every load.
GPT2_BPE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


class CharTokenizer:
    name = "char"

    def __init__(self, chars):
        self.chars = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            missing = sorted(set(text) - self.stoi.keys())
            raise ValueError(
                f"characters not in this model's vocabulary: {', '.join(map(repr, missing))}"
            ) from None

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


class BPETokenizer:
    """GPT-2's byte-level BPE through tiktoken: 50,257 tokens, <|endoftext|> = 50256."""

    name = "bpe"

    def __init__(self, bpe_path: str | None = None):
        self.encoding = gpt2_encoding(bpe_path)
        self.eot_token = self.encoding.eot_token

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)  # special tokens in text stay plain text

    def decode(self, ids) -> str:
        return self.encoding.decode(list(ids))


def gpt2_encoding(bpe_path: str | None = None) -> tiktoken.Encoding:
    """GPT-2's encoding from a local gpt2.tiktoken (argument or $GPT2_TIKTOKEN_PATH), else through
    tiktoken's own download and cache. Either way tiktoken verifies the file's sha256."""
    bpe_path = bpe_path or os.environ.get("GPT2_TIKTOKEN_PATH")
    if bpe_path and not os.path.isfile(bpe_path):
        raise FileNotFoundError(f"GPT-2 BPE file not found: {bpe_path} (data.bpe_path / GPT2_TIKTOKEN_PATH)")
    try:
        if not bpe_path:
            return tiktoken.get_encoding("r50k_base")  # the same encoding as "gpt2"
        ranks = load_tiktoken_bpe(bpe_path, expected_hash=GPT2_BPE_SHA256)
    except (ValueError, OSError) as e:  # a hash mismatch, or offline (requests' errors are OSErrors)
        where = bpe_path or "tiktoken's download"
        raise ValueError(f"could not load the GPT-2 BPE from {where} ({type(e).__name__}: {e}); "
                         f"set data.bpe_path=/path/to/gpt2.tiktoken or GPT2_TIKTOKEN_PATH") from e
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257)


def tokenizer_from_meta(meta: dict, bpe_path: str | None = None):
    """The tokenizer that prepared a dataset (or trained a checkpoint), from its meta."""
    if meta["tokenizer"] == "char":
        return CharTokenizer(meta["vocab"])
    return BPETokenizer(bpe_path)
