"""model/quantize.py: an Int8Linear multiplies by its own int8 weight times its scales at every
layer shape (PyTorch's CPU kernel alone reads past or faults at input widths that are not a
multiple of its vector width), and quantized models decode to the logits of their dequantized
weights in every mode generate.py offers."""

import copy
import itertools

import pytest
import torch
import torch.nn as nn

from model import GPT, GPTConfig, checkpoint, generate
from model.checkpoint import Checkpoint
from model.decode_step import CompiledDecodeStep
from model.device import Precision
from model.generation import Decoding, stream
from model.loading import load_model
from model.quantize import Int8Linear, quantize_int8
from model.sampling import Sampling
from tests.helpers import main_job_config, tiny_model

# Input widths: multiples of 16 (as is), of 8 only (the AVX512 kernel fails, AVX2's does not), and
# neither (every CPU fails); 344 is SwiGLU's hidden width at n_embd=128.
WIDTHS = [1, 8, 15, 16, 17, 31, 33, 40, 127, 128, 344]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative: bf16 keeps 8 bits


def rel_error(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def dequantized_copy(model: GPT) -> GPT:
    """A float copy of a quantized model: nn.Linear layers holding int8 weight x scale, in fp32."""
    model = copy.deepcopy(model).float()
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, Int8Linear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                linear.weight.data = child.dequantized()
                if child.bias is not None:
                    linear.bias.data = child.bias.float()
                setattr(module, name, linear)
    return model


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_linear_matches_its_dequantized_weight_at_every_width(dtype, bias):
    torch.manual_seed(0)
    for in_features, out_features in itertools.product(WIDTHS, [1, 3, 65]):
        layer = Int8Linear(nn.Linear(in_features, out_features, bias=bias)).to(dtype)
        assert (layer.in_features, layer.out_features) == (in_features, out_features)
        assert layer.weight.dtype == torch.int8 and layer.weight.size(1) % 16 == 0
        assert not layer.weight[:, in_features:].any()  # the padding is zeros
        for lead in [(1,), (2,), (7,), (2, 32)]:  # rows: one token, a few, a prefill (B, T)
            x = torch.randn(*lead, in_features).to(dtype)
            want = x.float() @ layer.dequantized().t() + (layer.bias.float() if bias else 0)
            got = layer(x)
            assert got.shape == (*lead, out_features) and got.dtype == dtype
            assert got.isfinite().all(), (in_features, out_features, lead)
            assert rel_error(got, want) < TOLERANCE[dtype], (in_features, out_features, lead)


def test_int8_linear_takes_views_the_kernel_would_fault_on():
    """Slices starting inside a row (misaligned for the kernel's aligned loads) and strided rows."""
    torch.manual_seed(0)
    for in_features in (16, 32, 40):
        layer = Int8Linear(nn.Linear(in_features, 5)).to(torch.bfloat16)
        wide = torch.randn(3, 1, in_features + 11).bfloat16()
        for x in (wide[:1, :, 3:3 + in_features], wide[:, :, 5:5 + in_features]):
            want = x.float() @ layer.dequantized().t() + layer.bias.float()
            assert rel_error(layer(x), want) < TOLERANCE[torch.bfloat16]


def test_dtype_casts_leave_the_int8_weight_and_state_dicts_round_trip():
    model = quantize_int8(tiny_model(n_embd=36, mlp="swiglu"))  # widths 36 (padded) and 96
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    for layer in (m for m in bf16.modules() if isinstance(m, Int8Linear)):
        assert layer.weight.dtype == torch.int8 and layer.scales.dtype == torch.bfloat16
    assert torch.equal(bf16.lm_head.weight, model.lm_head.weight)
    fresh = quantize_int8(tiny_model(seed=1, n_embd=36, mlp="swiglu")).to(torch.bfloat16)
    fresh.load_state_dict(bf16.state_dict())
    idx = torch.randint(0, 37, (2, 9))
    assert torch.equal(fresh(idx), bf16(idx))
    assert "in_features=36, out_features=37" in repr(model.lm_head)


@pytest.mark.parametrize("config", [
    main_job_config(),
    # GELU, learned positions, biases, GQA, and widths 36 (not a multiple of 8) and 37
    GPTConfig(vocab_size=37, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=36),
    # MLA (its up-projection stays in the activations' dtype) with layers sharing K/V
    main_job_config(mla_latent_dim=24, mla_rope_dim=8, kv_share=2),
], ids=["main_job_swiglu", "gelu_36_wide", "mla_cla2"])
def test_quantized_models_give_the_logits_of_their_dequantized_weights(config):
    torch.manual_seed(0)
    original = GPT(config).eval()
    model = quantize_int8(copy.deepcopy(original))
    linears = sum(isinstance(m, nn.Linear) for m in original.modules())
    assert linears >= 4 * config.n_layer
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == linears
    idx = torch.randint(0, config.vocab_size, (2, 12))
    want = dequantized_copy(model)(idx)
    assert rel_error(want, original(idx)) < 0.02  # what rounding the weights to int8 costs
    for dtype in (torch.float32, torch.bfloat16):
        got = copy.deepcopy(model).to(dtype)(idx)
        assert got.isfinite().all() and rel_error(got, want) < TOLERANCE[dtype], dtype
    bf16 = model.to(torch.bfloat16)
    assert bf16.new_kv_cache(1).dtype == torch.bfloat16  # the cache follows the activations
    for kv_cache in (True, False):
        out = generate(bf16, idx, 8, temperature=0, kv_cache=kv_cache)
        assert out.shape == (2, 20) and ((0 <= out) & (out < config.vocab_size)).all()


@torch.no_grad()  # as stream: the compiled step was traced without autograd
def logits_along(model, tokens, T, kv_cache, decode_step):
    """Logits (B, L - T, vocab) for tokens[:, T:] of tokens (B, L), each from the tokens before
    it, computed the way stream does in that mode: all at once uncached, else a prefill and
    one-token steps into a cache (a compiled step's own static one)."""
    if not kv_cache:
        return model(tokens[:, :-1])[:, T - 1:]
    # the cache holds every token but the last, which is not fed
    cache = decode_step.cache if decode_step else model.new_kv_cache(tokens.size(0), tokens.size(1) - 1)
    cache.reset()
    logits = [model(tokens[:, :T], kv_cache=cache)[:, -1]]                 # (B, vocab)
    for i in range(T, tokens.size(1) - 1):
        token = tokens[:, i:i + 1]                                          # (B, 1)
        step = decode_step(token, cache, None) if decode_step else model(token, kv_cache=cache)[:, -1]
        logits.append(step)
    return torch.stack(logits, dim=1)                                       # (B, L - T, vocab)


# The compiled step in the exact precision and in the CPU's default for large models: the other two
# are the same graph code in another dtype, and each compile costs seconds.
COMPILED = {("float32", None), ("bfloat16", "int8")}


def test_every_decode_mode_gives_the_reference_logits_and_valid_tokens(tmp_path, int8_package, capfd):
    """dtype x quantize x compile x kv_cache, the model loaded as generate.py loads it. One layer
    of the main job's model: every layer shape of it, and two compiles (COMPILED); the compiled
    int8-weights step keeps its cache in int8 too (inductor's code for reading an int8 cache). A
    block of 14: the last of the 10 new tokens after 5 is computed over the whole cache, which the
    compiled step's graph reads as it reads any number of cells. Inductor's cache stores the float
    step (nothing in it makes it bypass the cache); the int8 step, its weights frozen in, is a
    package on disk (model.step_package) that a later step of the same model loads, compiling nothing."""
    from torch._dynamo.utils import counters

    bypassed = counters["inductor"]["fxgraph_cache_bypass"], counters["aot_autograd"]["autograd_cache_bypass"]
    config = main_job_config(n_layer=1, block_size=14)
    torch.manual_seed(0)
    checkpoint.save(tmp_path / "best.pt", Checkpoint(model=GPT(config).state_dict(), model_config=config,
                                                     data_meta={"tokenizer": "char", "vocab": None}))
    references = {None: load_model(tmp_path, "cpu", Precision("float32", None))[0],
                  "int8": dequantized_copy(load_model(tmp_path, "cpu", Precision("float32", "int8"))[0])}
    idx = torch.randint(0, 65, (2, 5))
    for dtype, quantize, compile, kv_cache in itertools.product(
            ["float32", "bfloat16"], [None, "int8"], [False, True], [True, False]):
        if compile and (not kv_cache or (dtype, quantize) not in COMPILED):
            continue
        mode = f"dtype={dtype} quantize={quantize} compile={compile} kv_cache={kv_cache}"
        model, _ = load_model(tmp_path, "cpu", Precision(dtype, quantize))
        kv_dtype = torch.int8 if compile and quantize == "int8" else None
        decode_step = CompiledDecodeStep(model, len(idx), kv_dtype=kv_dtype) if compile and kv_cache else None
        greedy = Sampling(10, temperature=0)
        new = list(stream(model, idx, greedy, Decoding(kv_cache, kv_dtype, decode_step=decode_step)))
        tokens = torch.cat([idx, torch.stack(new, dim=1)], dim=1)           # (2, 15)
        assert ((0 <= tokens) & (tokens < 65)).all(), mode
        got = logits_along(model, tokens, 5, kv_cache, decode_step)
        want = references[quantize](tokens[:, :-1])[:, 4:]
        assert got.isfinite().all(), mode
        assert rel_error(got, want) < TOLERANCE[getattr(torch, dtype)], mode
    assert counters["inductor"]["fxgraph_cache_bypass"] == bypassed[0]
    assert counters["aot_autograd"]["autograd_cache_bypass"] == bypassed[1]
    folder, package, key = int8_package  # (the int8 step is this model's: built once for the session)
    assert list(folder.glob(f"{key}.*")) == [package] and "compiling" not in capfd.readouterr().err
    again = CompiledDecodeStep(model, len(idx), kv_dtype=torch.int8)
    loaded, eager = (list(stream(model, idx, Sampling(10, temperature=0),
                                 Decoding(kv_dtype=torch.int8, decode_step=d))) for d in (again, None))
    assert torch.equal(torch.stack(loaded), torch.stack(eager))
