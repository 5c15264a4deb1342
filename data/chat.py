"""A model's chat format: the chat template a Hugging Face folder ships (chat_template.jinja, or
tokenizer_config.json's chat_template), rendered as transformers' apply_chat_template renders it
(Jinja2 in a sandbox, the folder's special tokens, `add_generation_prompt`), and the end-of-text ids
a folder declares (generation_config.json's eos_token_id, else config.json's).

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ids = chat_ids(tokenizer, messages)      # the conversation's tokens, the assistant's turn opened

A template is code from the model's authors: it runs in Jinja2's immutable sandbox, which refuses
access to Python's internals, and a template that does not parse, or refuses a conversation
(`raise_exception`), is one ValueError.
"""

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def folder_chat_template(folder: Path) -> tuple[str | None, dict[str, str]]:
    """(the folder's chat template or None, its special tokens by name: bos_token, eos_token, ...),
    as transformers reads them: chat_template.jinja first, else tokenizer_config.json's chat_template
    (one string, or a list of named templates: the one named "default")."""
    config = read_json(folder / "tokenizer_config.json")
    special = {}
    for source in (read_json(folder / "special_tokens_map.json"), config):
        for name in SPECIAL_TOKENS:
            value = source.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                special[name] = value
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8"), special
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return (template if isinstance(template, str) else None), special


def folder_eos_ids(folder: Path, vocab_size: int) -> tuple[int, ...]:
    """The end-of-text ids the folder's model declares: generation_config.json's eos_token_id (one
    id or a list), else config.json's, those of the tokenizer's vocabulary (no other is drawn); ()
    where neither has one. A value that is not token ids is a ValueError naming the file."""
    for name in ("generation_config.json", "config.json"):
        value = read_json(folder / name).get("eos_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"{folder / name}: eos_token_id must be token ids (one or a list), got "
                             f"{json.dumps(value)[:60]}")
        return tuple(dict.fromkeys(i for i in ids if i < vocab_size))  # (one past the tokenizer: never drawn)
    return ()


def read_json(file: Path) -> dict:
    """A JSON object from `file`, or {} where there is none (a folder's optional files)."""
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise ValueError(f"{file} is not JSON ({type(e).__name__}: {e})") from e
    return value if isinstance(value, dict) else {}


def check_messages(messages) -> list[dict]:
    """A conversation: a list of {"role": str, "content": str} messages, one at least."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}}, got "
                         f"{messages!r}")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"each message must be {{'role': str, 'content': str}}, got {m!r}")
    return [dict(m) for m in messages]


def render_chat(template: str, messages, add_generation_prompt: bool = True, **special_tokens) -> str:
    """The conversation as text in the template's format, as transformers' apply_chat_template
    renders it (tokenize=False): the template given `messages`, `add_generation_prompt` (the
    assistant's turn opened after them) and the special tokens (bos_token, ...)."""
    messages = check_messages(messages)
    import jinja2

    template = compiled(template)
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                               documents=None, **special_tokens)
    except jinja2.TemplateError as e:  # raise_exception, or the sandbox refusing an access
        raise ValueError(f"the chat template refused this conversation: {e}") from e
    except Exception as e:  # noqa: BLE001  the template's own code failing (1/0, None + 1, ...)
        raise ValueError(f"the chat template failed on this conversation ({type(e).__name__}: {e})") from e


@lru_cache(maxsize=8)
def compiled(template: str):
    """The template compiled in Jinja2's immutable sandbox, with what transformers gives a template:
    whitespace control (trim_blocks, lstrip_blocks), loop controls, {% generation %} blocks (their
    text as is), a tojson that keeps non-ASCII text, raise_exception and strftime_now."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # {% generation %}...{% endgeneration %}: marks the assistant's text
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", Generation])
    env.filters["tojson"] = tojson
    env.globals |= {"raise_exception": raise_exception,
                    "strftime_now": lambda fmt: datetime.now().strftime(fmt)}
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse (line {e.lineno}: {e.message})") from e


def chat_ids(tokenizer, messages, add_generation_prompt: bool = True) -> list[int]:
    """The token ids of a conversation in `tokenizer`'s chat format (a Hugging Face folder's or a
    GGUF file's tokenizer): rendered (render_chat), then encoded as transformers'
    apply_chat_template(tokenize=True) encodes it, with nothing added (the template writes its own
    special tokens). A tokenizer without a template is a ValueError."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise ValueError(f"this model's tokenizer ({describe(tokenizer)}) has no chat template: give the "
                         f"text as a prompt instead")
    text = render_chat(template, messages, add_generation_prompt, **tokenizer.special_tokens)
    return tokenizer.encode(text, add_special_tokens=False)


def describe(tokenizer) -> str:
    path = getattr(tokenizer, "path", None)
    return str(path) if path is not None else f"{tokenizer.name}, trained here"
