"""A GGUF file's tokenizer, rebuilt from its metadata (llama.cpp's tokenizer.ggml.* keys) as the
tokenizer.json text HFTokenizer reads, beside its chat template, special tokens and end-of-text ids.

Byte-level BPE vocabularies (tokenizer.ggml.model "gpt2": Llama 3, Mistral Nemo, Qwen2, SmolLM2)
are read; the text is split before BPE as llama.cpp splits it for the file's tokenizer.ggml.pre, so
the ids are llama.cpp's. A file that embeds its tokenizer.json (tokenizer.huggingface.json) gives it
as it is.
"""

import functools
import json
from pathlib import Path

# llama.cpp's token types (tokenizer.ggml.token_type): a control token is a special token of
# tokenizer.json, a user-defined one a plain added token; both are matched whole in a text.
CONTROL, USER_DEFINED = 3, 4
SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
               "pad_token": "padding_token_id"}
# The end-of-text ids: llama.cpp ends a generation at any of them (eot: Llama 3's <|eot_id|>; eom:
# its <|eom_id|>), as transformers does at generation_config.json's list; and at a control token of
# one of END_TOKENS' texts (llama-vocab.cpp's list, for files that name no eot).
EOS_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")
END_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
              "<EOT>", "<|end_of_text|>", "<|return|>", "<|call|>")

# How llama.cpp splits a text before BPE (llama-vocab.cpp), by tokenizer.ggml.pre: GPT-2's regex
# (ByteLevel's own); or each digit alone first (SmolLM2, StarCoder: tokenizers' Digits); or Llama 3's,
# Mistral Nemo's (tekken: its tokenizer.json's, which llama.cpp's approximates) or Qwen2's regex.
# Llama 3 and tekken also take a word that is a token whole, whatever the merges say, and add a BOS
# before each text unless the file says otherwise.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


DIGITS = {"type": "Digits", "individual_digits": True}
# tokenizer.ggml.pre: (the pre-tokenizers in order, Llama 3's way or not: whole words first, a BOS)
PRE_TOKENIZERS = {
    "gpt-2": ([byte_level(True)], False),
    **dict.fromkeys(["smollm", "starcoder", "refact", "codeshell"], ([DIGITS, byte_level(True)], False)),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe"], ([split(LLAMA3_SPLIT), byte_level(False)], True)),
    "tekken": ([split(TEKKEN_SPLIT), byte_level(False)], True),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen"], ([split(QWEN2_SPLIT), byte_level(False)], False)),
}


def gguf_tokenizer(path) -> tuple[str, str | None, dict[str, str], tuple[int, ...]]:
    """(tokenizer.json text, chat template or None, special tokens by name, end-of-text ids) of the
    GGUF file `path`: a ValueError naming the file and the key where it has no tokenizer we read."""
    path = Path(path).expanduser()
    try:
        stat = path.stat()
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e})") from e
    return read_tokenizer(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)  # (kept while the file is unchanged: a file's tokenizer is asked for often)
def read_tokenizer(path: str, mtime_ns: int, size: int):
    from gguf import GGUFReader

    try:
        fields = {key: field.contents() for key, field in GGUFReader(path).fields.items()
                  if key.startswith("tokenizer.")}
    except Exception as e:  # noqa: BLE001  the library's own error for a damaged or truncated file
        raise ValueError(f"{path} is not a GGUF file kvgpt can read ({type(e).__name__}: {e})") from e
    tokens = fields.get("tokenizer.ggml.tokens")
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
        raise ValueError(f"{path} has no tokenizer.ggml.tokens (a list of strings) in its metadata")
    ids = {name: token_id(fields, f"tokenizer.ggml.{key}", len(tokens), path)
           for name, key in SPECIAL_IDS.items()}
    special = {name: tokens[i] for name, i in ids.items() if i is not None}
    types = fields.get("tokenizer.ggml.token_type") or []
    named = [i for i, kind in enumerate(types) if kind == CONTROL and tokens[i] in END_TOKENS]
    eos_ids = tuple(dict.fromkeys([*(i for key in EOS_KEYS
                                     if (i := token_id(fields, f"tokenizer.ggml.{key}", len(tokens), path))
                                     is not None), *named]))
    template = fields.get("tokenizer.chat_template")
    text = fields.get("tokenizer.huggingface.json")
    if not isinstance(text, str):
        text = json.dumps(byte_level_bpe(fields, tokens, ids["bos_token"], ids["eos_token"], path))
    return text, template if isinstance(template, str) else None, special, eos_ids


def token_id(fields: dict, key: str, vocab_size: int, path: str) -> int | None:
    """The id metadata `key` holds: None where it is absent or past the vocabulary (llama.cpp too
    carries on without it); a value that is not an integer is a ValueError naming the key."""
    value = fields.get(key)
    if value is not None and not (isinstance(value, int) and value >= 0):
        raise ValueError(f"{path}: {key} must be a token id, got {str(value)[:60]}")
    return value if value is not None and value < vocab_size else None


def byte_level_bpe(fields: dict, tokens: list[str], bos: int | None, eos: int | None, path: str) -> dict:
    """tokenizer.json of the file's byte-level BPE: its tokens at their ids, its merges in their
    order, control and user-defined tokens added at their ids, split as llama.cpp splits for its
    tokenizer.ggml.pre, and a BOS (an EOS) before (after) each text where the file says so."""
    model, pre = fields.get("tokenizer.ggml.model"), fields.get("tokenizer.ggml.pre", "gpt-2")
    if model != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model={model!r} is not supported (kvgpt reads byte-level "
                         f"BPE vocabularies, 'gpt2': Llama 3, Qwen2, SmolLM2)")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported (kvgpt splits text as "
                         f"llama.cpp does for {', '.join(PRE_TOKENIZERS)})")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) < len(tokens):  # (llama.cpp refuses it too: one text, two ids)
        twice = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise ValueError(f"{path}: tokenizer.ggml.tokens holds {twice!r} twice")
    merges, types = fields.get("tokenizer.ggml.merges"), fields.get("tokenizer.ggml.token_type") or []
    if not (isinstance(merges, list) and all(isinstance(m, str) and m.count(" ") == 1 for m in merges)):
        raise ValueError(f"{path} has no tokenizer.ggml.merges (a list of 'left right' strings) in its "
                         f"metadata")
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind == CONTROL}
             for i, kind in enumerate(types) if kind in (CONTROL, USER_DEFINED)]
    pre_tokenizers, llama3 = PRE_TOKENIZERS[pre]
    add_bos = fields.get("tokenizer.ggml.add_bos_token", llama3) and bos is not None
    add_eos = fields.get("tokenizer.ggml.add_eos_token", False) and eos is not None
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None, "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
            "post_processor": template_processing([tokens[bos]] if add_bos else [], [tokens[eos]] if add_eos
                                                  else [], vocab),
            "decoder": byte_level(True),
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": llama3, "vocab": vocab, "merges": merges}}


def template_processing(before: list[str], after: list[str], vocab: dict) -> dict | None:
    """tokenizers' TemplateProcessing adding the tokens `before` and `after` each text (None: none)."""
    if not before and not after:
        return None

    def sequence(name, type_id):
        return ([{"SpecialToken": {"id": t, "type_id": type_id}} for t in before] +
                [{"Sequence": {"id": name, "type_id": type_id}}] +
                [{"SpecialToken": {"id": t, "type_id": type_id}} for t in after])

    return {"type": "TemplateProcessing", "single": sequence("A", 0),
            "pair": sequence("A", 0) + sequence("B", 1),
            "special_tokens": {t: {"id": t, "ids": [vocab[t]], "tokens": [t]} for t in before + after}}
