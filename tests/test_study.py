"""benchmarks/attention_study.py: the whole study on a tiny preset, and its noise rule."""

import math

import pytest

from benchmarks.attention_study import beyond_noise, pareto_front, run_study
from data.prepare import TINYSHAKESPEARE_PATH
from tests.helpers import compose


def test_study_runs_end_to_end_on_a_tiny_preset(tiny_run, tmp_path):
    """On the first 40,000 characters of TinyShakespeare: each of the 13 runs ends with a loss
    over the whole val split, which for all of it would take most of the test's time."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINYSHAKESPEARE_PATH.read_text()[:40_000])
    overrides = [o for o in tiny_run if not o.startswith("experiment=")]
    cfg = compose(*overrides, "experiment=shakespeare_char_cpu", "data=text_files", f"data.path={corpus}",
                  "train.max_iters=4", "train.eval_interval=2", "study.uptrain_iters=2", "study.seeds=[0,1]",
                  "study.decode_context=32", "study.decode_batch_sizes=[1,4]", config_name="study")
    assert cfg.data.path == str(corpus)
    out = tmp_path / "study"
    rows = run_study(cfg, out)
    uptrained = "gqa uptrained from mha (2 steps)"
    assert list(rows) == ["mha", "gqa", "mqa", "mla", "mqa_cla2", "mha, window 8", uptrained,
                          "mha, int8 cache", "gqa, int8 cache", "mqa, int8 cache", "mla, int8 cache"]
    for name in ("study.md", "study.json", "val_loss.png", "val_vs_kv_bytes.png", "decode_by_batch.png"):
        assert (out / name).stat().st_size > 0, name
    for variant in ("mha", "mla"):
        assert all((out / variant / f"seed{s}" / "best.pt").is_file() for s in (0, 1))
    table = (out / "study.md").read_text()
    assert table.count("\n| ") == 12
    assert "| gqa | 2 layers x 2 (K, V) x 2 kv heads x 4 | 128 | 4,096 |" in table
    # KV bytes per token (tiny: 2 layers, 4 heads of 4, fp32): MHA 2·2·4·4·4; GQA half; MQA a
    # quarter; MQA + CLA2 an eighth; MLA 2 layers x (64 latent + 16 rope) x 4 bytes.
    kv = {v: rows[v]["kv_bytes_per_token"] for v in rows}
    assert kv["mha"] == 256 and (kv["gqa"], kv["mqa"], kv["mqa_cla2"]) == (128, 64, 32)
    assert kv["mla"] == 2 * (64 + 16) * 4
    # int8: a byte per number, and a float32 scale per position of each K and V head (MLA: per layer).
    assert kv["mha, int8 cache"] == 256 // 4 + 2 * 2 * 4 * 4 and kv["mla, int8 cache"] == 2 * (80 + 4)
    # Per sequence of block_size (32) positions; the window model's cache holds its 8.
    assert rows["mha"]["kv_bytes_per_sequence"] == 256 * 32
    assert rows["mha, window 8"]["kv_bytes_per_sequence"] == 256 * 8
    for variant in ("mha", "gqa", "mqa", "mla"):  # no retraining: the same runs, within 0.01 of float32
        r = rows[f"{variant}, int8 cache"]
        assert r["float32_cache_losses"] == pytest.approx(rows[variant]["val_losses"], abs=1e-4)
        assert r["val_losses"] == pytest.approx(r["float32_cache_losses"], abs=0.01)
        assert r["train_tokens_per_s"] is None and r["val_curve"] == []
    for r in (r for name, r in rows.items() if "int8" not in name):
        losses = r["val_losses"]
        assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)
        assert math.isclose(r["val_loss_mean"], sum(losses) / 2)
        assert math.isclose(r["val_loss_std"], abs(losses[0] - losses[1]) / math.sqrt(2))
        assert all(r["decode"][b] > 0 for b in (1, 4)) and r["train_tokens_per_s"] > 0
        assert [step for step, _ in r["val_curve"]] == ([0, 2, 4] if r is not rows[uptrained] else [0, 1, 2])
    # Same seed, same data: two seeds of one variant differ, one seed run twice would not.
    assert rows["mha"]["val_losses"][0] != rows["mha"]["val_losses"][1]


def test_every_variant_is_checked_before_the_first_trains(tiny_run, tmp_path):
    """mla refuses qk_norm: the study stops before mha, the first variant, trains."""
    cfg = compose(*tiny_run, "model.qk_norm=true", "study.variants=[mha,mla]", config_name="study")
    with pytest.raises(ValueError, match="qk_norm=true cannot be combined with multi-head latent attention"):
        run_study(cfg, tmp_path)
    assert not any(tmp_path.iterdir())


def row(mean, std, bytes_per_sequence=0):
    return {"val_loss_mean": mean, "val_loss_std": std, "val_losses": [mean - std, mean + std],
            "kv_bytes_per_sequence": bytes_per_sequence}


def test_a_difference_counts_only_beyond_the_seeds_spread():
    assert beyond_noise(row(1.80, 0.01), row(1.83, 0.01))
    assert not beyond_noise(row(1.80, 0.01), row(1.815, 0.01))
    one_seed = {"val_loss_mean": 1.0, "val_loss_std": 0.0, "val_losses": [1.0]}
    assert not beyond_noise(one_seed, row(2.0, 0.01))  # no spread measured: no claim


def test_pareto_front_keeps_the_rows_nothing_beats_on_both_axes():
    rows = {"big_good": row(1.80, 0.01, 4096), "small_bad": row(1.90, 0.01, 512),
            "dominated": row(1.95, 0.01, 1024), "middle": row(1.85, 0.01, 1280)}
    assert pareto_front(rows) == ["small_bad", "middle", "big_good"]


@pytest.mark.parametrize("overrides,message", [
    (["study.variants=[mha,mqa]", "study.window=[]"], "the mqa row would train a model with n_kv_head=4, "),
    (["study.variants=[mha]", "study.window=[mha]"], "the mha row would train a model with attn_window=None"),
    (["study.variants=[mha,mla]", "study.window=[]"], "the mla row would train a model with mla_latent_dim="),
], ids=["mqa", "window", "mla"])
def test_every_row_is_the_variant_it_names_or_the_study_is_refused(overrides, message, tiny_run, tiny_ckpt,
                                                                    tmp_path):
    """init_from gives a run its checkpoint's architecture: from an MHA run, every row would be that
    MHA model under another name. The study stops before any row trains; train.resume too."""
    cfg = compose(*tiny_run, f"init_from={tiny_ckpt}", *overrides, config_name="study")
    with pytest.raises(ValueError, match=rf"^study: {message}.*init_from={tiny_ckpt} gives every row"):
        run_study(cfg, tmp_path)
    cfg = compose(*tiny_run, f"train.resume={tiny_ckpt}", "study.variants=[mha]", config_name="study")
    with pytest.raises(ValueError, match="a study trains every row from scratch, each seed its own run"):
        run_study(cfg, tmp_path)
    assert not any(tmp_path.iterdir())
