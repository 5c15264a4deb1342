"""benchmarks/decode.py's guard (`--sections flags --before <checkout>`): the script each of its
processes runs against a checkout measures this one, on a tiny shape, in each precision the section
names (compiling left to the benchmark: seconds a shape). Its anatomy of a token (`--sections
anatomy`) times each part of a stream, and leaves the functions it wraps as they were."""

import contextlib
import io

import pytest
import torch

import model.generation as generation
from benchmarks.decode import FLAG_SETS, FLAG_STEPS, PARTS, parts_timed, sample_seconds
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
