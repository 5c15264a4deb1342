"""model/conversation.py: a chat's turns answered from the KV cache it keeps, each turn the tokens of the
whole conversation prefilled afresh (the uncached reference too), whatever the template re-renders, for
every cache kind; and its refusals."""

import pytest
import torch

from model.conversation import Conversation
from model.decode_step import CompiledDecodeStep
from model.generation import Decoding, generate
from model.sampling import Sampling
from tests.helpers import BOUNDED, ENDLESS, tiny_model

KINDS = {"float32": {}, "int8": {"kv_dtype": "int8"}, "chunks of 2": {"prefill_chunk": 2}}


def fresh(model, ids, sampling, seed, kv_cache=True):
    """The answer to `ids` prefilled afresh (or from scratch every step, kv_cache=False)."""
    out = generate(model, [ids], sampling.max_new_tokens, temperature=sampling.temperature,
                   top_k=sampling.top_k, eos_ids=sampling.eos_ids, kv_cache=kv_cache,
                   generator=torch.Generator().manual_seed(seed))[0]
    return out[len(ids):].tolist()


# Every cache kind in float32; the other storages on a ring, MLA and local/global layers.
CASES = [(kind, "float32") for kind in [*ENDLESS, *BOUNDED]] + [
    (kind, storage) for kind in ("window, sinks", "mla", "local/global") for storage in list(KINDS)[1:]]


@pytest.mark.parametrize("kind, storage", CASES)
def test_each_turn_prefills_only_what_it_adds_and_answers_as_the_whole_conversation_afresh(kind, storage):
    """Three turns: the second extends the first and its answer (only its new tokens prefilled), the
    third re-renders an earlier turn otherwise (the cache cut back to the shared prefix; a ring
    refilled). Each answer is the fresh prefill's and the uncached reference's, seeded."""
    overrides = (ENDLESS | BOUNDED)[kind]
    model = tiny_model(pos_emb="rope", block_size=48, **overrides)
    chat = Conversation(model, Decoding(**KINDS[storage]), cells=48)
    sampling = Sampling(6, temperature=1.0, top_k=10)
    first = [1, 2, 3, 4, 5]
    answer = list(map(int, chat.reply(first, sampling, torch.Generator().manual_seed(0))))
    assert (chat.reused, chat.prefilled) == (0, 5) and answer == fresh(model, first, sampling, 0)
    second = first + answer + [7, 8]
    got = list(map(int, chat.reply(second, sampling, torch.Generator().manual_seed(1))))
    assert (chat.reused, chat.prefilled) == (10, len(second) - 10)  # (the last answer token: not yet fed)
    assert got == fresh(model, second, sampling, 1) == fresh(model, second, sampling, 1, kv_cache=False)
    third = first[:2] + [9] + second[3:] + got + [11]
    again = list(map(int, chat.reply(third, sampling, torch.Generator().manual_seed(2))))
    assert chat.reused == (0 if chat.rings else 2)
    assert again == fresh(model, third, sampling, 2)


def test_a_compiled_step_serves_the_chat_from_its_own_cache():
    model = tiny_model(pos_emb="rope", block_size=48)
    step = CompiledDecodeStep(model, batch_size=1, backend="aot_eager", max_len=32)
    chat, sampling = Conversation(model, Decoding(decode_step=step)), Sampling(5, temperature=0)
    first = list(map(int, chat.reply([3, 1, 4], sampling)))
    second = [3, 1, 4] + first + [1, 5]
    assert list(map(int, chat.reply(second, sampling))) == fresh(model, second, sampling, 0)
    assert chat.cache is step.cache and chat.reused == 7 and chat.room == 32


def test_a_turn_ends_at_an_end_of_text_id_and_the_next_turn_starts_from_it():
    model = tiny_model(pos_emb="rope", block_size=48)
    free = fresh(model, [1, 2], Sampling(12, temperature=0), 0)
    sampling = Sampling(12, temperature=0, eos_ids=free[3])
    chat = Conversation(model, cells=48)
    answer = list(map(int, chat.reply([1, 2], sampling)))
    assert answer == free[:free.index(free[3]) + 1]
    second = [1, 2] + answer + [6]
    assert list(map(int, chat.reply(second, sampling))) == fresh(model, second, sampling, 0)
    assert chat.reused == 2 + len(answer) - 1


def test_a_reader_that_stops_early_leaves_the_cache_consistent():
    model = tiny_model(pos_emb="rope", block_size=48)
    chat, sampling = Conversation(model, cells=48), Sampling(8, temperature=0)
    tokens = chat.reply([1, 2, 3], sampling)
    taken = [int(next(tokens)) for _ in range(3)]
    tokens.close()
    second = [1, 2, 3] + taken + [4]
    assert list(map(int, chat.reply(second, sampling))) == fresh(model, second, sampling, 0)


def test_a_turn_left_unread_ends_when_the_next_begins_and_keeps_what_it_fed():
    """A reader that stops at its answer's end (as generate.py's printer does at an eos id) leaves
    the turn open: the next turn closes it first, so its answer's tokens are reused."""
    model = tiny_model(pos_emb="rope", block_size=48)
    chat, sampling = Conversation(model, cells=48), Sampling(6, temperature=0)
    first = chat.reply([1, 2, 3], sampling)
    taken = [int(next(first)) for _ in range(3)]
    second = [1, 2, 3, *taken, 4]
    answer = list(map(int, chat.reply(second, sampling)))
    assert chat.reused == 3 + 2  # (the prompt and the tokens fed before the third was drawn)
    first.close()  # (a no-op: it ended when the second turn began)
    third = second + answer + [5]
    assert list(map(int, chat.reply(third, sampling))) == fresh(model, third, sampling, 0)
    assert chat.reused == len(second) + len(answer) - 1


@pytest.mark.parametrize("call, message", [
    (lambda m: Conversation(m, Decoding(kv_cache=False)), "keeps its KV cache from turn to turn"),
    (lambda m: Conversation(m, cells=49), r"cells must be at most 48"),
    (lambda m: Conversation(m, cells=16).reply([1] * 12, Sampling(5)), r"12 tokens of conversation \+ "
     r"max_new_tokens=5 exceed the chat's cache of 16 positions: drop old turns"),
    (lambda m: Conversation(m).reply([], Sampling(5)), "ids must be a non-empty list of token ids below 37"),
    (lambda m: Conversation(m).reply([37], Sampling(5)), "ids must be a non-empty list of token ids below"),
    (lambda m: Conversation(m).reply([1], Sampling(5, eos_ids=37)), "eos_ids must be at most 36"),
    (lambda m: Conversation(m).reply([1], 5), "sampling must be a Sampling"),
    (lambda m: Conversation(m, Decoding(decode_step=CompiledDecodeStep(m, 1, backend="aot_eager")), cells=8),
     "cells: a Conversation with a decode step uses its cache: give one of them"),
])
def test_refusals_name_what_is_wrong(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call(tiny_model(pos_emb="rope", block_size=48))
