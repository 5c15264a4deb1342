"""benchmarks/decode.py's guard (`--sections flags --before <checkout>`): the script each of its
processes runs against a checkout measures this one, on a tiny shape, in each precision the section
names (compiling left to the benchmark: seconds a shape)."""

import contextlib
import io

import pytest

from benchmarks.decode import FLAG_SETS, FLAG_STEPS
from tests.helpers import ROOT


@pytest.mark.parametrize("flags", FLAG_SETS)
def test_the_flags_guard_measures_a_checkout(flags):
    dtype, quantize, _ = FLAG_SETS[flags]
    script = FLAG_STEPS.format(code=str(ROOT), shape=dict(block_size=16, n_layer=1, n_head=2, n_embd=32),
                               dtype=dtype, quantize=quantize, compiled=False, batch=2, new=6)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(script, {})
    assert float(printed.getvalue()) > 0  # tokens/s, as the section reads them
