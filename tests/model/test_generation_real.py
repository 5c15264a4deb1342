"""Generation on a real model, SmolLM2-135M-Instruct (the `smollm2` fixture: tests/real_model.py), as people
use it: its chat template rendered as transformers renders it, its greedy answer transformers' token for
token, ending at <|im_end|>, a chat's second turn prefilling only what it adds; and each promise of
exactness where docs/generation.md states it. In float32 a batched row gets the tokens its prompt gets
alone, and the cache the tokens of the uncached reference, greedy and seeded; in bfloat16 with int8
weights the same computation, to rounding. Run with `pytest -m real` (.ci/run does)."""

import re
import subprocess
import sys

import pytest
import torch

from data.chat import chat_ids, render_chat
from data.tokenizer import HFTokenizer
from model.conversation import Conversation
from model.device import Precision
from model.generation import generate
from model.loading import load_model
from model.sampling import Sampling
from tests.helpers import ROOT, clean_env, stream_logits
from tests.real_model import FOLDER

pytestmark = pytest.mark.real
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CONVERSATIONS = [
    QUESTION,
    [{"role": "system", "content": "You are a pirate. Answer in one sentence."}] + QUESTION,
    QUESTION + [{"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy? Answer with café-style brevity 🎭."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Name 3 colours."}, {"role": "assistant", "content": "Red, green, blue."},
     {"role": "user", "content": "Thanks"}],
]

PROMPTS = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
           "The KV cache", "Once upon a time, in a small village by the sea, there lived"]
N = 12  # new tokens a row


def loaded(precision: Precision):
    model, ckpt = load_model(FOLDER, "cpu", precision)
    from data.tokenizer import tokenizer_from_meta

    return model, [tokenizer_from_meta(ckpt.data_meta).encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def float32(smollm2):
    return loaded(Precision("float32", None))


@pytest.fixture(scope="module")
def transformers_smollm2(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(FOLDER)


def test_the_chat_template_renders_as_transformers_apply_chat_template(transformers_smollm2):
    """Several conversations (none, one system message; one to three turns), with and without the
    assistant's turn opened: the same text and the same ids."""
    _, theirs = transformers_smollm2
    ours = HFTokenizer(FOLDER / "tokenizer.json")
    for messages in CONVERSATIONS:
        for opened in (True, False):
            want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=opened)
            assert render_chat(ours.chat_template, messages, opened, **ours.special_tokens) == want
            ids = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=opened)
            assert chat_ids(ours, messages, opened) == list(getattr(ids, "input_ids", ids))


def test_a_chats_greedy_answer_is_transformers_and_ends_at_im_end(float32, transformers_smollm2):
    """60 tokens at most, float32, the model's default on a CPU: transformers' greedy tokens, ending
    at the same <|im_end|> (eos id 2); without eos_ids the sample goes on past it."""
    model, _ = float32
    hf, _ = transformers_smollm2
    tokenizer = HFTokenizer(FOLDER / "tokenizer.json")
    assert tokenizer.eos_ids == (2,) and tokenizer.decode([2]) == "<|im_end|>"
    for messages in CONVERSATIONS[:2]:
        ids = chat_ids(tokenizer, messages)
        ours = generate(model, [ids], 60, temperature=0, eos_ids=tokenizer.eos_ids)[0][len(ids):].tolist()
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=60, do_sample=False)[0, len(ids):].tolist()
        assert ours == theirs and ours[-1] == 2 and 2 not in ours[:-1]
    ids = chat_ids(tokenizer, QUESTION)
    on = generate(model, [ids], 20, temperature=0)[0][len(ids):].tolist()
    assert on[:len(ours)] == ours and len(on) == 20 and "Paris" in tokenizer.decode(ours)


def test_a_second_turn_prefills_only_its_new_tokens_and_answers_as_afresh(float32):
    """Seeded: the second turn reuses the first turn's prompt and answer from the cache, prefills
    the rest, and draws the tokens the whole conversation prefilled afresh draws."""
    model, _ = float32
    tokenizer = HFTokenizer(FOLDER / "tokenizer.json")
    chat, sampling = Conversation(model, cells=512), Sampling(40, 0.7, 50, eos_ids=tokenizer.eos_ids)
    first = chat_ids(tokenizer, QUESTION)
    answer = [int(t) for t in chat.reply(first, sampling, torch.Generator().manual_seed(0))]
    messages = QUESTION + [{"role": "assistant", "content": tokenizer.decode(answer[:-1])},
                           {"role": "user", "content": "And of Italy?"}]
    second = chat_ids(tokenizer, messages)
    again = [int(t) for t in chat.reply(second, sampling, torch.Generator().manual_seed(1))]
    assert chat.reused == len(first) + len(answer) - 1 and chat.prefilled == len(second) - chat.reused
    fresh = generate(model, [second], 40, temperature=0.7, top_k=50, eos_ids=tokenizer.eos_ids,
                     generator=torch.Generator().manual_seed(1))[0][len(second):].tolist()
    assert again == fresh and again[-1] == 2


def generate_py(*args, stdin=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "generate.py", *args], cwd=ROOT, env=clean_env(), input=stdin,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_generate_py_answers_a_chat_and_stops_folder_or_gguf(smollm2, source):
    """The README's command, on the folder and on the GGUF file it came from: the answer, then the
    end (no <|im_end|> printed, no invented next turn)."""
    path = smollm2[0] if source == "folder" else smollm2[1]
    result = generate_py(f"ckpt={path}", "chat=What is the capital of France?", "temperature=0")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "The capital of France is Paris.\n"


def test_a_two_turn_chat_on_standard_input_reuses_the_first_turns_cache(smollm2):
    result = generate_py(f"ckpt={smollm2[0]}", "chat=-", "temperature=0", "show_cache=true",
                         stdin="What is the capital of France?\nAnd of Italy?\n")
    assert result.returncode == 0, result.stderr[-2000:]
    counts = [tuple(map(int, c)) for c in re.findall(r"\[cache: (\d+) tokens reused, (\d+) prefilled\]",
                                                     result.stdout)]
    assert len(counts) == 2 and counts[0][0] == 0 and counts[1][0] > counts[0][1] + 4  # (its answer too)
    assert "Paris" in result.stdout and "Rome" in result.stdout


def test_in_float32_batched_rows_and_the_uncached_reference_give_each_prompts_own_tokens(float32):
    """Three prompts of 4 to 20 tokens, left-padded into one batch: each row's greedy tokens are its
    prompt's alone (the chat prompt's answer the model's: Paris), and each of those is the argmax
    of the uncached model over all the tokens before it (one pass over the whole sequence: the
    reference's logits at every position); a seeded sample draws the same tokens with and without
    the cache."""
    model, prompts = float32
    batched = generate(model, prompts, N, temperature=0)
    for prompt, row in zip(prompts, batched):
        alone = generate(model, [prompt], N, temperature=0)[0]
        assert torch.equal(row, alone)
        with torch.no_grad():
            reference = model(alone[None, :-1])[0, len(prompt) - 1:].argmax(-1)   # (N,)
        assert torch.equal(alone[len(prompt):], reference)
    assert "Paris" in tokenizer_text(batched[0][len(prompts[0]):])
    seeded = [generate(model, [prompts[1]], 8, temperature=0.8, top_k=200, kv_cache=kv_cache,
                       generator=torch.Generator().manual_seed(3))[0] for kv_cache in (True, False)]
    assert torch.equal(*seeded)


def test_in_bfloat16_with_int8_weights_a_batched_row_is_its_prompt_alone_to_rounding(smollm2):
    """The fastest flags on a CPU: each batched row's logits are those of its prompt alone to
    bfloat16's rounding (not bit for bit: a batch's products round otherwise), along the same
    tokens (8: before any of these prompts' texts part)."""
    model, prompts = loaded(Precision("bfloat16", "int8"))
    alone = [stream_logits(model, [p], 8) for p in prompts]               # ([(T + 8,)], [(1, vocab)] a token)
    rows, batched = stream_logits(model, prompts, 8)                      # [(T + 8,)], [(B, vocab)] a token
    for row, (tokens, logits) in enumerate(alone):
        assert torch.equal(rows[row], tokens[0]), row
        got, want = torch.stack([step[row] for step in batched]), torch.cat(logits)
        assert ((got.float() - want.float()).norm() / want.float().norm()) < 2e-2, row


def tokenizer_text(ids) -> str:
    from data.tokenizer import HFTokenizer

    return HFTokenizer(FOLDER / "tokenizer.json").decode(ids.tolist())


def test_the_docs_chat_from_python_runs_as_written(smollm2, capsys):
    """docs/gpt2.md's Python chat, its folder the real one: the two answers and the reuse it says."""
    docs = (ROOT / "docs" / "gpt2.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", docs, flags=re.S)
    (code,) = [block for block in blocks if "Conversation" in block]
    exec(code.replace("path/to/SmolLM2-135M-Instruct", str(FOLDER)), {})
    assert capsys.readouterr().out == ("The capital of France is Paris. (0 tokens reused, 37 prefilled)\n"
                                       "The capital of Italy is Rome. (44 tokens reused, 15 prefilled)\n")
