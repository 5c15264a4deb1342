"""generate.py, the command line: streaming, batching, stop strings, the benchmark and heatmaps,
and one-line errors."""

import dataclasses
import io
import os
import re
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cli.configs import quote_literal_options
from data.tokenizer import BPETokenizer, CharTokenizer, HFTokenizer
from generate import LITERAL_OPTIONS, GenerateConfig, cache_positions, print_samples, sample
from model import checkpoint
from model.generation import stream
from model.sampling import Sampling
from tests.helpers import (
    HF_FAMILIES,
    MULTI_BYTE,
    ROOT,
    assert_one_line_error,
    compose,
    disk_full_after,
    finish,
    run_in_process,
    start_cli,
    temp_files,
    tiny_config,
    tiny_model,
)


def generate_cli(*args, cwd=ROOT):
    """`python generate.py <args>`, run in this process."""
    return run_in_process("generate.py", *args, cwd=cwd)


def test_cli_streams_one_sample(tiny_ckpt):
    result = generate_cli(f"ckpt={tiny_ckpt}", "prompt=ROMEO:", "max_new_tokens=40")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ROMEO:") and len(result.stdout) >= 46


@pytest.fixture(scope="module")
def gpt2_bpe() -> BPETokenizer:
    """GPT-2's BPE, read once for the module (its ranks take a fifth of a second to read and check)."""
    return BPETokenizer()


@pytest.mark.parametrize("kind", ["char", "bpe"])
@pytest.mark.parametrize("rows", [1, 2])
def test_samples_print_their_whole_text_streamed_or_not(kind, rows, gpt2_bpe):
    """The tokens of text with multi-byte characters, one per step as `stream` yields them: a single
    sample streams exactly its final text (no U+FFFD for a character cut across tokens), several
    print theirs at the end; a stop string ends each at its end."""
    tok = CharTokenizer.from_text(MULTI_BYTE) if kind == "char" else gpt2_bpe
    steps = [torch.tensor([token] * rows) for token in tok.encode(MULTI_BYTE)]
    for stop, text in [(None, MULTI_BYTE), ("”", MULTI_BYTE[:MULTI_BYTE.index("”") + 1])]:
        out = io.StringIO()
        assert print_samples(["P"] * rows, iter(steps), tok, stop, out) == [text] * rows
        printed = f"P{text}\n" if rows == 1 else "".join(f"{'=' * 20} sample {i}/2 {'=' * 20}\nP{text}\n"
                                                         for i in (1, 2))
        assert out.getvalue() == printed


@pytest.fixture(scope="module")
def seeded_cli(tiny_ckpt):
    """`generate.py` with prompt ROMEO:, 20 new tokens from seed 3 (within block_size), through its KV
    cache: one run, which the uncached run and the Python API are each compared with."""
    return generate_cli(f"ckpt={tiny_ckpt}", "prompt=ROMEO:", "max_new_tokens=20", "seed=3", "kv_cache=true")


def test_cli_cache_and_no_cache_agree(tiny_ckpt, seeded_cli):
    uncached = generate_cli(f"ckpt={tiny_ckpt}", "prompt=ROMEO:", "max_new_tokens=20", "seed=3",
                            "kv_cache=false")
    assert seeded_cli.stdout == uncached.stdout and seeded_cli.stdout


def test_sample_from_python_equals_the_cli(tiny_ckpt, seeded_cli, capsys):
    texts = sample(GenerateConfig(ckpt=str(tiny_ckpt), prompt="ROMEO:", max_new_tokens=20, seed=3,
                                  kv_cache=True))
    assert texts == [seeded_cli.stdout.rstrip("\n")] and capsys.readouterr().out == seeded_cli.stdout


def test_cli_prompt_file_and_samples(tiny_ckpt, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ROMEO:\nJULIET: O\n")
    result = generate_cli(f"ckpt={tiny_ckpt}", f"prompt_file={prompts}", "num_samples=2",
                          "max_new_tokens=15", "temperature=0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("==== sample ") == 4
    assert "sample 4/4 ====================\nJULIET: O" in result.stdout


def test_each_sample_is_what_its_seed_gives_for_its_prompt_alone(tiny_ckpt, tmp_path):
    """Sample j of each prompt draws from seed + j; the rows refill the cache (block_size 32) at
    different steps."""
    lines = ["ROMEO", "First Citizen: Before we proceed"]
    (tmp_path / "p.txt").write_text("\n".join(lines))
    run = lambda **kw: sample(GenerateConfig(ckpt=str(tiny_ckpt), max_new_tokens=40, **kw), out=io.StringIO())
    batched = run(prompt_file=str(tmp_path / "p.txt"), num_samples=2, seed=3)
    assert batched == [run(prompt=line, seed=3 + j)[0] for line in lines for j in (0, 1)]
    assert batched[0] != batched[1]
    # The prompts in chunks of 3 tokens: the same samples.
    assert run(prompt_file=str(tmp_path / "p.txt"), num_samples=2, seed=3, prefill_chunk=3) == batched


@pytest.mark.parametrize("sinks", [0, 2])
def test_samples_of_a_prompt_past_block_size_on_a_ring_model_are_each_the_prompt_alone(tiny_ckpt, tmp_path,
                                                                                       sinks):
    """A window model with RoPE generates without end (its cache a ring): three samples of a prompt
    longer than block_size (16) share it, and each is what its seed gives for the prompt alone."""
    model = tiny_model(vocab_size=65, block_size=16, n_layer=3, pos_emb="rope", attn_window=16,
                       attn_sinks=sinks)  # 46 tokens of receptive field without sinks
    checkpoint.save(tmp_path / "ring.pt", checkpoint.Checkpoint(
        model=model.state_dict(), model_config=model.config, data_meta=checkpoint.load(tiny_ckpt).data_meta))
    prompt = "First Citizen: Before we proceed"  # 32 characters
    run = lambda **kw: sample(GenerateConfig(ckpt=str(tmp_path / "ring.pt"), prompt=prompt, max_new_tokens=8,
                                             **kw), out=io.StringIO())
    assert run(num_samples=3, seed=3) == [run(seed=3 + j)[0] for j in range(3)]


def test_a_prompt_the_tokenizer_cannot_take_is_one_line_naming_prompt(tiny_ckpt, tmp_path):
    """A char model whose vocabulary has no newline, given no prompt (the default is a newline) or
    one with a character it lacks; a prompt_file likewise; a prompt byte that is not UTF-8 (a shell
    argument in another encoding: a surrogate escape, which tiktoken silently replaced and
    `tokenizers` raised a TypeError on), for a char model and GPT-2's BPE alike."""
    letters = tiny_model()  # 37 token ids: a char vocabulary of 37 letters, no newline
    vocab = [chr(c) for c in range(ord("A"), ord("A") + 37)]
    char_meta = {"tokenizer": "char", "vocab": vocab, "vocab_size": 37}
    for name, model, meta in [("letters.pt", letters, char_meta),
                              ("bpe.pt", tiny_model(vocab_size=50257), checkpoint.GPT2_DATA_META)]:
        checkpoint.save(tmp_path / name, checkpoint.Checkpoint(model=model.state_dict(),
                                                               model_config=model.config, data_meta=meta))
    (tmp_path / "prompts.txt").write_text("ABC\nAé\n")
    letters = f"ckpt={tmp_path / 'letters.pt'}"
    for args, message in [
        ([letters], "prompt: characters not in this model's vocabulary: '\\n' (a newline is the prompt when "
                    "none is given): give prompt=... in the characters it has"),
        ([letters, "prompt=Aé"], "prompt: characters not in this model's vocabulary: 'é': give prompt=..."),
        ([letters, f"prompt_file={tmp_path / 'prompts.txt'}"], "prompt_file: characters not in this model's "
                                                              "vocabulary: 'é': edit the prompts"),
        *[([ckpt, "prompt=AB\udcffC"], "prompt is not UTF-8: byte 0xff at offset 2")
          for ckpt in (letters, f"ckpt={tmp_path / 'bpe.pt'}", f"ckpt={tiny_ckpt}")]]:
        assert_one_line_error(generate_cli(*args, "max_new_tokens=2"), message)


def test_a_sample_a_model_cannot_make_is_refused_before_anything_is_printed_or_written(tiny_ckpt, tmp_path):
    """A window model with learned positions ends at block_size (32): asked past it (the default
    prompt and 100 tokens, a prompt longer than the block, several samples, with a benchmark or an
    attention plot), it printed the streamed prompt, or wrote the plot, then failed. `stream` checks
    its arguments when called, not at the first token, and the plot waits for that check."""
    model = tiny_model(vocab_size=65, block_size=32, attn_window=8)
    checkpoint.save(tmp_path / "w.pt", checkpoint.Checkpoint(
        model=model.state_dict(), model_config=model.config, data_meta=checkpoint.load(tiny_ckpt).data_meta))
    png, ckpt = tmp_path / "attn.png", f"ckpt={tmp_path / 'w.pt'}"
    refused = "exceed block_size=32: a sliding-window model (attn_window) with learned positions generates"
    for args in (["max_new_tokens=100"], ["prompt=" + "ROMEO: " * 6, "max_new_tokens=1"],
                 ["max_new_tokens=40", "num_samples=2", f"attn_plot={png}"],
                 ["max_new_tokens=40", "benchmark=true", f"attn_plot={png}"]):
        result = generate_cli(ckpt, *args)
        assert_one_line_error(result, refused)
        assert result.stdout == "" and not png.exists(), args
    with pytest.raises(ValueError, match="exceed block_size"):
        stream(model, torch.zeros(1, 30, dtype=torch.long), Sampling(3))  # no token asked for
    result = generate_cli(ckpt, "max_new_tokens=31", "num_samples=2", f"attn_plot={png}")
    assert result.returncode == 0 and png.is_file(), result.stderr  # 1 + 31 tokens: the whole block


def test_cli_stop_string(tiny_ckpt):
    result = generate_cli(f"ckpt={tiny_ckpt}", "prompt=a", "max_new_tokens=200", "stop=e",
                          "temperature=1.0", "top_k=null")
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n").endswith("e") and result.stdout.count("e") == 1


def test_cli_benchmark_and_attention_plot(tiny_ckpt, tmp_path):
    png = tmp_path / "attn.png"
    result = generate_cli(f"ckpt={tiny_ckpt}", "benchmark=true", "max_new_tokens=20", "kv_dtype=int8",
                          "prompt=ROMEO: hi", f"attn_plot={png}", "attn_layer=1", "num_samples=3")
    assert result.returncode == 0, result.stderr
    assert "| on |" in result.stdout and "| off |" in result.stdout
    # What was timed is what the table says: the batch of 3 rows, every row's tokens counted.
    assert "| batch 3 x prompt 9 tokens, 20 new tokens per row" in result.stdout
    assert "tokens/s count every row: 3 x 9 prompt tokens, 3 x 19 decoded" in result.stdout
    # tiny: 2 layers x 2 (K, V) x 4 kv heads x 4, in one byte each, and a float32 scale per head
    assert "KV cache in torch.int8: 128 bytes per token (2 layers x 2 (K, V) x 4 kv heads x 4 x 1 bytes " \
           "+ one scale per position and K/V head)" in result.stdout
    assert png.stat().st_size > 1000


def test_a_plot_the_disk_refuses_names_attn_plot_and_keeps_the_earlier_file(tiny_ckpt, tmp_path):
    """Writes fail past 2 kB, part-way through the heatmaps' PNG: one line naming the option and the
    file, the earlier file as it was, no temp file."""
    png, earlier = tmp_path / "attn.png", b"the earlier plot"
    png.write_bytes(earlier)
    with disk_full_after(2048):
        result = generate_cli(f"ckpt={tiny_ckpt}", "prompt=ROMEO: hi", "max_new_tokens=2", f"attn_plot={png}")
    assert_one_line_error(result, f"error: attn_plot: cannot write plot {png}: File too large; the previous "
                                  f"one is intact")
    assert png.read_bytes() == earlier and temp_files(tmp_path) == []


@pytest.mark.parametrize("args,message", [
    (["prompt='Zé'"], "not in this model's vocabulary: 'é'"),
    (["prompt="], "the prompt is empty"),
    (["attn_plot=/nonexistent/a.png"], "attn_plot=/nonexistent/a.png: the folder /nonexistent does not"),
    (["top_k=0"], "top_k must be an integer >= 1"),
    (["prefill_chunk=0"], "prefill_chunk must be an integer >= 1, got 0"),
    (["attn_plot=x.png", "attn_layer=7"], "attn_layer must be in 0..1"),
    (["prompt_file=missing.txt"], "prompt_file not found"),
    (["kv_dtype=int4"], "kv_dtype must be one of float32, bfloat16, int8 (a torch dtype or its name), got"),
    (["seed=100000000000000000000000"], "seed=100000000000000000000000 is out of range"),
    (["max_new_tokens=100000000000000000000"], "max_new_tokens=100000000000000000000 is out of range"),
    ([f"max_new_tokens={2**63 - 1}", "num_samples=2"], "max_new_tokens must be at most 1,000,000 (a sample "
                                                       "that long takes hours, and several print only when"),
    ([f"num_samples={2**63 - 1}"], f"num_samples={2**63 - 1}: 9,223,372,036,854,775,807 rows take at least"),
    (["inspect=/nonexistent/a.html"], "inspect=/nonexistent/a.html: the folder /nonexistent does not exist"),
    (["inspect=tests"], "inspect=tests is a folder: give a file name"),
    (["inspect=a.png"], "inspect=a.png: give an .html file name, e.g. inspect=decode.html"),
    (["inspect=a.html", "num_samples=2"], "inspect=a.html shows one sample: leave num_samples=1"),
    (["inspect=a.html", "max_new_tokens=0"], "inspect=a.html shows new tokens: give max_new_tokens >= 1"),
    (["inspect=a.html", "compile=true"], "inspect=a.html records the eager decode step: leave compile=false"),
    (["inspect=a.html", "benchmark=true"], "inspect=a.html records a decode, not a benchmark"),
    (["compile=fast"], "compile must be one of auto, true, false, got 'fast'"),
    (["inspect=a.html", "prompt_file=README.md"], "inspect=a.html shows one sample: give one prompt, not a "
                                                  "prompt_file of"),
    (["inspect=a.html", "max_new_tokens=100000"], "inspect=a.html: max_new_tokens=100000 would record "
                                                  "25,596,032 attention weights (~195 MB of page)"),
])
def test_cli_bad_input_is_one_line_error(tiny_ckpt, args, message):
    assert_one_line_error(generate_cli(f"ckpt={tiny_ckpt}", *args), message)


SIGTERM_TEST = "test_a_sigterm_ends_a_long_sample_at_once_and_what_it_printed_stays"


def sigterm_once_it_printed(proc) -> tuple:
    """SIGTERM to a sample's process once it has printed 200 characters: (those characters, its
    result, the seconds from the signal to its end)."""
    printed = proc.stdout.read(200)  # the prompt and the first new tokens: there before the signal
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    result = finish(proc, timeout=60)
    return printed, result, time.monotonic() - signalled


@pytest.fixture(scope="module", autouse=True)
def sigterm_run(request):
    """The future of sigterm_once_it_printed for a sample as long as max_new_tokens allows, started
    with this module's first test and signalled by a thread (the seconds its process spends starting
    are spent beside the module's other tests, in this process); None where its test is not selected."""
    if not any(item.name == SIGTERM_TEST for item in request.session.items):
        yield None
        return
    ckpt = request.getfixturevalue("tiny_ckpt")
    proc = start_cli("generate.py", f"ckpt={ckpt}", "prompt=ROMEO:", "max_new_tokens=1000000")
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(sigterm_once_it_printed, proc)


def test_a_sigterm_ends_a_long_sample_at_once_and_what_it_printed_stays(sigterm_run):
    """A sample as long as max_new_tokens allows (minutes here), streamed as it grows: SIGTERM ends the
    process within seconds, and the text printed before it was written out as it came (flushed)."""
    printed, result, seconds = sigterm_run.result()
    assert result.returncode == -signal.SIGTERM and seconds < 10, result.stderr[-2000:]
    assert printed.startswith("ROMEO:") and len(printed) == 200


def test_without_ckpt_it_samples_from_the_latest_run_in_outputs(tiny_ckpt, tmp_path):
    assert_one_line_error(generate_cli(cwd=tmp_path), "ckpt is not set and outputs/ holds no run")
    for i, name in enumerate(["2026-01-02/09-00-00", "2026-01-01/10-00-00"]):  # the first written last
        shutil.copytree(tiny_ckpt, tmp_path / "outputs" / name)
        for ckpt in (tmp_path / "outputs" / name).glob("*.pt"):
            os.utime(ckpt, (2e9 - i, 2e9 - i))
    result = generate_cli("prompt=ROMEO:", "max_new_tokens=5", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("ROMEO:"), result.stderr
    assert result.stderr.strip() == ("ckpt: outputs/2026-01-02/09-00-00 (the latest run in outputs/; "
                                     "choose another with ckpt=...)")


GRAMMAR = "it's \"quoted\" [1,2] {a: b} ${oops} x=y,z \\' \\"  # all of it Hydra syntax, unquoted


@pytest.mark.parametrize("typed, meant", [
    ("To be, or not", "To be, or not"),
    (GRAMMAR, GRAMMAR),
    ("real\nnewlines\n\n", "real\nnewlines\n\n"),
    (r"typed\n\t escapes, \\n", "typed\n\t escapes, \\n"),
    ("null", "null"),
])
def test_prompt_and_stop_are_taken_as_typed(typed, meant):
    """What the shell hands over is the text, not Hydra's grammar; a typed \n or \t is a newline
    or a tab, \\ a backslash."""
    overrides = quote_literal_options([f"prompt={typed}", f"stop={typed}"], LITERAL_OPTIONS)
    cfg = compose(*overrides, config_name="generate")
    assert (cfg.prompt, cfg.stop) == (meant, meant)


def test_a_prompt_with_commas_quotes_and_newlines_on_the_command_line(tiny_ckpt):
    result = generate_cli(f"ckpt={tiny_ckpt}", "prompt=To be, or not to be:\nthat's it", "stop=\n\n",
                          "max_new_tokens=5", "temperature=0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("To be, or not to be:\nthat's it")


def test_cli_bad_checkpoints(tiny_ckpt, tmp_path):
    (tmp_path / "corrupt.pt").write_bytes(b"garbage")
    ckpt = torch.load(tiny_ckpt / "best.pt", weights_only=True)
    ckpt["model_config"]["n_embd"] = 32  # weights no longer match
    torch.save(ckpt, tmp_path / "mismatched.pt")
    for path, message in [(tmp_path / "missing.pt", "not found"),
                          (tmp_path / "corrupt.pt", "cannot read checkpoint"),
                          (tmp_path / "mismatched.pt", "weights do not match")]:
        assert_one_line_error(generate_cli(f"ckpt={path}"), message)


def test_a_checkpoint_with_fewer_ids_than_its_tokenizer_is_refused(tiny_ckpt, tmp_path):
    small = tiny_model()  # 37 token ids, for a tokenizer of 65 characters
    checkpoint.save(tmp_path / "small_vocab.pt", checkpoint.Checkpoint(
        model=small.state_dict(), model_config=small.config, data_meta=checkpoint.load(tiny_ckpt).data_meta))
    with pytest.raises(ValueError, match="37 token ids, fewer than its char tokenizer's 65"):
        sample(GenerateConfig(ckpt=str(tmp_path / "small_vocab.pt")))


def test_cli_fast_decode_options(tiny_ckpt):
    result = generate_cli(f"ckpt={tiny_ckpt}", "prompt=ROMEO:", "max_new_tokens=12", "temperature=0",
                          "quantize=int8", "dtype=bfloat16")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ROMEO:")
    assert_one_line_error(generate_cli(f"ckpt={tiny_ckpt}", "dtype=float16"), "dtype must be one of")


def test_a_temperature_too_small_to_divide_by_is_greedy(tiny_ckpt):
    """logits / 1e-40 overflowed to inf and sampling failed on NaN; now it is the greedy sample."""
    tiny, greedy = (generate_cli(f"ckpt={tiny_ckpt}", "prompt=ROMEO:", "max_new_tokens=30",
                                 f"temperature={t}") for t in ("1e-40", "0"))
    assert tiny.returncode == 0, tiny.stderr
    assert tiny.stdout == greedy.stdout


# Hugging Face model folders of the Llama family (model/pretrained.py), sampled with their own tokenizer
# and with every variable that would point a download somewhere set to a port nothing listens on.
NO_NETWORK = {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"} | {
    name: "http://127.0.0.1:9" for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy",
                                            "https_proxy", "all_proxy")}


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_a_hugging_face_folder_samples_its_tokenizers_text_offline(hf_folders, family):
    """The text is transformers' greedy tokens for the prompt as the folder's tokenizer encodes it
    (Llama's with its BOS), decoded by it; a model with more ids than its tokenizer (Qwen2's) draws
    only the tokenizer's."""
    path, hf = hf_folders[family]
    tokenizer = HFTokenizer(path / "tokenizer.json")
    prompt = tokenizer.encode("ROMEO: thou art")
    assert (prompt[0] == tokenizer.tokenizer.token_to_id("<|endoftext|>")) == (family == "llama")
    beyond = list(range(tokenizer.vocab_size, hf.config.vocab_size)) or None  # ids no text has
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                           suppress_tokens=beyond)
    result = run_in_process("generate.py", f"ckpt={path}", "prompt=ROMEO: thou art", "max_new_tokens=20",
                            "temperature=0", env=NO_NETWORK)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ROMEO: thou art" + tokenizer.decode(expected[0, len(prompt):].tolist()) + "\n"


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_a_hugging_face_folder_benchmark_prints_its_cache_and_its_what_ifs(hf_folders, family, tmp_path):
    """benchmark=true: the KV bytes per token by the formula equal those allocated, for the model and
    for its GQA as MHA and as MQA, an int8 cache and a window (or none); inspect= writes its page."""
    path, _ = hf_folders[family]
    result = run_in_process("generate.py", f"ckpt={path}", "benchmark=true", "max_new_tokens=4",
                            "prompt=ROMEO:", env=NO_NETWORK)
    assert result.returncode == 0, result.stderr
    table = result.stdout.split("KV cache per token of a 96-position sequence")[1].splitlines()[3:]
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in table}
    window = "no window" if family in ("qwen3", "mistral") else "a window of 24"
    assert set(rows) == {"this model", "as MHA (4 K/V heads)", "as MQA (1 K/V head)", "an int8 cache", window}
    assert all(formula == allocated for _, formula, allocated, *_ in rows.values())
    per_token = {name: float(row[1].replace(",", "")) for name, row in rows.items()}
    if family in ("llama", "qwen2"):  # 3 layers x 2 (K, V) x 16 wide x 4 bytes, per K/V head
        assert [per_token[n] for n in ("this model", "as MHA (4 K/V heads)", "as MQA (1 K/V head)")] == \
            [3 * 2 * 2 * 16 * 4, 3 * 2 * 4 * 16 * 4, 3 * 2 * 1 * 16 * 4]
        assert per_token["an int8 cache"] == per_token["this model"] / 4 + 3 * 2 * 2 * 4  # + a scale a head
    else:  # windowed layers keep 6 positions of the 96: an average
        assert per_token["no window"] > per_token["this model"] > per_token["an int8 cache"]
    page = tmp_path / "page.html"
    result = run_in_process("generate.py", f"ckpt={path}", f"inspect={page}", "max_new_tokens=4",
                            "prompt=ROMEO:", env=NO_NETWORK)
    assert result.returncode == 0, result.stderr
    assert "inspect page saved" in result.stdout and page.stat().st_size > 10_000


def test_a_hugging_face_folder_samples_in_bf16_with_an_int8_cache_offline(hf_folders):
    path, _ = hf_folders["qwen3"]
    result = run_in_process("generate.py", f"ckpt={path}", "prompt=ROMEO:", "max_new_tokens=8",
                            "kv_dtype=int8", "dtype=bfloat16", env=NO_NETWORK)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ROMEO:") and len(result.stdout) > len("ROMEO:\n")


def test_a_hugging_face_folder_without_a_tokenizer_is_one_line(hf_folders, tmp_path):
    path, _ = hf_folders["mistral"]
    shutil.copytree(path, tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").unlink()
    assert_one_line_error(generate_cli(f"ckpt={tmp_path / 'm'}"), "no tokenizer.json in")
    (tmp_path / "m" / "config.json").write_text('{"model_type": "mixtral"}')
    assert_one_line_error(generate_cli(f"ckpt={tmp_path / 'm'}"), "model_type='mixtral' is not supported")


def test_a_samples_cache_holds_its_positions_rounded_up_to_a_power_of_two():
    """Not a real model's whole context (Qwen3's 40,960 positions: 4.4 GiB in bf16, read every token
    by the CUDA step), and only a few sizes of compiled step (each kept on disk) for every length."""
    config = tiny_config(block_size=96)
    sizes = [cache_positions(config, longest, new) for longest, new in ((7, 20), (1, 0), (7, 200), (30, 34))]
    assert sizes == [32, 4, 96, 64]


# A chat template in few tokens (the random folder's BPE has 300, its context 96 positions).
TEMPLATE = ("{% for message in messages %}{{ message['role'][0] + ': ' + message['content'] + '\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ 'a:' }}{% endif %}")
BRIEF = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who art thou?"}]


@pytest.fixture
def chat_folder(hf_folders, tmp_path):
    """The random Llama folder with a ChatML template, and its end-of-text id: the 4th token its
    greedy answer to a question draws (so that the answer ends there)."""
    from data.chat import chat_ids
    from model.generation import generate

    path = tmp_path / "chat"
    shutil.copytree(hf_folders["llama"][0], path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    from model.loading import load_model

    model, _ = load_model(path, "cpu")
    ids = chat_ids(HFTokenizer(path / "tokenizer.json"), BRIEF)
    eos = generate(model, [ids], 8, temperature=0)[0][len(ids) + 3].item()
    (path / "generation_config.json").write_text(f'{{"eos_token_id": [{eos}]}}')
    return path, model


def test_a_chat_answers_in_the_template_and_ends_at_the_end_of_text_token(chat_folder):
    """chat=<message>: the greedy answer to the rendered conversation, cut at its end-of-text token
    (not printed); ignore_eos=true goes on to max_new_tokens."""
    from data.chat import chat_ids
    from model.generation import generate

    path, model = chat_folder
    tokenizer = HFTokenizer(path / "tokenizer.json")
    ids = chat_ids(tokenizer, BRIEF)
    answer = generate(model, [ids], 20, temperature=0, eos_ids=tokenizer.eos_ids)[0][len(ids):].tolist()
    result = generate_cli(f"ckpt={path}", "chat=Who art thou?", "system=Be brief.", "temperature=0",
                          "max_new_tokens=20")
    assert result.returncode == 0, result.stderr
    assert answer[-1] in tokenizer.eos_ids and len(answer) < 20
    assert result.stdout == tokenizer.decode(answer[:-1]) + "\n"
    endless = generate_cli(f"ckpt={path}", "chat=Who art thou?", "system=Be brief.", "temperature=0",
                           "max_new_tokens=20", "ignore_eos=true")
    assert endless.stdout.startswith(result.stdout[:-1]) and len(endless.stdout) > len(result.stdout)


def test_a_chat_on_standard_input_reuses_its_cache_and_answers_as_afresh(chat_folder, monkeypatch):
    """chat=-: each line a turn, `--` ends it; the second turn reuses the first's tokens (show_cache
    says how many) and its answer is the whole conversation's prefilled afresh."""
    from data.chat import chat_ids
    from model.generation import generate

    path, model = chat_folder
    tokenizer = HFTokenizer(path / "tokenizer.json")
    monkeypatch.setattr("sys.stdin", io.StringIO("Who art thou?\n\nAnd whence?\n--\nnot read\n"))
    result = generate_cli(f"ckpt={path}", "chat=-", "temperature=0", "max_new_tokens=12", "show_cache=true")
    assert result.returncode == 0, result.stderr
    answers = re.split(r"\n\[cache: \d+ tokens reused, \d+ prefilled\]\n", result.stdout)
    counts = [tuple(map(int, c)) for c in re.findall(r"\[cache: (\d+) tokens reused, (\d+) prefilled\]",
                                                     result.stdout)]
    assert len(answers) == 3 and answers[2] == "" and counts[0][0] == 0
    first = [{"role": "user", "content": "Who art thou?"}, {"role": "assistant", "content": answers[0]}]
    ids = chat_ids(tokenizer, first + [{"role": "user", "content": "And whence?"}])
    fresh = generate(model, [ids], 12, temperature=0, eos_ids=tokenizer.eos_ids)[0][len(ids):].tolist()
    assert answers[1] == tokenizer.decode([t for t in fresh if t not in tokenizer.eos_ids])
    assert counts[1][0] >= counts[0][1] and sum(counts[1]) == len(ids)  # (the first prompt at least)


def test_a_chat_past_its_cache_drops_old_turns_or_says_what_to_do(chat_folder, monkeypatch):
    """The folder's 96 positions: turns that outgrow them drop the oldest, with a note; a message that
    alone does not fit is refused in one line, and the chat goes on."""
    path, _ = chat_folder
    long = "ROMEO: " * 20
    turns = f"Who art thou?\nAnd whence?\nWhy?\nWhat?\n{long}\nAnd now?\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(turns))
    result = generate_cli(f"ckpt={path}", "chat=-", "temperature=0", "max_new_tokens=30", "ignore_eos=true")
    assert result.returncode == 0, result.stderr
    assert "chat: the conversation outgrew the cache: its oldest turn is dropped" in result.stderr
    assert "chat: this message and max_new_tokens=30 do not fit in the chat's cache of 96 positions: " \
           "write a shorter one, or lower max_new_tokens" in result.stderr
    assert all(line.startswith("chat: ") for line in result.stderr.splitlines())  # (no traceback)


@pytest.mark.parametrize("args, message", [
    (["chat=Hi", "prompt=ROMEO:"], "chat and prompt both give the prompt: give one"),
    (["system=Be brief."], "system is for a chat: give chat=<message>"),
    (["show_cache=true", "chat=Hi"], "show_cache is for a chat on standard input: give chat=-"),
    (["chat=-", "num_samples=2"], "chat=- is a chat on standard input: leave num_samples=1"),
    (["chat=-", "kv_cache=false"], "chat=- is a chat on standard input: leave kv_cache=true"),
    (["chat= "], "chat is empty: give the message"),
])
def test_chat_options_that_clash_are_one_line(args, message):
    assert_one_line_error(generate_cli("ckpt=nowhere", *args), message)


def test_a_model_without_a_chat_template_refuses_chat_in_one_line(chat_folder, tiny_ckpt, tmp_path):
    path, _ = chat_folder
    assert_one_line_error(generate_cli(f"ckpt={tiny_ckpt}", "chat=Hi"),
                          "chat: this model's tokenizer (char, trained here) has no chat template")
    (path / "chat_template.jinja").unlink()
    assert_one_line_error(generate_cli(f"ckpt={path}", "chat=Hi"), f"chat: this model's tokenizer "
                          f"({path / 'tokenizer.json'}) has no chat template: give the text as a prompt")
    (path / "chat_template.jinja").write_text("{% for m in messages %}")
    assert_one_line_error(generate_cli(f"ckpt={path}", "chat=Hi"), "chat: the chat template does not parse")


def test_a_message_the_chat_cannot_take_is_one_line_and_the_chat_goes_on(chat_folder, monkeypatch):
    """A line that is not UTF-8 (a surrogate escape, as Python hands over undecodable bytes) or that
    the template refuses: one line, the next message answered; max_new_tokens that leave no room
    for a message are refused before the chat starts."""
    path, _ = chat_folder
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('no boom') }}{% endif %}"
        + TEMPLATE.removeprefix("{% for message in messages %}").replace("message[", "m["))
    monkeypatch.setattr("sys.stdin", io.StringIO("bad \udcff byte\nboom\nWho art thou?\n"))
    result = generate_cli(f"ckpt={path}", "chat=-", "temperature=0", "max_new_tokens=4", "show_cache=true")
    assert result.returncode == 0, result.stderr
    assert "chat: text is not UTF-8: byte 0xff" in result.stderr
    assert "chat: the chat template refused this conversation: no boom" in result.stderr
    assert result.stdout.count("[cache: 0 tokens reused") == 1
    assert_one_line_error(generate_cli(f"ckpt={path}", "chat=-", "max_new_tokens=96"),
                          "max_new_tokens=96 leaves no room for a message in the chat's cache of 96")


def test_a_chat_config_is_a_dataclass_like_any_other():
    cfg = dataclasses.replace(GenerateConfig(ckpt="x", chat="hi", system="Be brief."), temperature=0.0)
    assert (cfg.chat, cfg.prompt, cfg.temperature) == ("hi", None, 0.0)
    assert dataclasses.replace(GenerateConfig(ckpt="x", chat="-"), seed=2).chat == "-"
