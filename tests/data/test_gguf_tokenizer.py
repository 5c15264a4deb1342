"""A GGUF file's tokenizer (data/gguf.py), read through HFTokenizer: a byte-level BPE (300 tokens
learned from TinyShakespeare) written as llama.cpp writes one gives transformers' ids for the same
file for GPT-2's, Llama 3's and Qwen2's splitting, and llama.cpp's for SmolLM2's (each digit apart);
its chat template, special tokens and end-of-text ids come with it; what we do not read is refused in
one line. With `pytest -m real`, SmolLM2-135M-Instruct's file against its folder."""

import json
import unicodedata

import pytest

from data.chat import folder_chat_template
from data.gguf import gguf_tokenizer
from data.tokenizer import HFTokenizer
from tests.helpers import MULTI_BYTE, shakespeare_tokenizer

gguf = pytest.importorskip("gguf")

TEXTS = ["Hello world! 123", "camelCaseWords and HTTPServer/path/to", "a  1 and  22 or\t7",
         "  multiple   spaces  ", "tabs\t\tand\n\n\nnewlines\r\n", MULTI_BYTE,
         "<|endoftext|>First Citizen:\nBefore we proceed<|endoftext|>", "12345 and 3.14159",
         "I'm sure they'll say it's fine, DON'T", "x\n\n 5 ½", "emoji 🎭🎉 and CJK 日本語", ""]


def shakespeare_vocab() -> tuple[list[str], list[str]]:
    """The test tokenizer's tokens by id and merges in order, with "ĠĠ" (two spaces) added last: then
    splitting a digit from the spaces before it changes the ids."""
    model = json.loads(shakespeare_tokenizer())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return [*tokens, "ĠĠ"], [*merges, "Ġ Ġ"]


def write_tokenizer(file, pre="gpt-2", meta=(), tokens=None):
    """A llama GGUF file holding only a tokenizer: the test vocabulary (or `tokens`) split as `pre`
    says, <|endoftext|> its one control token, BOS and EOS; `meta`'s keys beside (None: left out)."""
    vocab, merges = shakespeare_vocab()
    tokens = tokens or vocab
    eot = tokens.index("<|endoftext|>")
    keys = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": eot,
            "tokenizer.ggml.eos_token_id": eot,
            "tokenizer.ggml.token_type": [3 if t == "<|endoftext|>" else 1 for t in tokens]} | dict(meta)
    writer = gguf.GGUFWriter(str(file), "llama")
    for key, value in keys.items():
        if value is not None:
            kind = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32}.get(type(value))
            items = gguf.GGUFValueType.get_type(value[0]) if isinstance(value, list) else None
            writer.add_key_value(key, value, kind or gguf.GGUFValueType.get_type(value), sub_type=items)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file


def digits_apart(tokenizer, text: str) -> list[int]:
    """llama.cpp's ids for a SmolLM2-style vocabulary (tokenizer.ggml.pre smollm: each digit, \\p{N},
    a piece of its own, then GPT-2's regex), from `tokenizer`, a GPT-2-split one: each piece alone."""
    pieces = [""]
    for ch in text:
        if unicodedata.category(ch).startswith("N"):
            pieces += [ch, ""]
        else:
            pieces[-1] += ch
    return [i for piece in pieces if piece for i in tokenizer.encode(piece, add_special_tokens=False)]


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "tekken", "qwen2"])
def test_byte_level_bpe_gives_transformers_ids(tmp_path, pre):
    """GPT-2's regex, Llama 3's and Mistral Nemo's (with a BOS before each text, as their files say) and
    Qwen2's: transformers reads these as llama.cpp does, and so do we."""
    transformers = pytest.importorskip("transformers")
    bos = {"tokenizer.ggml.add_bos_token": pre in ("llama-bpe", "tekken")}
    file = write_tokenizer(tmp_path / f"{pre}.gguf", pre, bos)
    ours = HFTokenizer(file)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    assert ours.vocab_size == len(theirs) == 301
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
    assert (ours.encode("a")[0] == 0) == (pre in ("llama-bpe", "tekken"))  # (<|endoftext|>: the BOS here)


def test_smollm_splits_each_digit_as_llama_cpp(tmp_path):
    """tokenizer.ggml.pre smollm: each digit apart before GPT-2's regex (llama.cpp's llama-vocab.cpp,
    SmolLM2's own tokenizer.json: Digits then ByteLevel), which changes the ids of spaces before one."""
    gpt2 = HFTokenizer(write_tokenizer(tmp_path / "gpt2.gguf", "gpt-2"))
    smollm = HFTokenizer(write_tokenizer(tmp_path / "smollm.gguf", "smollm"))
    for text in TEXTS:
        assert smollm.encode(text) == digits_apart(gpt2, text), text
    two_spaces = gpt2.encode("  ")
    assert len(two_spaces) == 1 and smollm.encode("a  1") == gpt2.encode("a") + two_spaces + gpt2.encode("1")
    assert gpt2.encode("a  1") != smollm.encode("a  1")  # (GPT-2's regex alone: "a", " ", " 1")


def test_chat_template_special_tokens_and_end_of_text_ids(tmp_path):
    """The file's chat template, its special tokens by name, and as end-of-text ids its EOS then its
    EOT (llama.cpp ends a generation at either: Llama 3's <|end_of_text|> and <|eot_id|>); a control
    token is special, a user-defined one matched whole but not special; Llama 3's splitting adds a
    BOS where the file does not say (llama.cpp's default for it), GPT-2's does not."""
    tokens = [*shakespeare_vocab()[0], "<think>"]  # (user-defined: llama.cpp's type 4, as Qwen3's)
    types = [3 if t == "<|endoftext|>" else 4 if t == "<think>" else 1 for t in tokens]
    template = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    meta = {"tokenizer.chat_template": template, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.padding_token_id": 5}
    tokenizer = HFTokenizer(write_tokenizer(tmp_path / "llama3.gguf", "llama-bpe", meta, tokens))
    assert tokenizer.chat_template == template and tokenizer.eos_ids == (0, 7)
    assert tokenizer.special_tokens == {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                                        "pad_token": tokens[5]}
    assert tokenizer.encode("a<think>b") == [0, tokens.index("a"), 301, tokens.index("b")]
    assert tokenizer.tokenizer.decode([0, 301], skip_special_tokens=True) == "<think>"
    assert HFTokenizer(write_tokenizer(tmp_path / "gpt2.gguf", "gpt-2")).encode("a") == [tokens.index("a")]


def test_an_embedded_tokenizer_json_is_read_as_it_is(tmp_path):
    """tokenizer.huggingface.json, where a file holds it, is the tokenizer: no rebuilding."""
    text = shakespeare_tokenizer(bos=True)
    file = write_tokenizer(tmp_path / "embedded.gguf", meta={"tokenizer.huggingface.json": text,
                                                            "tokenizer.ggml.model": "llama"})
    assert gguf_tokenizer(file)[0] == text and HFTokenizer(file).encode("a")[0] == 0


REFUSED = {
    "SentencePiece": ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model='llama' is not supported"),
    "another splitting": ({"tokenizer.ggml.pre": "falcon"}, "tokenizer.ggml.pre='falcon' is not supported"),
    "an id that is not one": ({"tokenizer.ggml.eos_token_id": "x"},
                              "tokenizer.ggml.eos_token_id must be a token id, got x"),
    "no tokens": ({"tokenizer.ggml.tokens": None}, "has no tokenizer.ggml.tokens"),
    "no merges": ({"tokenizer.ggml.merges": None}, "has no tokenizer.ggml.merges"),
    "a token twice": ({"tokenizer.ggml.tokens": [*shakespeare_vocab()[0][:300], "a"]},
                      "tokenizer.ggml.tokens holds 'a' twice"),
}


def test_ids_past_the_vocabulary_are_dropped_and_end_tokens_end_a_sample(tmp_path):
    """As llama.cpp: a special id past the vocabulary is left out (the file still reads); a control
    token whose text ends a turn (<|im_end|>, ...) is an end-of-text id beside the file's eos."""
    vocab = shakespeare_vocab()[0]
    tokens = [*vocab, "<|im_end|>"]
    file = write_tokenizer(tmp_path / "x.gguf", meta={"tokenizer.ggml.padding_token_id": 999,
                                                      "tokenizer.ggml.token_type": [
                                                          3 if t in ("<|endoftext|>", "<|im_end|>") else 1
                                                          for t in tokens]}, tokens=tokens)
    tokenizer = HFTokenizer(file)
    assert "pad_token" not in tokenizer.special_tokens
    assert tokenizer.eos_ids == (vocab.index("<|endoftext|>"), len(vocab))


@pytest.mark.parametrize("case", REFUSED)
def test_what_we_do_not_read_is_refused_in_one_line(tmp_path, case):
    meta, message = REFUSED[case]
    file = write_tokenizer(tmp_path / "x.gguf", meta=meta)
    with pytest.raises(ValueError) as error:
        HFTokenizer(file)
    text = str(error.value)
    assert text.startswith(str(file)) and message in text and "\n" not in text, text


def test_a_file_that_is_not_gguf_is_refused_in_one_line(tmp_path):
    (tmp_path / "text.gguf").write_text("not a GGUF file")
    with pytest.raises(ValueError, match=r"text\.gguf is not a GGUF file kvgpt can read \(.*\)$"):
        HFTokenizer(tmp_path / "text.gguf")
    with pytest.raises(ValueError, match=r"missing\.gguf cannot be read \(FileNotFoundError"):
        gguf_tokenizer(tmp_path / "missing.gguf")


@pytest.mark.real
def test_smollm2_gguf_tokenizer_is_its_folders(smollm2):
    """SmolLM2-135M-Instruct's file: the folder's chat template and special tokens; its end-of-text
    ids the file's eos (2, <|im_end|>) and, as llama.cpp, its control token <|endoftext|>; its ids
    are the folder's, but where a digit follows spaces, another digit or a
    newline: transformers' GGUF reader splits SmolLM2's text with GPT-2's regex alone, llama.cpp (and
    SmolLM2's own tokenizer.json) each digit apart first, as we do."""
    folder, file = smollm2
    ours, theirs = HFTokenizer(file), HFTokenizer(folder / "tokenizer.json")
    assert (ours.chat_template, ours.special_tokens) == folder_chat_template(folder)
    assert theirs.eos_ids == (2,) and ours.decode([2]) == "<|im_end|>"
    assert ours.eos_ids == (2, 0) and ours.decode([0]) == "<|endoftext|>"  # (llama.cpp ends at both)
    assert ours.vocab_size == theirs.vocab_size == 49152
    chat = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi! 2+2=?<|im_end|>\n"
            "<|im_start|>assistant\n")
    texts = [*TEXTS, chat, "def f(x):\n    return x ** 2  # squared\n", "Price: $1,299.99 (was $1,499)",
             "\u00a0non-breaking\u2003em space", "Zürich, Ελληνικά, русский, العربية", "🏳️‍🌈 👍🏽"]
    for text in texts:
        assert ours.encode(text) == digits_apart(theirs, text), text
        assert ours.decode(ours.encode(text)) == text
    same = [t for t in texts if digits_apart(theirs, t) == theirs.encode(t)]
    assert len(same) >= 10 and all(ours.encode(t) == theirs.encode(t) for t in same)
    assert ours.encode("a  1") == [81, 256, 33] and theirs.encode("a  1") == [81, 216, 216, 33]
