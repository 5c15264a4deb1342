"""What a chat adds to generation (model/generation.py): one KV cache kept from turn to turn, so that
each turn prefills only the tokens the conversation added since the last.

    chat = Conversation(model, cells=4096)
    for token in chat.reply(ids, Sampling(200, temperature=0, eos_ids=tokenizer.eos_ids)): ...
    chat.reused, chat.prefilled        # this turn's tokens found in the cache, and those run into it

`reply` takes the whole conversation's ids each turn (a chat template renders it afresh). The
cache keeps the longest prefix it shares with what the cache holds; a template that renders
earlier turns otherwise only shortens that prefix, so the tokens are those of the whole
conversation prefilled afresh. A ring (a sliding window) never cuts back: there a turn that does
not extend the cache refills it from the start.
"""

import torch

from model.config import check_integer
from model.decode_step import CudnnAttentionOff
from model.generation import Decoding, TokenBuffer, check_generation, decoded
from model.prefill import feed
from model.sampling import Sampling


class Conversation:
    """A chat's KV cache of `cells` positions (at most block_size; without `cells`, the decode step's
    own cache where `decoding` has one, else block_size) and the tokens it holds, one row. A turn's
    ids and its new tokens must fit in it (`room`): the caller drops old turns first. The cache is
    the conversation's alone: no other stream may use the decode step meanwhile."""

    def __init__(self, model, decoding: Decoding | None = None, cells: int | None = None):
        self.model, self.decoding = model, Decoding() if decoding is None else decoding
        if not self.decoding.kv_cache:
            raise ValueError("a Conversation keeps its KV cache from turn to turn: kv_cache must be True")
        step = self.decoding.decode_step
        if step is not None and cells is not None:
            raise ValueError("cells: a Conversation with a decode step uses its cache: give one of them")
        if step is not None:
            self.cache = step.cache
        else:
            cells = model.config.block_size if cells is None else cells
            check_integer(cells, "cells", 2, model.config.block_size)
            self.cache = model.new_kv_cache(1, cells, dtype=self.decoding.kv_dtype)
        self.rings = any(group.ring for group in self.cache.groups)
        self.held: list[int] = []  # the tokens in the cache, position p's at p (its first cache.length)
        self.reused = self.prefilled = 0
        self.turn = None  # the last turn's generator: ended (closed) when the next begins

    @property
    def room(self) -> int:
        """The positions a turn's ids and its new tokens may take together: the cache's, or with only
        rings (which take positions without end), block_size."""
        return self.model.config.block_size if self.cache.ring else self.cache.max_len

    def reply(self, ids, sampling: Sampling, generator=None):
        """Yield the answer's tokens, (1,) each, to the conversation `ids` (a list of token ids: every
        turn so far, the assistant's opened), as `sampling` draws them. Checked here, when called
        (as `stream` checks its arguments)."""
        vocab = self.model.config.vocab_size
        if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) and 0 <= i < vocab
                                                                    for i in ids):
            raise ValueError(f"ids must be a non-empty list of token ids below {vocab}")
        idx = torch.tensor([list(ids)], device=self.model.wte.weight.device)  # (1, T)
        check_generation(self.model, idx, sampling, self.decoding, generator)
        if len(ids) + sampling.max_new_tokens > self.room:
            raise ValueError(f"{len(ids)} tokens of conversation + max_new_tokens={sampling.max_new_tokens} "
                             f"exceed the chat's cache of {self.room} positions: drop old turns")
        if self.turn is not None:
            self.turn.close()  # (its end records what it fed into the cache, read to the end or not)
        self.turn = self.answer(list(ids), idx, sampling, generator)
        return self.turn

    @torch.no_grad()
    def answer(self, ids: list[int], idx, sampling: Sampling, generator):
        """`reply`'s tokens: the cache cut back to the prefix it shares with ids, the rest fed, then
        `decoded`. `held` follows what the cache holds however the turn ends (read to the end, left
        and closed by the next turn, interrupted)."""
        keep = min(shared_length(self.held, ids), self.cache.length)
        if self.rings and keep < self.cache.length:
            keep = 0  # (a ring's earlier cells are overwritten: refilled from the start)
        self.cache.truncate(keep)
        self.held, self.reused, self.prefilled = ids[:keep], keep, len(ids) - keep
        context = TokenBuffer(idx, None, len(ids) + sampling.max_new_tokens, sampling.max_new_tokens)
        try:
            with torch.inference_mode(), CudnnAttentionOff():
                logits = feed(self.model, idx[:, keep:], self.cache, None, self.decoding.prefill_chunk)
            yield from decoded(self.model, context, self.cache, None, logits, sampling, self.decoding,
                               generator)
        finally:  # the cache holds its first cache.length tokens of the context
            self.held = context.tokens[0, :self.cache.length].tolist()


def shared_length(held: list[int], ids: list[int]) -> int:
    """How many first tokens `ids` shares with `held`, at most all but its last (whose logits the turn
    needs, so it runs again)."""
    n = 0
    for a, b in zip(held, ids[:-1]):
        if a != b:
            break
        n += 1
    return n
