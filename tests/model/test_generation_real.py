"""model/generation.py on a real model, SmolLM2-135M-Instruct (tests/real_model.py makes its folder): each
promise of exactness where docs/generation.md states it. In float32 a batched row gets the tokens its
prompt gets alone, and the cache the tokens of the uncached reference, greedy and seeded; in
bfloat16 with int8 weights (generate.py's default on a CPU) the same computation, to rounding."""

import pytest
import torch

from model.device import Precision
from model.generation import generate
from model.loading import load_model
from tests.helpers import stream_logits
from tests.real_model import FOLDER, MAKE

PROMPTS = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
           "The KV cache", "Once upon a time, in a small village by the sea, there lived"]
N = 12  # new tokens a row


def smollm2(precision: Precision):
    if not (FOLDER / "model.safetensors").is_file():
        pytest.skip(f"no SmolLM2-135M-Instruct folder: `{MAKE}` makes it (what .ci/run does)")
    model, ckpt = load_model(FOLDER, "cpu", precision)
    from data.tokenizer import tokenizer_from_meta

    return model, [tokenizer_from_meta(ckpt.data_meta).encode(p) for p in PROMPTS]


@pytest.fixture
def float32():
    return smollm2(Precision("float32", None))


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


def test_in_bfloat16_with_int8_weights_a_batched_row_is_its_prompt_alone_to_rounding():
    """generate.py's default on a CPU: each batched row's logits are those of its prompt alone to
    bfloat16's rounding (not bit for bit: a batch's products round otherwise), along the same
    tokens (8: before any of these prompts' texts part)."""
    model, prompts = smollm2(Precision("bfloat16", "int8"))
    alone = [stream_logits(model, [p], 8) for p in prompts]               # ([(T + 8,)], [(1, vocab)] a token)
    rows, batched = stream_logits(model, prompts, 8)                      # [(T + 8,)], [(B, vocab)] a token
    for row, (tokens, logits) in enumerate(alone):
        assert torch.equal(rows[row], tokens[0]), row
        got, want = torch.stack([step[row] for step in batched]), torch.cat(logits)
        assert ((got.float() - want.float()).norm() / want.float().norm()) < 2e-2, row


def tokenizer_text(ids) -> str:
    from data.tokenizer import HFTokenizer

    return HFTokenizer(FOLDER / "tokenizer.json").decode(ids.tolist())
