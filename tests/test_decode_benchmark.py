"""benchmarks/decode.py's guard (`--sections flags --before <checkout>`): the script each of its
processes runs against a checkout measures this one, on a tiny shape, in each precision the section
names (compiling left to the benchmark: seconds a shape). Its anatomy of a token (`--sections
anatomy`) times each part of a stream, and leaves the functions it wraps as they were. What RMSNorm
costs (`--sections norm`) steps a copy whose norms are each one LayerNorm kernel, the model untouched."""

import contextlib
import io

import pytest
import torch
import torch.nn as nn

import model.generation as generation
from benchmarks.decode import (
    FLAG_SETS,
    FLAG_STEPS,
    PARTS,
    fused_norm_stand_in,
    norm_cost,
    parts_timed,
    sample_seconds,
)
from model.decode_step import CompiledDecodeStep
from tests.helpers import ROOT, tiny_model


@pytest.mark.parametrize("flags", FLAG_SETS)
def test_the_flags_guard_measures_a_checkout(flags):
    dtype, quantize, _ = FLAG_SETS[flags]
    script = FLAG_STEPS.format(code=str(ROOT), shape=dict(block_size=16, n_layer=1, n_head=2, n_embd=32),
                               dtype=dtype, quantize=quantize, compiled=False, batch=2, new=6)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(script, {})
    assert float(printed.getvalue()) > 0  # tokens/s, as the section reads them


def test_the_anatomy_times_every_part_of_a_refilling_stream_and_puts_them_back():
    model = tiny_model(block_size=8, pos_emb="rope")  # 20 new tokens: refills
    wrapped = [generation.sample_next, generation.make_room, generation.prefill, CompiledDecodeStep.__call__]
    spent = dict.fromkeys(PARTS, 0.0)
    with parts_timed(spent, model):
        total = sample_seconds(model, torch.tensor([[1, 2]]), 20)
    assert all(spent[part] > 0 for part in PARTS) and sum(spent.values()) < total, spent
    assert [generation.sample_next, generation.make_room, generation.prefill,
            CompiledDecodeStep.__call__] == wrapped and "forward" not in vars(model)


def test_the_norm_stand_in_is_rmsnorms_shape_in_one_kernel_and_leaves_the_model_as_it_was():
    model = tiny_model(norm="rmsnorm", pos_emb="rope", block_size=8)
    for norm in model.modules():  # weights off their init of ones, so a stand-in must take them
        if isinstance(norm, nn.RMSNorm):
            norm.weight.data.normal_()
    stand_in = fused_norm_stand_in(model)
    pairs = [(a, b) for a, b in zip(model.modules(), stand_in.modules()) if isinstance(a, nn.RMSNorm)]
    assert len(pairs) == 2 * 2 + 1 and all(type(b) is nn.LayerNorm and b.bias is None for _, b in pairs)
    x = torch.randn(3, 16)
    x = x - x.mean(dim=-1, keepdim=True)  # with mean 0, LayerNorm is RMSNorm: same width, eps and weight
    for rms, fused in pairs:
        torch.testing.assert_close(fused(x), rms(x))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        norm_cost(model, rounds=2)
        norm_cost(tiny_model(block_size=8), rounds=2)  # LayerNorm: nothing to measure
    out = printed.getvalue()
    assert "5 calls a token" in out and "| nn.RMSNorm, as the model runs |" in out and "x** (quartiles" in out
    assert "this model has no RMSNorm" in out
    assert sum(isinstance(m, nn.RMSNorm) for m in model.modules()) == 5
