"""Tokenizers with one small interface: encode, decode, token_bytes, vocab_size, name; and
TextStream, the text of tokens that come one at a time. GPT-2's BPE ranks ship with the package
(data/assets/gpt2.tiktoken), so nothing is downloaded; a Hugging Face model folder's own
tokenizer.json is read with the `tokenizers` library (HFTokenizer)."""

import base64
import codecs
import hashlib
import json
import operator
from pathlib import Path

import tiktoken
from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

# The shipped GPT-2 (r50k_base) ranks file and its sha256 (the hash tiktoken itself checks).
GPT2_BPE_PATH = Path(__file__).parent / "assets" / "gpt2.tiktoken"
GPT2_BPE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_VOCAB_SIZE = 50257


class CharTokenizer:
    name = "char"
    eos_ids = ()  # (a corpus of characters has no end-of-text)
    chat_template = None

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
        return "".join(self.chars[i] for i in token_ids(ids, self.vocab_size))

    def token_bytes(self, token: int) -> bytes:
        return self.chars[token_ids([token], self.vocab_size)[0]].encode()


class BPETokenizer:
    """GPT-2's byte-level BPE through tiktoken: 50,257 tokens, <|endoftext|> = 50256."""

    name = "bpe"
    chat_template = None

    def __init__(self):
        self.encoding = gpt2_encoding()
        self.eot_token = self.encoding.eot_token
        self.eos_ids = (self.eot_token,)  # a sample ends at <|endoftext|>

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)  # special tokens in text stay plain text

    def decode(self, ids) -> str:
        # bytes that are not UTF-8 become U+FFFD
        return self.encoding.decode(token_ids(ids, self.vocab_size))

    def token_bytes(self, token: int) -> bytes:
        return self.encoding.decode_single_token_bytes(token_ids([token], self.vocab_size)[0])


class HFTokenizer:
    """A Hugging Face model folder's tokenizer.json through `tokenizers`, the library made for it:
    its pre-tokenizer, merges and special tokens as the model was trained with them. encode adds
    what the folder's post-processor adds (Llama 3's <|begin_of_text|>), as transformers'
    tokenizer(text) does. A token's bytes: a byte-level BPE's (GPT-2's alphabet: Llama 3, Qwen,
    SmolLM2), or a SentencePiece piece's (▁ a space, <0x0A> a byte); an added token's, its text.
    Beside the ids: the folder's end-of-text ids (eos_ids), chat template and special tokens
    (data.chat). A GGUF file's tokenizer (path a .gguf file) comes from its metadata (data.gguf)."""

    name = "hf"

    def __init__(self, path):
        from tokenizers import Tokenizer  # (~0.1 s: only when a folder's tokenizer is asked for)

        from data.chat import folder_chat_template, folder_eos_ids

        self.path = Path(path)
        if self.path.suffix.lower() == ".gguf":
            from data.gguf import gguf_tokenizer

            text, self.chat_template, self.special_tokens, eos_ids = gguf_tokenizer(self.path)
        else:
            text, eos_ids = tokenizer_json(self.path), None
            self.chat_template, self.special_tokens = folder_chat_template(self.path.parent)
        try:
            self.tokenizer = Tokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001  the library's own error for a file it cannot parse
            raise ValueError(f"{self.path} is not a tokenizer.json ({type(e).__name__}: {e})") from e
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_ids = folder_eos_ids(self.path.parent, self.vocab_size) if eos_ids is None else eos_ids
        self.added = {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        self.byte_level = '"ByteLevel"' in json.dumps(json.loads(self.tokenizer.to_str()).get("decoder"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # tokenizers' word for a str Rust cannot hold: one with a lone surrogate
            check_utf8(text)
            raise

    def decode(self, ids) -> str:
        return b"".join(map(self.token_bytes, token_ids(ids, self.vocab_size))).decode("utf-8", "replace")

    def token_bytes(self, token: int) -> bytes:
        token = token_ids([token], self.vocab_size)[0]
        piece = self.tokenizer.id_to_token(token) or ""
        if token in self.added:
            return self.added[token].encode()
        if self.byte_level and all(c in BYTE_LEVEL for c in piece):
            return bytes(BYTE_LEVEL[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # a byte of its own
            return bytes([int(piece[3:5], 16)])
        return piece.replace("▁", " ").encode()


def tokenizer_json(path: Path) -> str:
    """The tokenizer.json at `path`, or where a folder has none, its GPT-2-style vocab.json and
    merges.txt (a GPT-2 saved by transformers' slow tokenizer) as the byte-level BPE they are, with
    <|endoftext|> added where the vocabulary holds it."""
    if path.is_file():
        return path.read_text()
    vocab, merges = path.parent / "vocab.json", path.parent / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        raise FileNotFoundError(f"no tokenizer.json in {path.parent} (nor vocab.json and merges.txt): a "
                                f"Hugging Face model folder needs its tokenizer to sample text")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    if tokenizer.token_to_id(ENDOFTEXT) is not None:
        tokenizer.add_special_tokens([AddedToken(ENDOFTEXT, special=True)])
    return tokenizer.to_str()


def check_utf8(text: str, what: str = "text") -> None:
    """text is Unicode that UTF-8 can hold: a lone surrogate (a byte that was not UTF-8, as Python
    hands over a command-line argument: a surrogate escape) is a ValueError naming `what` and where,
    as read_text_files says of a file."""
    bad = next((i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF), None)
    if bad is not None:
        offset, code = len(text[:bad].encode()), ord(text[bad])
        escaped = 0xDC80 <= code <= 0xDCFF  # the byte code - 0xDC00, as surrogateescape hands it over
        byte = f"byte 0x{code - 0xDC00:02x}" if escaped else f"U+{code:04X}, a lone surrogate,"
        raise ValueError(f"{what} is not UTF-8: {byte} at offset {offset} (a terminal in another "
                         f"encoding? give it in UTF-8)")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, each character to its byte: the bytes that print as themselves
    are those characters; every other byte, in order, is chr(256), chr(257), ... (so that a BPE
    vocabulary is printable text)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


BYTE_LEVEL = byte_level_alphabet()


def token_ids(ids, vocab_size: int) -> list[int]:
    """ids as a list of ints, each an id of a vocabulary of vocab_size, else a ValueError: a negative
    id would read the vocabulary from its end (a list's index), one past it would be tiktoken's
    KeyError or OverflowError."""
    try:
        ids = [operator.index(i) for i in ids]  # ints of any kind (numpy's, a tensor's items)
    except TypeError as e:
        raise ValueError(f"token ids must be integers: {e}") from None
    if bad := [i for i in ids if not 0 <= i < vocab_size]:
        raise ValueError(f"token ids must be in 0..{vocab_size - 1} (the tokenizer's vocabulary), got "
                         f"{bad[0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else ""))
    return ids


class TextStream:
    """The text of tokens given one at a time, for printing as they come. A token may end inside
    a character (GPT-2 writes ’ as two tokens of UTF-8 bytes): that character is held back until
    its last byte comes, so the pieces returned join to exactly `tokenizer.decode` of all the
    tokens, never a replacement character where the text has none."""

    def __init__(self, tokenizer):
        self.token_bytes = tokenizer.token_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        """The text that this token completes (often all of it; "" while a character is cut)."""
        return self.decoder.decode(self.token_bytes(token))

    def end(self) -> str:
        """What is held back at the end: U+FFFD for bytes that never made a character."""
        return self.decoder.decode(b"", final=True)


def gpt2_encoding(bpe_path=GPT2_BPE_PATH) -> tiktoken.Encoding:
    """GPT-2's encoding (the same as tiktoken's "gpt2" and "r50k_base") from the shipped ranks
    file, sha256-checked. Read here rather than by tiktoken.load, whose file cache would follow
    the user's $TIKTOKEN_CACHE_DIR; the format is tiktoken's: `<base64 token> <rank>` per line."""
    try:
        contents = Path(bpe_path).read_bytes()
    except OSError as e:
        raise type(e)(f"cannot read GPT-2's BPE ranks {bpe_path} ({e.strerror or e}): reinstall kvgpt") from e
    if (digest := hashlib.sha256(contents).hexdigest()) != GPT2_BPE_SHA256:
        raise ValueError(f"{bpe_path} has sha256 {digest}, expected {GPT2_BPE_SHA256}: reinstall kvgpt")
    ranks = {base64.b64decode(token): int(rank)
             for token, rank in (line.split() for line in contents.splitlines() if line)}
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=GPT2_VOCAB_SIZE)


def tokenizer_from_meta(meta: dict):
    """The tokenizer that prepared a dataset (or trained a checkpoint, or came with a Hugging Face
    model folder), from its meta (checked)."""
    if isinstance(meta, dict) and meta.get("tokenizer") == "hf":
        return HFTokenizer(meta.get("path", ""))
    meta_vocab_size(meta)
    return BPETokenizer() if meta["tokenizer"] == "bpe" else CharTokenizer(meta["vocab"])


def meta_vocab_size(meta) -> int:
    """The vocabulary size of the tokenizer a meta (read back from a file) names; a meta that names
    none of ours is a ValueError that says what is wrong."""
    kind = meta.get("tokenizer") if isinstance(meta, dict) else None
    if kind == "bpe":
        return GPT2_VOCAB_SIZE
    if kind == "hf":
        return HFTokenizer(meta.get("path", "")).vocab_size
    if kind != "char":
        raise ValueError(f"its data meta names no tokenizer (tokenizer: {kind!r}, not char or bpe)")
    vocab = meta.get("vocab")
    if not (isinstance(vocab, list) and vocab and all(isinstance(c, str) and len(c) == 1 for c in vocab)
            and len(set(vocab)) == len(vocab)):
        raise ValueError("its data meta's char vocabulary is not a list of distinct characters")
    return len(vocab)


def start_ids(tokenizer) -> list[int]:
    """Where a sample with no prompt starts: a newline, or in a char vocabulary without one (a
    corpus of a single line), its first character."""
    if isinstance(tokenizer, CharTokenizer) and "\n" not in tokenizer.stoi:
        return [0]
    return tokenizer.encode("\n")


def is_gpt2_bpe(file: Path) -> bool:
    """Whether the tokenizer.json `file` is GPT-2's BPE itself (as the Hub's GPT-2 folders hold it):
    GPT-2's 50,257 tokens at GPT-2's ids, merge i making token 256 + i (GPT-2's order: its ids are
    its merges' ranks), read and written at the byte level as GPT-2 does (no normalizer, no prefix
    space, no token added to a text, no dropout, <|endoftext|> its one special token). Then our
    shipped ranks are the same tokenizer (tokenizer_json: a GPT-2's vocab.json and merges.txt
    too). Anything else, or a file it cannot read, is not."""
    if Path(file).suffix.lower() == ".gguf":  # (a GGUF file's tokenizer: not read as a tokenizer.json)
        return False
    try:
        tokenizer = json.loads(tokenizer_json(file))
        model, pre = tokenizer["model"], tokenizer["pre_tokenizer"]
        vocab, merges = model["vocab"], model["merges"]
        settings = (tokenizer.get("normalizer") is None and pre.get("type") == "ByteLevel"
                    and not pre.get("add_prefix_space") and pre.get("use_regex", True)
                    and (tokenizer.get("post_processor") or {}).get("type", "ByteLevel") == "ByteLevel"
                    and {(t["id"], t["content"]) for t in tokenizer.get("added_tokens") or []}
                    <= {(GPT2_VOCAB_SIZE - 1, "<|endoftext|>")}
                    and model.get("type") == "BPE" and model.get("dropout") is None
                    and not model.get("byte_fallback") and not model.get("continuing_subword_prefix")
                    and not model.get("end_of_word_suffix"))
        ids = sorted(vocab.values())
        if not settings or ids != list(range(GPT2_VOCAB_SIZE)) or len(merges) != GPT2_VOCAB_SIZE - 257 \
                or vocab.get("<|endoftext|>") != GPT2_VOCAB_SIZE - 1:
            return False
        encoding = gpt2_encoding()
        if any(i != GPT2_VOCAB_SIZE - 1 and bytes(BYTE_LEVEL[c] for c in token)
               != encoding.decode_single_token_bytes(i) for token, i in vocab.items()):
            return False
        pairs = (m.split(" ") if isinstance(m, str) else m for m in merges)  # "a b", or [a, b] (newer)
        return all(len(pair) == 2 and pair[0] in vocab and pair[1] in vocab
                   and vocab.get(pair[0] + pair[1]) == 256 + i for i, pair in enumerate(pairs))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # (not a tokenizer.json we know)
        return False


def same_tokenizer(meta: dict, other: dict) -> bool:
    """Whether two metas (a prepared dataset's, a checkpoint's) name the same tokenizer, so that
    every id means the same text: both GPT-2's BPE (a Hugging Face folder's tokenizer.json that is
    GPT-2's BPE itself too), char with the same characters in order, or one tokenizer.json."""
    meta, other = ({"tokenizer": "bpe"} if m["tokenizer"] == "hf" and is_gpt2_bpe(Path(m["path"])) else m
                   for m in (meta, other))
    same_kind = meta["tokenizer"] == other["tokenizer"]
    if same_kind and meta["tokenizer"] in ("char", "hf"):
        key = "vocab" if meta["tokenizer"] == "char" else "path"
        return meta[key] == other[key]
    return same_kind


def describe_tokenizer(meta: dict) -> str:
    """'the char tokenizer of 65 characters', 'GPT-2's BPE'."""
    if meta["tokenizer"] == "char":
        return f"the char tokenizer of {len(meta['vocab'])} characters"
    return f"the tokenizer {meta['path']}" if meta["tokenizer"] == "hf" else "GPT-2's BPE"
