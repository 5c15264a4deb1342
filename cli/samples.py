"""What generate.py prints as it samples: each row's text up to its end (an end-of-text id or the
`stop` string), a single sample streamed as it grows; and a chat, its turns read from standard
input, each answered from the KV cache the conversation keeps (model.conversation)."""

import sys

from cli.errors import naming
from data.chat import chat_ids
from data.tokenizer import TextStream
from model.conversation import Conversation

CHAT_CELLS = 4096  # positions a chat's cache holds (at most block_size): a long chat in ~190 MB for 135M
END_OF_CHAT = "--"  # a line that ends the chat (as does the end of input: Ctrl-D)


def print_samples(prompts: list[str], tokens, tokenizer, stop: str | None, out, eos_ids=()) -> list[str]:
    """Decode each row's new tokens (`stream`'s steps) up to and including `stop`, or up to one of
    `eos_ids` (not printed); print a single sample as it grows, several once done. Returns each
    sample's new text."""
    streams = [TextStream(tokenizer) for _ in prompts]
    texts, done = [""] * len(prompts), [False] * len(prompts)
    streaming = len(prompts) == 1
    if streaming:
        print(prompts[0], end="", file=out, flush=True)

    def extend(row: int, piece: str) -> None:
        text = texts[row] + piece
        if stop and (at := text.find(stop, max(0, len(texts[row]) - len(stop) + 1))) >= 0:
            text, done[row] = text[:at + len(stop)], True
        if streaming:
            print(text[len(texts[row]):], end="", file=out, flush=True)
        texts[row] = text

    for step_tokens in tokens:
        for row, token in enumerate(step_tokens.tolist()):
            if not done[row] and token in eos_ids:
                extend(row, streams[row].end())
                done[row] = True
            elif not done[row]:
                extend(row, streams[row].add(token))
        if all(done):
            break
    for row in range(len(prompts)):
        if not done[row]:
            extend(row, streams[row].end())
    if streaming:
        print(file=out)
    else:
        for i, (prompt, text) in enumerate(zip(prompts, texts)):
            print(f"{'=' * 20} sample {i + 1}/{len(prompts)} {'=' * 20}\n{prompt}{text}", file=out)
    return texts


def first_messages(system: str | None, user: str | None = None) -> list[dict]:
    """A conversation's first messages: the system message, if any, and the user's, if any."""
    roles = (("system", system), ("user", user))
    return [{"role": role, "content": text} for role, text in roles if text is not None]


def chat(model, tokenizer, sampling, decoding, generator, system: str | None, stop: str | None,
         show_cache: bool, lines=None, out=None) -> list[str]:
    """A chat on standard input (`lines`): each line a user's message, answered as it is drawn;
    `--` or the end of input ends it. Each turn prefills only what the conversation added to the
    cache (printed with show_cache); a conversation past the cache drops its oldest turns, saying so.
    Returns the answers."""
    lines, out = sys.stdin if lines is None else lines, out or sys.stdout
    cells = min(model.config.block_size, CHAT_CELLS)
    conversation = Conversation(model, decoding, None if decoding.decode_step else cells)
    if sampling.max_new_tokens >= conversation.room:
        raise ValueError(f"max_new_tokens={sampling.max_new_tokens} leaves no room for a message in the "
                         f"chat's cache of {conversation.room} positions: lower it")
    messages, answers = first_messages(system), []
    with naming("chat"):
        chat_ids(tokenizer, messages + first_messages(None, "hi"))  # a template that fails, before any turn
    print(f"chat: one message a line; {END_OF_CHAT} or the end of input (Ctrl-D) ends it", file=sys.stderr)
    for line in lines:
        text = line.rstrip("\r\n")
        if text.strip() == END_OF_CHAT:
            break
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        try:
            ids = fitted(messages, tokenizer, conversation.room - sampling.max_new_tokens, system is not None)
            refused = None if ids else (f"chat: this message and max_new_tokens={sampling.max_new_tokens} "
                                        f"do not fit in the chat's cache of {conversation.room} positions: "
                                        f"write a shorter one, or lower max_new_tokens")
        except ValueError as e:  # (this message: not UTF-8, refused by the template): the chat goes on
            refused = str(e)
        if refused:
            messages.pop()
            print(refused, file=sys.stderr)
            continue
        tokens = conversation.reply(ids, sampling, generator)
        (answer,) = print_samples([""], tokens, tokenizer, stop, out, sampling.eos_ids)
        messages.append({"role": "assistant", "content": answer})
        answers.append(answer)
        if show_cache:
            print(f"[cache: {conversation.reused} tokens reused, {conversation.prefilled} prefilled]",
                  file=out)
    return answers


def fitted(messages: list[dict], tokenizer, room: int, has_system: bool) -> list[int] | None:
    """The conversation's ids once they fit in `room` tokens: its oldest turns (after the system
    message) dropped, with a note, as long as needed; None where the last message alone does not fit."""
    with naming("chat"):
        ids = chat_ids(tokenizer, messages)
    first = int(has_system)
    while len(ids) > room:
        if len(messages) - first <= 1:
            return None
        del messages[first:first + 2]  # the oldest user message and its answer
        print("chat: the conversation outgrew the cache: its oldest turn is dropped", file=sys.stderr)
        with naming("chat"):
            ids = chat_ids(tokenizer, messages)
    return ids
