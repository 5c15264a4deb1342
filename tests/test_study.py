"""benchmarks/attention_study.py: the whole study on a tiny preset, and its noise rule."""

import json
import math

import pytest

from benchmarks.attention_study import StudyConfig, beyond_noise, pareto_front, run_study
from data.prepare import TINYSHAKESPEARE_PATH
from tests.helpers import compose


def test_study_runs_end_to_end_on_a_tiny_preset(tiny_run, tmp_path):
    """On the first 40,000 characters of TinyShakespeare, with RoPE as the CPU study: each of the 17
    runs ends with a loss over the whole val split, which for all of it would take most of the
    test's time; then the loss by position over val sequences of 4 blocks."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINYSHAKESPEARE_PATH.read_text()[:40_000])
    overrides = [o for o in tiny_run if not o.startswith("experiment=")]
    cfg = compose(*overrides, "experiment=shakespeare_char_cpu", "data=text_files", f"data.path={corpus}",
                  "model.pos_emb=rope", "train.max_iters=4", "train.eval_interval=2", "study.uptrain_iters=2",
                  "study.seeds=[0,1]", "study.decode_context=32", "study.decode_batch_sizes=[1,4]",
                  config_name="study")
    assert cfg.data.path == str(corpus)
    out = tmp_path / "study"
    rows = run_study(cfg, out)
    uptrained = "gqa uptrained from mha (2 steps)"
    windowed = ["mha, window 8", "mha, window 8 / global (SL)", "mha, window 8 + 4 sinks"]
    assert list(rows) == ["mha", "gqa", "mqa", "mla", "mqa_cla2", *windowed, uptrained,
                          "mha, int8 cache", "gqa, int8 cache", "mqa, int8 cache", "mla, int8 cache"]
    for name in ("study.md", "study.json", "val_loss.png", "val_vs_kv_bytes.png", "decode_by_batch.png",
                 "loss_by_position.json", "loss_by_position.png"):
        assert (out / name).stat().st_size > 0, name
    for variant in ("mha", "mla", "mha_window_global", "mha_window_sinks"):
        assert all((out / variant / f"seed{s}" / "best.pt").is_file() for s in (0, 1))
    table, positions = (out / "study.md").read_text().split("\nLoss by position")
    assert table.count("\n| ") == 14
    assert "| gqa | 2 layers x 2 (K, V) x 2 kv heads x 4 | 128 | 4,096 |" in table
    # KV bytes per token (tiny: 2 layers, 4 heads of 4, fp32): MHA 2·2·4·4·4; GQA half; MQA a
    # quarter; MQA + CLA2 an eighth; MLA 2 layers x (64 latent + 16 rope) x 4 bytes.
    kv = {v: rows[v]["kv_bytes_per_token"] for v in rows}
    assert kv["mha"] == 256 and (kv["gqa"], kv["mqa"], kv["mqa_cla2"]) == (128, 64, 32)
    assert kv["mla"] == 2 * (64 + 16) * 4
    # int8: a byte per number, and a float32 scale per position of each K and V head (MLA: per layer).
    assert kv["mha, int8 cache"] == 256 // 4 + 2 * 2 * 4 * 4 and kv["mla, int8 cache"] == 2 * (80 + 4)
    # Per sequence of block_size (32) positions: the window model's cache holds its 8; with SL, layer
    # 0 its 8 and layer 1 all 32 (128 bytes a layer per position); with sinks, 8 + 4 in both layers.
    assert rows["mha"]["kv_bytes_per_sequence"] == 256 * 32
    assert rows["mha, window 8"]["kv_bytes_per_sequence"] == 256 * 8
    assert rows["mha, window 8 / global (SL)"]["kv_bytes_per_sequence"] == 128 * (8 + 32)
    assert rows["mha, window 8 + 4 sinks"]["kv_bytes_per_sequence"] == 256 * (8 + 4)
    assert (rows[windowed[1]]["window_pattern"], rows[windowed[2]]["attn_sinks"]) == ("SL", 4)
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
    check_loss_by_position(json.loads((out / "loss_by_position.json").read_text()), positions)


def check_loss_by_position(result: dict, table: str):
    """Sequences of 4 blocks (128), one every block (32) of a val split of ~4,000 tokens; buckets of 8
    positions. A model with a global layer stops at block_size; the windowed ones go the whole way.
    Within the first window (bucket 0) a window or sinks changed at inference change nothing: the
    same weights see the same keys."""
    assert (result["length"], result["stride"], result["bucket"]) == (128, 32, 8)
    assert 110 <= result["sequences"] <= 130
    curves = result["curves"]
    sinks, without = "mha, window 8 + 4 sinks", "mha, window 8 + 4 sinks, run without them"
    streaming = ["mha weights, run with window 8", "mha weights, run with window 8 + 4 sinks"]
    assert list(curves) == ["mha", "mha, window 8", "mha, window 8 / global (SL)", sinks, without, *streaming]
    for label, c in curves.items():
        endless = label in ("mha, window 8", sinks, without, *streaming)
        assert c["positions"] == (128 if endless else 32)
        assert c["trained"] == (label not in (without, *streaming))
        assert len(c["loss_mean"]) == len(c["loss_std"]) == len(c["bucket_centres"]) == c["positions"] // 8
        means = c["loss_mean"] + [m for m, _ in c["ranges"].values()]
        assert all(math.isfinite(x) and 0 < x < 10 for x in means)
        assert list(c["ranges"]) == ["0-7", "8-31", "32-63", "64-95", "96-127"][:5 if endless else 2]
        assert f"| {label} | " in table
    for label, same_weights in (*((s, "mha") for s in streaming), (without, sinks)):
        assert curves[label]["loss_mean"][0] == pytest.approx(curves[same_weights]["loss_mean"][0], abs=1e-5)
        assert curves[label]["loss_mean"][1] != pytest.approx(curves[same_weights]["loss_mean"][1], abs=1e-6)
    assert table.count("| — | — | — |") == 2  # the full and the local/global models, past block_size


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


@pytest.mark.parametrize("kwargs,message", [
    ({"local_global": ["alibi"]}, "study.local_global: alibi is not an option of the attention group"),
    ({"sinks": ["nope"]}, "study.sinks: nope is not an option of the attention group"),
    ({"window_pattern": "SSSS"}, "study.window_pattern must be letters S .* and L .*, both, .* got 'SSSS'"),
    ({"window_pattern": "SLX"}, "study.window_pattern must be letters S"),
    ({"sink_count": 0}, "study.sink_count must be >= 1, got 0"),
    ({"position_bucket": 0}, "study.position_bucket must be >= 1, got 0"),
    ({"position_blocks": -1}, "study.position_blocks must be >= 0 .0: no loss by position., got -1"),
], ids=["local_global", "sinks", "pattern_all_S", "pattern_letter", "sink_count", "bucket", "blocks"])
def test_the_new_study_options_name_themselves_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=rf"^{message}") as error:
        StudyConfig(**kwargs)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("overrides,message", [
    (["study.window_pattern=SSSL"], r"study.window_pattern='SSSL' must be 1..n_layer=2 letters S"),
    (["study.position_blocks=5000"], r"study.position_blocks=5000: a sequence of 160000 tokens needs a val "
                                     r"split of 160001 tokens or more, this one has \d+"),
    (["study.window_size=20", "study.decode_context=16"],  # decode speed is measured once a row has trained
     r"model.attn_window=20 must be <= study.decode_context=16"),
], ids=["pattern_longer_than_the_model", "sequences_longer_than_the_val_split",
        "window_past_the_decode_context"])
def test_what_the_model_and_data_refuse_names_the_study_option_before_any_row_trains(
        overrides, message, tiny_run, tmp_path):
    cfg = compose(*tiny_run, "study.variants=[mha]", *overrides, config_name="study")
    with pytest.raises(ValueError, match=rf"^{message}") as error:
        run_study(cfg, tmp_path)
    assert "\n" not in str(error.value)
    assert not any(tmp_path.iterdir())
