"""data/: the shipped files, tokenizers, preparation (splits, hashes, idempotence, bad corpora)
and batches."""

import dataclasses
import functools
import json
import math
import random
import re
import shutil

import numpy as np
import pytest
import torch

from data.batches import Batches
from data.prepare import TINYSHAKESPEARE_PATH, DataConfig, corpus_files, load_prepared, prepare
from data.tokenizer import (
    BPETokenizer,
    CharTokenizer,
    HFTokenizer,
    TextStream,
    gpt2_encoding,
    tokenizer_from_meta,
)
from tests.helpers import (
    MULTI_BYTE,
    ROOT,
    assert_one_line_error,
    data_config,
    disk_full_after,
    finish,
    run_in_process,
    shakespeare_tokenizer,
    start_cli,
)


def test_char_split_matches_nanogpt(char_data):
    meta, train, val = load_prepared(char_data)
    assert meta["vocab_size"] == 65 and len(meta["vocab"]) == 65
    assert (meta["train_tokens"], meta["val_tokens"]) == (1_003_854, 111_540)
    assert (len(train), len(val)) == (1_003_854, 111_540)
    assert train.dtype == np.uint16


def test_bpe_split_matches_nanogpt(bpe_data):
    meta, train, val = load_prepared(bpe_data)
    assert meta["tokenizer"] == "bpe" and meta["vocab_size"] == 50257
    assert (len(train), len(val)) == (301_966, 36_059)
    assert train.dtype == np.uint16


@pytest.fixture(scope="module")
def gpt2_bpe() -> BPETokenizer:
    """GPT-2's BPE, read once for the module's tests (its ranks take a fifth of a second to read and
    check; tiktoken's Encoding holds no state between calls)."""
    return BPETokenizer()


def test_gpt2_bpe_facts(gpt2_bpe):
    tok = gpt2_bpe
    assert tok.vocab_size == 50257 and tok.eot_token == 50256
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2's well-known ids


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_round_trip_whole_corpus(kind, char_data, bpe_data):
    text = TINYSHAKESPEARE_PATH.read_text()
    meta, train, val = load_prepared(char_data if kind == "char" else bpe_data)
    tok = tokenizer_from_meta(meta)
    assert tok.decode(tok.encode(text)) == text
    # The prepared arrays decode back to the two halves of the text, split at 90% of characters.
    cut = int(len(text) * 0.9)
    assert tok.decode(train.tolist()) == text[:cut] and tok.decode(val.tolist()) == text[cut:]


def sentencepiece_tokenizer() -> str:
    """tokenizer.json as Llama 2's and Mistral's: SentencePiece pieces (▁ for a space) and a token
    for each byte that no piece holds (byte fallback), here over ASCII letters and punctuation."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = "▁" + string.ascii_letters + string.digits + ".,:;!?'-"
    vocab = {"<unk>": 0} | {f"<0x{b:02X}>": 1 + b for b in range(256)}
    vocab |= {c: 257 + i for i, c in enumerate(pieces)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tokenizer.to_str()


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_a_hugging_face_tokenizer_json_round_trips_and_streams(tmp_path, kind):
    """A folder's tokenizer.json through `tokenizers`: a byte-level BPE (Llama 3's, Qwen's) decodes as
    the library does; SentencePiece's byte pieces give their bytes and ▁ a space (the text's first,
    which the library's decoder strips, kept: a sample's text continues its prompt). Streamed one
    token at a time, the pieces join to decode; characters of several bytes come out whole."""
    path = tmp_path / "tokenizer.json"
    path.write_text(shakespeare_tokenizer() if kind == "byte_level" else sentencepiece_tokenizer())
    tok = tokenizer_from_meta({"tokenizer": "hf", "path": str(path)})
    ids = tok.encode(MULTI_BYTE)
    assert tok.decode(ids) == (MULTI_BYTE if kind == "byte_level" else " " + MULTI_BYTE)
    assert tok.decode(ids).lstrip(" ") == tok.tokenizer.decode(ids).lstrip(" ")
    stream = TextStream(tok)
    assert "".join(stream.add(t) for t in ids) + stream.end() == tok.decode(ids)
    assert tok.vocab_size == (300 if kind == "byte_level" else 1 + 256 + 1 + 26 * 2 + 10 + 8)


def test_text_that_is_not_utf8_is_a_value_error_saying_where(tmp_path):
    """A str holding a surrogate escape (a byte that was not UTF-8, as Python hands over a command-line
    argument): `tokenizers` raised a TypeError ("TextInputSequence must be str") on it."""
    (tmp_path / "tokenizer.json").write_text(shakespeare_tokenizer())
    with pytest.raises(ValueError, match=r"^text is not UTF-8: byte 0xfe at offset 5 \(a terminal in"):
        HFTokenizer(tmp_path / "tokenizer.json").encode("né b\udcfe")


def test_a_missing_or_broken_tokenizer_json_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no tokenizer.json in {tmp_path}"):
        HFTokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json is not a tokenizer.json"):
        HFTokenizer(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_text_stream_pieces_join_to_the_decoded_text(kind, gpt2_bpe):
    """Tokens one at a time: what has been streamed is always a prefix of the whole text, and all of
    it equals `decode`. For BPE, also random runs of single-byte tokens: characters cut at every
    byte, and bytes that never make a character (U+FFFD, as decode gives)."""
    tok = CharTokenizer.from_text(MULTI_BYTE) if kind == "char" else gpt2_bpe
    sequences = [tok.encode(MULTI_BYTE)]
    if kind == "bpe":
        byte_tokens = [tok.encoding.encode_single_token(bytes([b])) for b in range(256)]
        rng = random.Random(0)
        sequences += [[rng.choice(byte_tokens) if rng.random() < 0.8 else rng.randrange(50257)
                       for _ in range(rng.randint(1, 12))] for _ in range(500)]
    for ids in sequences:
        whole, stream, streamed = tok.decode(ids), TextStream(tok), ""
        for token in ids:
            streamed += stream.add(token)
            assert whole.startswith(streamed)
        assert streamed + stream.end() == whole
    assert "\ufffd" not in "".join(map(TextStream(tok).add, tok.encode(MULTI_BYTE)))


def test_char_oov_error_names_the_characters():
    tok = CharTokenizer.from_text("abc ")
    with pytest.raises(ValueError, match=r"'z', 'é'"):
        tok.encode("a zé")


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_an_id_outside_the_vocabulary_is_refused_not_read_from_the_end(kind, gpt2_bpe):
    """-1 is not the last character (a list's index), nor vocab_size tiktoken's KeyError or 2**64
    its OverflowError: each is a ValueError naming the id, in decode and token_bytes alike."""
    tok = CharTokenizer.from_text("abc") if kind == "char" else gpt2_bpe
    last = tok.vocab_size - 1
    assert tok.decode([0, last]) == tok.decode(np.array([0, last])) == tok.decode(torch.tensor([0, last]))
    for ids in ([-1], [tok.vocab_size], [0, 2**64], [1.0]):
        with pytest.raises(ValueError, match=rf"token ids must be (in 0\.\.{last}|integers)"):
            tok.decode(ids)
        with pytest.raises(ValueError, match="token ids must be"):
            tok.token_bytes(ids[-1])


def test_reprepare_identical_inputs_does_no_work(char_data):
    before = {p.name: p.stat().st_mtime_ns for p in char_data.iterdir()}
    again = prepare(data_config(f"data.path={TINYSHAKESPEARE_PATH}"))  # the same bytes, named
    assert again == char_data
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == before


def test_changed_input_or_tokenizer_reprepares(tmp_path):
    corpus = tmp_path / "a.txt"
    corpus.write_text("hello there, hello again\n" * 40)
    cfg = data_config("data=text_files", f"data.path={corpus}", f"data.cache_dir={tmp_path / 'c'}")
    first = prepare(cfg)
    corpus.write_text("something else entirely\n" * 40)
    second = prepare(cfg)
    third = prepare(dataclasses.replace(cfg, tokenizer="bpe"))
    assert len({first, second, third}) == 3
    assert load_prepared(third)[0]["tokenizer"] == "bpe"


def test_text_files_glob_and_list(tmp_path):
    for name, text in [("b.txt", "second\n"), ("a.txt", "first\n")]:
        (tmp_path / name).write_text(text * 50)
    globbed = prepare(data_config("data=text_files", f"data.path={tmp_path}/*.txt",
                                  f"data.cache_dir={tmp_path / 'c'}"))
    listed = prepare(data_config("data=text_files", f"data.path=[{tmp_path}/a.txt,{tmp_path}/b.txt]",
                                 f"data.cache_dir={tmp_path / 'c'}"))
    assert globbed == listed
    meta, train, val = load_prepared(globbed)
    assert meta["train_tokens"] + meta["val_tokens"] == 50 * len("first\nsecond\n")


def test_a_damaged_prepared_folder_names_itself(tmp_path):
    (tmp_path / "a.txt").write_text("some text\n" * 20)
    prepared = prepare(data_config("data=text_files", f"data.path={tmp_path}/a.txt",
                                   f"data.cache_dir={tmp_path / 'c'}"))
    (prepared / "meta.json").write_text("{truncated")
    with pytest.raises(ValueError, match=rf"{prepared} is damaged .*delete it"):
        load_prepared(prepared)


def test_wrong_hash_is_an_error_and_writes_nothing(tmp_path):
    bad = tmp_path / "input.txt"
    bad.write_text("not shakespeare\n" * 10)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="data.sha256: .* has sha256"):
        prepare(data_config(f"data.path={bad}", f"data.cache_dir={cache}", "data.sha256=" + "0" * 64))
    assert not cache.exists() or not any(cache.rglob("*.*"))


def run_prepare(*overrides):
    """`python -m cli.prepare <overrides>`, run in this process."""
    return run_in_process("-m", "cli.prepare", *overrides)


SHIPPED_DATA = "test_the_shipped_data_needs_no_network_no_variables_and_no_home"


def fresh_machine(home) -> dict:
    """The environment of a fresh machine: an empty home, no network, no settings (and no KVGPT_CACHE:
    the callers unset it)."""
    return {"HOME": str(home), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
            "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}


@pytest.fixture(scope="module", autouse=True)
def bpe_on_a_fresh_machine(request, tmp_path_factory):
    """(home, process) of the shipped-data test's new process, `python -m cli.prepare
    data=shakespeare_bpe` on a fresh machine (fresh_machine, KVGPT_CACHE unset), started with this
    module's first test: the seconds it spends starting and preparing are spent beside the module's
    other tests, in this process; that test awaits it. None where that test is not selected."""
    if not any(item.name == SHIPPED_DATA for item in request.session.items):
        yield None
        return
    home = tmp_path_factory.mktemp("fresh_machine") / "home"
    home.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KVGPT_CACHE")  # (start_cli hands the command this process's environment)
        proc = start_cli("-m", "cli.prepare", "data=shakespeare_bpe", env=fresh_machine(home))
    yield home, proc
    if proc.returncode is None:  # not awaited: its test failed before
        proc.kill()
        proc.communicate()


def test_the_shipped_data_needs_no_network_no_variables_and_no_home(bpe_on_a_fresh_machine, monkeypatch):
    """A fresh machine: an empty home, no network, no settings: both built-in corpora prepare (GPT-2's
    BPE in a new process, where nothing of the tokenizer is loaded yet, started with the module)."""
    home, bpe = bpe_on_a_fresh_machine
    monkeypatch.delenv("KVGPT_CACHE")
    char = run_in_process("-m", "cli.prepare", "data=shakespeare_char", env=fresh_machine(home))
    bpe = finish(bpe)
    for result, tokens in [(char, "1,003,854 train"), (bpe, "301,966 train")]:
        assert result.returncode == 0 and tokens in result.stdout, result.stderr[-2000:]
    prepared = sorted(p.parent.name.split("-")[-2] for p in (home / ".cache/kvgpt").glob("*/meta.json"))
    assert prepared == ["bpe", "char"]  # both in the home's cache


def test_shipped_files_are_checked_by_hash(tmp_path):
    damaged = tmp_path / "gpt2.tiktoken"
    damaged.write_bytes(gpt2_encoding.__defaults__[0].read_bytes()[:-10])
    with pytest.raises(ValueError, match="expected 306cd27f.*reinstall kvgpt"):
        gpt2_encoding(damaged)
    with pytest.raises(OSError, match="cannot read GPT-2's BPE ranks"):
        gpt2_encoding(tmp_path / "missing.tiktoken")


def test_prepare_command_line(char_data):
    result = run_prepare()
    assert result.returncode == 0, result.stderr
    assert "1,003,854 train and 111,540 val tokens" in result.stdout


def test_text_files_without_a_path_names_data_path(tmp_path):
    result = run_prepare("data=text_files", f"data.cache_dir={tmp_path}")
    assert_one_line_error(result, "data.path is not set")


@pytest.mark.parametrize("content, message", [
    (b"good text\n" * 10 + b"caf\xe9 au lait\n", r"is not UTF-8 text: byte 0xe9 at offset 103"),
    (b"\x89PNG\r\n\x1a\n" + bytes(range(256)), r"is not UTF-8 text: byte 0x89 at offset 0"),
    (b"text\n" * 5 + b"\0\0\0\0", r"is binary, not text: a NUL byte at offset 25"),
])
def test_a_binary_or_non_utf8_corpus_names_the_file_and_offset(tmp_path, content, message):
    corpus = tmp_path / "corpus.dat"
    corpus.write_bytes(content)
    with pytest.raises(ValueError, match=rf"data.path: {corpus} {message}"):
        prepare(data_config("data=text_files", f"data.path={corpus}", f"data.cache_dir={tmp_path / 'c'}"))
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("limit", [40_000, 140_000], ids=["in datasets' cache", "in train.npy"])
def test_a_full_disk_names_the_cache_and_leaves_the_prepared_folders_as_they_were(tmp_path, limit):
    """Writes fail past `limit` bytes, part-way through datasets' copy of the 100 kB corpus (in
    data.cache_dir/hf) or through its 180 kB train.npy: one line naming data.cache_dir, the folder
    prepared before as it was, and neither a new prepared folder nor a temp one."""
    cache = tmp_path / "cache"
    (tmp_path / "a.txt").write_text("an earlier corpus\n" * 50)
    options = ("data=text_files", f"data.cache_dir={cache}")
    earlier = prepare(data_config(*options, f"data.path={tmp_path}/a.txt"))
    files = {p: p.read_bytes() for p in earlier.iterdir()}
    (tmp_path / "b.txt").write_text("the quick brown fox\n" * 5000)
    with disk_full_after(limit):
        result = run_prepare(*options, f"data.path={tmp_path}/b.txt")
    assert_one_line_error(result, f"error: data.cache_dir: cannot write to {cache} (")
    assert {p: p.read_bytes() for p in earlier.iterdir()} == files
    assert sorted(p.name for p in cache.iterdir() if p.suffix != ".lock") == sorted([earlier.name, "hf"])


def test_missing_corpus_file_names_data_path(tmp_path):
    assert_one_line_error(run_prepare(f"data.path={tmp_path}/nope.txt"), "data.path: no such file")


def test_batches(char_data):
    _, train, _ = load_prepared(char_data)
    a = Batches(train, block_size=16, batch_size=4, seed=7)
    b = Batches(train, block_size=16, batch_size=4, seed=7, on_device=False)
    x, y = a.next()
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    bx, by = b.next()
    assert torch.equal(x, bx) and torch.equal(y, by)  # same seed, same batches, either storage
    state = a.state_dict()
    expected = a.next()
    a.next()
    a.load_state_dict(state)
    assert all(torch.equal(u, v) for u, v in zip(a.next(), expected))  # restored RNG state
    assert not torch.equal(Batches(train, 16, 4, seed=8).next()[0], x)
    with pytest.raises(ValueError, match="^block_size=64 needs more tokens than 10"):
        Batches(train[:10], block_size=64, batch_size=1)
    # On the device the split is one int32 copy, which other Batches share; windows come out int64.
    assert a.tokens.dtype == torch.int32 and len(a.tokens) == len(train)
    shared = Batches(a.tokens, block_size=16, batch_size=4, seed=7)
    assert shared.tokens is a.tokens and torch.equal(shared.next()[0], x)
    # The starts a seed draws are the ones torch.randint has always drawn from it: runs stay as they were.
    starts = torch.randint(len(train) - 16, (4,), generator=torch.Generator().manual_seed(7))
    assert x[:, 0].tolist() == [int(train[s]) for s in starts]


def test_a_path_means_what_the_shell_means(tmp_path):
    """`**` any folders deep (bash's globstar), the matches sorted, no hidden files and no folders;
    a file whose name looks like a pattern is that file; a folder is refused with the pattern that
    reads it. datasets, which takes paths as patterns, reads each file as named (it dropped such a
    name): the prepared text is every character of every file."""
    texts = {"top.txt": "top\n", "x[1].txt": "bracket\n", "a/mid.txt": "mid\n", "a/b/deep.txt": "deep\n",
             ".hidden.txt": "hidden\n", "a/.h/in_hidden.txt": "h\n", "notes.md": "md\n"}
    for name, text in texts.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text * 30)
    (tmp_path / "folder.txt").mkdir()  # a folder whose name matches *.txt
    files = lambda path: [str(p.relative_to(tmp_path)) for p in corpus_files(DataConfig("t", path=path))]
    assert files(f"{tmp_path}/**/*.txt") == ["a/b/deep.txt", "a/mid.txt", "top.txt", "x[1].txt"]
    assert files(f"{tmp_path}/*.txt") == ["top.txt", "x[1].txt"]
    assert files(f"{tmp_path}/x[1].txt") == ["x[1].txt"]
    with pytest.raises(FileNotFoundError, match=r"data.path: no such file: .*x\[0-9\]\.txt"):
        files(f"{tmp_path}/x[0-9].txt")
    with pytest.raises(IsADirectoryError, match=rf"data.path={tmp_path}/a is a folder: give its files, "
                                                rf"e.g. data.path='{tmp_path}/a/\*\*/\*.txt'"):
        files(f"{tmp_path}/a")
    prepared = prepare(data_config("data=text_files", f"data.path={tmp_path}/**/*.txt",
                                   f"data.cache_dir={tmp_path / 'c'}"))
    meta = load_prepared(prepared)[0]
    assert meta["train_tokens"] + meta["val_tokens"] == 30 * len("top\nbracket\nmid\ndeep\n")


@pytest.mark.parametrize("name", ["a/b", "..", ".x", "", "a b", "../up"])
def test_data_name_is_a_plain_folder_name(name):
    with pytest.raises(ValueError, match="data.name=.* must be a plain name"):
        DataConfig(name, path="corpus.txt")


def test_a_prepared_folder_is_checked_against_its_meta_and_healed_without_one(tmp_path):
    """Hand-edited, meta.json names what is wrong with it; deleted, the folder is prepared again."""
    (tmp_path / "a.txt").write_text("some text\n" * 20)
    prepared = prepare(data_config("data=text_files", f"data.path={tmp_path}/a.txt",
                                   f"data.cache_dir={tmp_path / 'c'}"))
    good = json.loads((prepared / "meta.json").read_text())
    for edit, message in [([1, 2], "meta.json holds a list, not an object"),
                          (good | {"vocab_size": 3}, "meta.json's vocab_size 3 is not its tokenizer's 8"),
                          (good | {"vocab_size": 8.0}, "meta.json's vocab_size 8.0 is not its tokenizer's 8"),
                          (good | {"vocab": good["vocab"][:3], "vocab_size": 3},
                           "train.npy holds token id 7, past the vocabulary (3)"),
                          (good | {"tokenizer": None}, "names no tokenizer"),
                          (good | {"vocab": "abc"}, "char vocabulary is not a list of distinct characters"),
                          (good | {"train_tokens": 5}, "train.npy is not the 5 token ids meta.json says")]:
        (prepared / "meta.json").write_text(json.dumps(edit))
        with pytest.raises(ValueError, match=rf"^{prepared} is damaged \(.*{re.escape(message)}.*delete it"):
            load_prepared(prepared)
    (prepared / "meta.json").unlink()
    again = prepare(data_config("data=text_files", f"data.path={tmp_path}/a.txt",
                                f"data.cache_dir={tmp_path / 'c'}"))
    assert again == prepared and load_prepared(again)[0] == good


def test_a_prepared_folder_changed_since_is_refused_when_loaded_and_made_again_by_the_next_run(tmp_path,
                                                                                               capsys):
    """An edit that keeps meta.json consistent (two characters of the vocabulary swapped: every
    token would decode as the other) or train.npy's bytes changed in place, its size kept: loading
    the folder is one line naming the file and how to redo it; prepare, which every run and
    `python -m cli.prepare` call first, says so and prepares it again (a cache keyed by its inputs:
    nothing of the user's is lost), the files as they were."""
    (tmp_path / "a.txt").write_text("some text\n" * 20)
    cfg = data_config("data=text_files", f"data.path={tmp_path}/a.txt", f"data.cache_dir={tmp_path / 'c'}")
    prepared = prepare(cfg)
    good = {p.name: p.read_bytes() for p in prepared.iterdir()}
    meta, train = json.loads(good["meta.json"]), np.load(prepared / "train.npy")
    swapped = meta | {"vocab": [meta["vocab"][1], meta["vocab"][0], *meta["vocab"][2:]]}
    shifted = (train + 1) % meta["vocab_size"]  # (uint16: the same bytes long)
    refused = (rf"^{prepared} is damaged \(meta.json was changed since it was prepared: .*delete it and it "
               rf"is prepared again \(by the next run, or python -m cli.prepare\)$")
    for name, write in [("meta.json", lambda: (prepared / "meta.json").write_text(json.dumps(swapped))),
                        ("train.npy", lambda: np.save(prepared / "train.npy", shifted))]:
        write()
        if name == "meta.json":
            with pytest.raises(ValueError, match=refused):
                load_prepared(prepared)
        assert prepare(cfg) == prepared
        assert capsys.readouterr().err.startswith(f"data: {prepared} is damaged ({name}")
        assert {p.name: p.read_bytes() for p in prepared.iterdir()} == good


def test_the_temp_folder_of_a_killed_preparation_goes_when_the_folder_is_prepared_again(tmp_path):
    """A preparation killed mid-write (SIGKILL: no cleanup runs) leaves its `.<folder>-XXXX` temp
    folder of partial arrays in the cache; the next one to prepare that folder holds its lock
    (`.<folder>.lock`, flock: no live process is writing one) and removes it."""
    (tmp_path / "a.txt").write_text("some text\n" * 20)
    cfg = data_config("data=text_files", f"data.path={tmp_path}/a.txt", f"data.cache_dir={tmp_path / 'c'}")
    prepared = prepare(cfg)
    shutil.rmtree(prepared)
    stale = tmp_path / "c" / f".{prepared.name}-k1ll3d"
    stale.mkdir()
    (stale / "train.npy").write_bytes(bytes(1 << 20))
    assert prepare(cfg) == prepared and load_prepared(prepared)
    assert sorted(p.name for p in (tmp_path / "c").iterdir() if p.name.startswith(".")) == \
        [f".{prepared.name}.lock"]


@functools.cache
def gpt2_tokenizer_json() -> str:
    """GPT-2's BPE as a tokenizer.json holds it (the Hub's openai-community/gpt2), from our shipped
    ranks: each token's merge recovered by running the BPE over its bytes with the ranks below its own,
    which ends in two such tokens (where only one cut of the token makes two, the BPE can end nowhere
    else: that cut, without running it)."""
    from data.tokenizer import BYTE_LEVEL, gpt2_encoding

    encoding, text = gpt2_encoding(), {b: c for c, b in BYTE_LEVEL.items()}
    tokens = [encoding.decode_single_token_bytes(i) for i in range(50256)]
    ranks = {token: i for i, token in enumerate(tokens)}
    merges = []
    for rank, token in enumerate(tokens[256:], start=256):
        cuts = [i for i in range(1, len(token))
                if max(ranks.get(token[:i], rank), ranks.get(token[i:], rank)) < rank]
        parts = [token[:cuts[0]], token[cuts[0]:]] if len(cuts) == 1 else [bytes([b]) for b in token]
        while len(parts) > 2:
            _, at = min((ranks.get(a + b, math.inf), i) for i, (a, b) in enumerate(zip(parts, parts[1:])))
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        merges.append(" ".join("".join(text[b] for b in part) for part in parts))
    vocab = {"".join(text[b] for b in token): i for i, token in enumerate(tokens)} | {"<|endoftext|>": 50256}
    byte_level = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [
        {"id": 50256, "content": "<|endoftext|>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": True, "special": True}], "normalizer": None,
        "pre_tokenizer": byte_level | {"add_prefix_space": False},
        "post_processor": byte_level | {"trim_offsets": False}, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                  "merges": merges}})


@pytest.mark.parametrize("spoil", [
    None, lambda t: t["model"]["merges"].reverse(),
    lambda t: t["pre_tokenizer"].update(add_prefix_space=True),
    lambda t: t.update(normalizer={"type": "Lowercase"}), lambda t: t["model"].update(dropout=0.1),
    lambda t: t["model"]["vocab"].update({"Ġthe": 50255, "<|endoftext|>": 262}),
    lambda t: t.update(post_processor={"type": "TemplateProcessing", "single": [], "pair": [],
                                       "special_tokens": {}}),
], ids=["gpt2", "merges", "prefix_space", "normalizer", "dropout", "ids", "post_processor"])
def test_gpt2s_own_bpe_is_told_from_any_other_tokenizer(tmp_path, spoil, gpt2_bpe):
    """is_gpt2_bpe: the Hub's GPT-2 tokenizer.json encodes every text as our shipped ranks do (one
    tokenizer: a GPT-2 folder holding it finetunes on data of GPT-2's BPE); one setting or token
    changed, it is another tokenizer."""
    from data.tokenizer import HFTokenizer, is_gpt2_bpe

    tokenizer = json.loads(gpt2_tokenizer_json())
    if spoil is not None:
        spoil(tokenizer)
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert is_gpt2_bpe(tmp_path / "tokenizer.json") == (spoil is None)
    if spoil is None:
        text = (ROOT / "data" / "assets" / "tinyshakespeare.txt").read_text()[:3000] + " 12345 ’s  \n\t"
        assert HFTokenizer(tmp_path / "tokenizer.json").encode(text) == gpt2_bpe.encode(text)
        (tmp_path / "tokenizer.json").write_text("{not json")
        assert not is_gpt2_bpe(tmp_path / "tokenizer.json")


def test_a_gpt2_folders_vocab_and_merges_are_its_tokenizer_where_it_has_no_tokenizer_json(tmp_path, gpt2_bpe):
    """A GPT-2 saved with transformers' slow tokenizer holds vocab.json and merges.txt, no
    tokenizer.json: they are its tokenizer (a byte-level BPE), encoding as transformers' GPT2Tokenizer
    reads the same files, and GPT-2's own pair is GPT-2's BPE (is_gpt2_bpe); a folder with neither
    is one line saying what it lacks."""
    from transformers import GPT2Tokenizer

    from data.tokenizer import HFTokenizer, is_gpt2_bpe

    text = (ROOT / "data" / "assets" / "tinyshakespeare.txt").read_text()[-2000:] + " 12345 ’s  \n\t"
    for name, source in (("small", json.loads(shakespeare_tokenizer())),
                         ("gpt2", json.loads(gpt2_tokenizer_json()))):
        folder = tmp_path / name
        folder.mkdir()
        merges = [m if isinstance(m, str) else " ".join(m) for m in source["model"]["merges"]]
        (folder / "vocab.json").write_text(json.dumps(source["model"]["vocab"]))
        (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
        ours = HFTokenizer(folder / "tokenizer.json")
        theirs = GPT2Tokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
        assert ours.encode(text) == theirs.encode(text) and ours.decode(ours.encode(text)) == text
        assert is_gpt2_bpe(folder / "tokenizer.json") == (name == "gpt2")
    assert HFTokenizer(tmp_path / "gpt2" / "tokenizer.json").encode(text) == gpt2_bpe.encode(text)
    with pytest.raises(FileNotFoundError, match=r"no tokenizer.json in .* \(nor vocab.json and merges.txt\)"):
        HFTokenizer(tmp_path / "tokenizer.json")
