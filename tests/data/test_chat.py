"""data/chat.py: a folder's chat template rendered as transformers' apply_chat_template renders it, its
special tokens and end-of-text ids read as transformers reads them, and one-line refusals."""

import json

import pytest

from data.chat import chat_ids, folder_chat_template, folder_eos_ids, render_chat
from data.tokenizer import HFTokenizer
from tests.helpers import shakespeare_tokenizer

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama 3's shape: bos_token, whitespace control, a namespace, loop controls, tojson, raise_exception.
LLAMA3 = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{% set ns.system = message['content'] %}{% continue %}{% endif %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('roles are user and assistant') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {%- if ns.system and loop.index0 == 1 %}{{ ns.system | tojson }}{% endif %}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief, café."}, {"role": "user", "content": "  Hi!  "}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "日本語 🎭?"}],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tokenizer folder with special tokens in tokenizer_config.json (one as {"content": ...})."""
    path = tmp_path_factory.mktemp("chat")
    (path / "tokenizer.json").write_text(shakespeare_tokenizer())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|endoftext|>", "special": True}, "eos_token": "<|endoftext|>"}))
    return path


def transformers_tokenizer(folder, template):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", chat_template=template)


@pytest.mark.parametrize("template", [CHATML, LLAMA3], ids=["chatml", "llama3"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_and_ids_are_transformers_apply_chat_template(folder, template, add_generation_prompt):
    (folder / "chat_template.jinja").write_text(template)
    ours, theirs = HFTokenizer(folder / "tokenizer.json"), transformers_tokenizer(folder, template)
    assert ours.chat_template == template and ours.special_tokens["bos_token"] == "<|endoftext|>"
    for messages in CONVERSATIONS:
        want = theirs.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
        assert render_chat(template, messages, add_generation_prompt, **ours.special_tokens) == want
        ids = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
        assert chat_ids(ours, messages, add_generation_prompt) == list(getattr(ids, "input_ids", ids))


def test_the_template_file_comes_first_then_tokenizer_configs_string_or_default_of_a_list(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert folder_chat_template(tmp_path)[0] == "D"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "S"}))
    assert folder_chat_template(tmp_path)[0] == "S"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert folder_chat_template(tmp_path)[0] == "J"
    assert folder_chat_template(tmp_path / "none") == (None, {})


@pytest.mark.parametrize("generation, config, ids", [
    ({"eos_token_id": [7, 3, 7]}, {"eos_token_id": 1}, (7, 3)), ({}, {"eos_token_id": 1}, (1,)),
    ({"eos_token_id": None}, {}, ()), (None, None, ()), ({"eos_token_id": [300, 5]}, {}, (5,))])
def test_end_of_text_ids_from_generation_config_else_config(tmp_path, generation, config, ids):
    for name, value in (("generation_config.json", generation), ("config.json", config)):
        if value is not None:
            (tmp_path / name).write_text(json.dumps(value))
    assert folder_eos_ids(tmp_path, 300) == ids


@pytest.mark.parametrize("bad", [-1, "2", [1, True], 2.0])
def test_an_end_of_text_id_that_is_not_a_token_id_is_refused_naming_the_file(tmp_path, bad):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": bad}))
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id must be token ids \(one or"):
        folder_eos_ids(tmp_path, 300)


@pytest.mark.parametrize("template, messages, message", [
    ("{% for m in messages %}{{ m.content }", CONVERSATIONS[0], r"does not parse \(line 1: "),
    (LLAMA3, [{"role": "tool", "content": "x"}], "refused this conversation: roles are user and assistant"),
    ("{{ messages.__class__.__mro__ }}", CONVERSATIONS[0], "refused this conversation: "),
    ("{{ messages.append(1) }}", CONVERSATIONS[0], "refused this conversation: "),
    ("{{ 1 / 0 }}", CONVERSATIONS[0], r"failed on this conversation \(ZeroDivisionError: "),
    ("{% for t in tools %}{% endfor %}", CONVERSATIONS[0], r"failed on this conversation \(TypeError: "),
    (CHATML, [], "messages must be a non-empty list"),
    (CHATML, [{"role": "user"}], "each message must be"),
])
def test_a_template_that_fails_is_one_line_and_the_sandbox_refuses_pythons_insides(template, messages,
                                                                                   message):
    with pytest.raises(ValueError, match=message) as e:
        render_chat(template, messages)
    assert "\n" not in str(e.value)


def test_generation_blocks_render_their_text_as_transformers_does(folder):
    template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}")
    messages = CONVERSATIONS[2]
    want = transformers_tokenizer(folder, template).apply_chat_template(messages, tokenize=False)
    assert render_chat(template, messages, False) == want == "Answer in French.HelloBonjour !日本語 🎭?"


def test_a_tokenizer_without_a_template_refuses_chat(folder, tmp_path):
    (tmp_path / "tokenizer.json").write_text(shakespeare_tokenizer())
    with pytest.raises(ValueError, match="has no chat template: give the text as a prompt instead"):
        chat_ids(HFTokenizer(tmp_path / "tokenizer.json"), CONVERSATIONS[0])
