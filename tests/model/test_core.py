"""model/core/: the files the README's "Reading the code" lists stand alone (copied into an empty
folder with only torch, they train MHA, GQA and MQA GPTs and sample the same tokens with and without
the cache), stay within 800 lines, and every variant of the full package attends through their
`attend`: model.GPT and its layers are the core's classes, extended."""

import ast
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import model
import model.core.attention as core_attention
import model.core.gpt as core_gpt
from model.attention import CausalSelfAttention
from model.kernels import attend_one_query
from model.latent import LatentAttention
from tests.helpers import ROOT, clean_env, tiny_model

CORE_LINES = 800


def reading_the_code() -> list[str]:
    """The files the README's "Reading the code" section lists, in its order."""
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Reading the code\n(.*?)(?=^## )", readme, flags=re.S | re.M)
    assert section, "the README has a section 'Reading the code'"
    return list(dict.fromkeys(re.findall(r"`(model/core/\w+\.py)`", section.group(1))))


def test_the_reading_path_is_the_core_within_800_lines_importing_only_torch_and_itself():
    files = reading_the_code()
    names = ("config", "attention", "kv_cache", "gpt", "generate")
    assert files == [f"model/core/{name}.py" for name in names]
    lines = [line for f in files for line in (ROOT / f).read_text().splitlines()]
    assert len(lines) <= CORE_LINES, f"the core is {len(lines)} lines"
    assert max(map(len, lines)) <= 110
    for f in [*files, "model/core/__init__.py"]:
        for node in ast.walk(ast.parse((ROOT / f).read_text())):
            if (isinstance(node, ast.ImportFrom) and node.level == 0) or isinstance(node, ast.Import):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                roots = {name.split(".")[0] for name in names}
                assert roots <= {"torch", *sys.stdlib_module_names}, f"{f} imports {roots}"


STANDALONE = textwrap.dedent("""
    import sys
    import torch
    from core.config import GPTConfig
    from core.generate import generate
    from core.gpt import GPT

    torch.set_num_threads(1)
    for n_kv_head in (4, 2, 1):                                  # MHA, GQA, MQA
        for pos_emb in ("learned", "rope"):
            torch.manual_seed(0)
            config = GPTConfig(vocab_size=40, block_size=24, n_layer=2, n_head=4, n_kv_head=n_kv_head,
                               n_embd=32, pos_emb=pos_emb)
            gpt = GPT(config)
            optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-2)
            data = torch.arange(400) % 7 * 5 % 40                # a pattern to learn
            losses = []
            for step in range(8):
                x = torch.stack([data[i:i + 16] for i in range(step, step + 4)])
                y = torch.stack([data[i + 1:i + 17] for i in range(step, step + 4)])
                _, loss = gpt(x, y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            assert losses[-1] < losses[0], losses
            gpt.eval()
            prompt = data[None, :5].repeat(2, 1)
            for options in ({"temperature": 0}, {"temperature": 0.9, "top_k": 20, "top_p": 0.95}):
                out = [generate(gpt, prompt, 19, kv_cache=cached, **options,
                                generator=torch.Generator().manual_seed(1)) for cached in (True, False)]
                assert out[0].shape == (2, 24) and torch.equal(out[0], out[1]), (n_kv_head, pos_emb, options)
    assert not [name for name in sys.modules if name == "model" or name.startswith("model.")]
    print("ok", flush=True)
""")


def test_the_core_copied_alone_trains_and_samples_the_same_tokens_with_and_without_the_cache(tmp_path):
    (tmp_path / "core").mkdir()
    for f in [*reading_the_code(), "model/core/__init__.py"]:
        (tmp_path / "core" / f.split("/")[-1]).write_text((ROOT / f).read_text())
    (tmp_path / "standalone.py").write_text(STANDALONE)
    env = clean_env()
    env.pop("PYTHONPATH")  # nothing of this tree importable but the copies
    run = subprocess.run([sys.executable, "standalone.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


VARIANT_OVERRIDES = {
    "mha": {}, "gqa": {"n_kv_head": 2}, "mqa": {"n_kv_head": 1},
    "mla": {"mla_latent_dim": 16, "mla_rope_dim": 4, "pos_emb": "rope"},
    "window_sinks": {"attn_window": 4, "attn_sinks": 2, "pos_emb": "rope"},
    "sink_logit": {"attn_sink_logit": True},
    "kv_share": {"kv_share": 2},
}


def core_attend_calls(run) -> list:
    """The code objects that called the core `attend` while `run()` ran, one per call."""
    callers = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is core_attention.attend.__code__:
            callers.append(frame.f_back.f_code)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return callers


@pytest.mark.parametrize("variant", VARIANT_OVERRIDES)
def test_every_variant_attends_through_the_core_attend(variant):
    gpt = tiny_model(**VARIANT_OVERRIDES[variant]).eval()
    layer_attend = (LatentAttention if variant == "mla" else CausalSelfAttention).attend.__code__
    idx = torch.randint(0, gpt.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    for kv_dtype in (None, "int8"):
        cache = gpt.new_kv_cache(2, 12, dtype=kv_dtype)
        with torch.no_grad():
            prefill = core_attend_calls(lambda c=cache: gpt(idx, kv_cache=c))
            step = core_attend_calls(lambda c=cache: gpt(idx[:, :1], kv_cache=c))  # one token
            uncached = core_attend_calls(lambda: gpt(idx))
        for callers in (prefill, step, uncached):
            assert callers.count(layer_attend) == gpt.config.n_layer, (variant, kv_dtype, callers)


def test_an_int8_caches_one_token_step_runs_its_kernel_inside_the_core_attend():
    gpt = tiny_model().eval()
    cache = gpt.new_kv_cache(1, 8, dtype="int8")
    kernel_calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is attend_one_query.__code__:
            kernel_calls.append(frame.f_back.f_back.f_code)  # attend_quantized, called by the kernel hook

    with torch.no_grad():
        gpt(torch.zeros(1, 3, dtype=torch.long), kv_cache=cache)
        sys.setprofile(profile)
        try:
            gpt(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache)
        finally:
            sys.setprofile(None)
    assert len(kernel_calls) == gpt.config.n_layer


def test_the_full_package_extends_the_core_classes():
    assert issubclass(model.GPT, core_gpt.GPT) and issubclass(model.GPTConfig, model.core.config.GPTConfig)
    assert issubclass(CausalSelfAttention, core_attention.CausalSelfAttention)
    assert issubclass(LatentAttention, core_attention.CausalSelfAttention)
    assert model.attend is core_attention.attend


def test_the_core_attend_takes_a_float_mask_beside_the_causal_band_and_names_a_bad_backend():
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    allowed = torch.rand(3, 5) > 0.3
    allowed[:, 0] = True                                                 # (no row empty)
    bias = torch.zeros(3, 5).masked_fill(~allowed, float("-inf"))
    for backend in ("sdpa", "naive"):
        torch.testing.assert_close(core_attention.attend(q, k, v, bias, backend=backend),
                                   core_attention.attend(q, k, v, allowed, backend=backend))
    with pytest.raises(ValueError, match="backend 'flash'"):
        core_attention.attend(q, k, v, backend="flash")
