"""benchmarks/attention_study.py: the whole study on a tiny preset."""

from benchmarks.attention_study import run_study
from tests.helpers import compose


def test_study_runs_end_to_end_on_a_tiny_preset(tiny_run, tmp_path):
    overrides = [o for o in tiny_run if not o.startswith("experiment=")]
    cfg = compose(*overrides, "train.max_iters=4", "train.eval_interval=2", "study.uptrain_iters=2",
                  "study.decode_batch_sizes=[1,4]", config_name="study")
    rows = run_study(cfg, tmp_path)
    assert list(rows) == ["mha", "gqa", "mqa", "gqa uptrained from mha (2 steps)"]
    assert rows["gqa uptrained from mha (2 steps)"]["n_kv_head"] == 2
    for name in ("study.md", "study.json", "val_loss.png", "val_vs_kv_bytes.png", "decode_by_batch.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    table = (tmp_path / "study.md").read_text()
    assert table.count("\n") == 6 and "| gqa | 2 |" in table
    # KV bytes per token = 2 · n_layer · n_kv_head · head_dim · 4 bytes: MHA : GQA : MQA = 4 : 2 : 1
    mha, gqa, mqa = (rows[v]["kv_bytes_per_token"] for v in ("mha", "gqa", "mqa"))
    assert mha == 2 * 2 * 4 * 4 * 4 and (mha, gqa) == (4 * mqa, 2 * mqa)
    assert rows["mha"]["params"] > rows["gqa"]["params"] > rows["mqa"]["params"]
    assert all(r["decode"][4] > 0 and r["train_tokens_per_s"] > 0 for r in rows.values())
    assert all(len(rows[v]["val_curve"]) == 3 for v in ("mha", "gqa", "mqa"))
