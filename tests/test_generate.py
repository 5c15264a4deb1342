import pytest
import torch

from model import GPT, GPTConfig
from model.gpt import sample_next
from tests.conftest import compose, run_script
from train import train

VARIANTS = {"mha": 4, "gqa": 2, "mqa": 1}


def tiny_model(n_kv_head=4, pos_emb="learned", block_size=24, seed=0) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=37, block_size=block_size, n_layer=2, n_head=4,
                       n_kv_head=n_kv_head, n_embd=16, pos_emb=pos_emb)
    return GPT(config).eval()


@pytest.mark.parametrize("n_kv_head", VARIANTS.values(), ids=VARIANTS.keys())
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_greedy_cache_equals_no_cache(n_kv_head, pos_emb):
    model = tiny_model(n_kv_head, pos_emb)
    idx = torch.randint(0, 37, (3, 6))
    cached = model.generate(idx, 18, temperature=0, kv_cache=True)   # 24 = block_size
    uncached = model.generate(idx, 18, temperature=0, kv_cache=False)
    assert cached.shape == (3, 24) and torch.equal(cached, uncached)
    assert torch.equal(cached[:, :6], idx)


@pytest.mark.parametrize("n_kv_head", VARIANTS.values(), ids=VARIANTS.keys())
def test_seeded_sampling_cache_equals_no_cache(n_kv_head):
    model = tiny_model(n_kv_head)
    idx = torch.randint(0, 37, (2, 4))
    runs = [model.generate(idx, 20, temperature=1.0, top_k=20, top_p=0.9, kv_cache=kv,
                           generator=torch.Generator().manual_seed(5)) for kv in (True, False)]
    assert torch.equal(*runs)
    other = model.generate(idx, 20, generator=torch.Generator().manual_seed(6))
    assert not torch.equal(runs[0], other)


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("kv_cache", [True, False])
def test_generation_goes_past_block_size(pos_emb, kv_cache):
    model = tiny_model(pos_emb=pos_emb, block_size=8)
    out = model.generate(torch.randint(0, 37, (2, 5)), 30, temperature=0, kv_cache=kv_cache)
    assert out.shape == (2, 35)
    # within block_size both paths agree; after it each keeps its documented scheme
    ref = model.generate(out[:, :5], 3, temperature=0, kv_cache=not kv_cache)
    assert torch.equal(out[:, :8], ref)


def test_cached_path_past_block_size_refills_from_recent_tokens():
    """When the cache is full, the next logits come from the last block_size // 2 tokens."""
    model = tiny_model(block_size=8)
    idx = torch.randint(0, 37, (1, 8))
    out = model.generate(idx, 2, temperature=0, kv_cache=True)
    expected = model(out[:, 5:9])[:, -1].argmax(-1)  # 4 = 8 // 2 most recent tokens
    assert out[0, 9] == expected[0]


@pytest.mark.parametrize("kv_cache", [True, False])
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_batched_mixed_lengths_equal_one_by_one(kv_cache, pos_emb):
    model = tiny_model(n_kv_head=2, pos_emb=pos_emb)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    batched = model.generate(prompts, 12, temperature=0, kv_cache=kv_cache)
    for prompt, row in zip(prompts, batched):
        alone = model.generate(torch.tensor([prompt]), 12, temperature=0, kv_cache=kv_cache)[0]
        assert torch.equal(row, alone)


def test_top_k_one_is_greedy():
    logits = torch.randn(5, 37)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(logits, 1.0, top_k=1, generator=g), logits.argmax(-1))


def test_tiny_temperature_is_greedy():
    logits = torch.randn(5, 37)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(logits, 1e-6, generator=g), logits.argmax(-1))
    model = tiny_model()
    idx = torch.randint(0, 37, (2, 4))
    assert torch.equal(model.generate(idx, 10, temperature=1e-6, generator=g),
                       model.generate(idx, 10, temperature=0))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    g = torch.Generator().manual_seed(0)
    draws = lambda p: {sample_next(logits, 1.0, top_p=p, generator=g).item() for _ in range(300)}
    assert draws(0.5) == {0}          # 0.5 alone reaches 0.5
    assert draws(0.8) == {0, 1}       # 0.5 + 0.3 reaches 0.8
    assert draws(0.81) == {0, 1, 2}
    assert draws(1.0) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, 1.0, top_p=0)


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_run, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gen_run")
    train(compose(*tiny_run, "train.max_iters=30", "train.eval_interval=15"), run_dir)
    return run_dir


def generate_cli(*args):
    return run_script("generate.py", *args)


def test_cli_streams_one_sample(tiny_ckpt):
    result = generate_cli(f"ckpt={tiny_ckpt}", "prompt=ROMEO:", "max_new_tokens=40")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ROMEO:") and len(result.stdout) >= 46


def test_cli_cache_and_no_cache_agree(tiny_ckpt):
    outs = [generate_cli(f"ckpt={tiny_ckpt}", "prompt=ROMEO:", "max_new_tokens=20", "seed=3",
                         f"kv_cache={kv}").stdout for kv in ("true", "false")]
    assert outs[0] == outs[1] and outs[0]


def test_cli_prompt_file_and_samples(tiny_ckpt, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ROMEO:\nJULIET: O\n")
    result = generate_cli(f"ckpt={tiny_ckpt}", f"prompt_file={prompts}", "num_samples=2",
                          "max_new_tokens=15", "temperature=0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("==== sample ") == 4
    assert "sample 4/4 ====================\nJULIET: O" in result.stdout


def test_cli_stop_string(tiny_ckpt):
    result = generate_cli(f"ckpt={tiny_ckpt}", "prompt=a", "max_new_tokens=200", "stop=e",
                          "temperature=1.0", "top_k=null")
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n").endswith("e") and result.stdout.count("e") == 1


def test_cli_benchmark_and_attention_plot(tiny_ckpt, tmp_path):
    png = tmp_path / "attn.png"
    result = generate_cli(f"ckpt={tiny_ckpt}", "benchmark=true", "max_new_tokens=20",
                          "prompt=ROMEO: hi", f"attn_plot={png}", "attn_layer=1")
    assert result.returncode == 0, result.stderr
    assert "| on |" in result.stdout and "| off |" in result.stdout
    assert "bytes per token" in result.stdout
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("args,message", [
    (["prompt='Zé'"], "not in this model's vocabulary: 'é'"),
    (["prompt=''"], "the prompt is empty"),
    (["max_new_tokens=-1"], "max_new_tokens must be >= 0"),
    (["top_p=1.5"], "top_p must be in (0, 1]"),
    (["top_p=0"], "top_p must be in (0, 1]"),
])
def test_cli_bad_input_is_one_line_error(tiny_ckpt, args, message):
    result = generate_cli(f"ckpt={tiny_ckpt}", *args)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"error: {message}"] or message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cli_bad_checkpoints(tiny_ckpt, tmp_path):
    (tmp_path / "corrupt.pt").write_bytes(b"garbage")
    ckpt = torch.load(tiny_ckpt / "best.pt", weights_only=True)
    ckpt["model_config"]["n_embd"] = 32  # weights no longer match
    torch.save(ckpt, tmp_path / "mismatched.pt")
    for path, message in [(tmp_path / "missing.pt", "not found"),
                          (tmp_path / "corrupt.pt", "cannot read checkpoint"),
                          (tmp_path / "mismatched.pt", "weights do not match")]:
        result = generate_cli(f"ckpt={path}")
        assert result.returncode == 1, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr


def test_compiled_decode_step_matches_eager(tiny_ckpt):
    from generate import compile_decode_step, load_model

    model, _ = load_model(tiny_ckpt, torch.device("cpu"))
    idx = torch.randint(0, 65, (2, 5))
    eager = model.generate(idx, 20, temperature=0)
    step = compile_decode_step(model)
    new = model.stream(idx, 20, temperature=0, decode_step=step)
    compiled = torch.cat([idx, *(t[:, None] for t in new)], 1)
    assert torch.equal(eager, compiled)


def test_int8_weights_stay_close_and_generate():
    from model.quantize import Int8Linear, quantize_int8

    model = tiny_model(n_kv_head=2)
    idx = torch.randint(0, 37, (2, 12))
    reference = model(idx)
    quantized = quantize_int8(tiny_model(n_kv_head=2))
    assert sum(isinstance(m, Int8Linear) for m in quantized.modules()) == 2 * 4 + 1
    error = (quantized(idx) - reference).norm() / reference.norm()
    assert error < 0.02
    bf16 = quantized.to(torch.bfloat16)
    assert bf16.new_kv_cache(1).k[0].dtype == torch.bfloat16
    assert bf16.generate(idx, 5, temperature=0).shape == (2, 17)


def test_cli_fast_decode_options(tiny_ckpt):
    result = generate_cli(f"ckpt={tiny_ckpt}", "prompt=ROMEO:", "max_new_tokens=12", "temperature=0",
                          "quantize=int8", "dtype=bfloat16")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ROMEO:")
    bad = generate_cli(f"ckpt={tiny_ckpt}", "dtype=float16")
    assert bad.returncode == 1 and "dtype must be one of" in bad.stderr
