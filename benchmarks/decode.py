"""CPU/GPU decode benchmark: our cached decode vs Hugging Face transformers' GPT-2 `generate`,
side by side in one run, on an identical architecture with identical weights.

    python benchmarks/decode.py [--new 250] [--layers 6 --heads 6 --embd 384 --vocab 65 --block 256]

The model is a random GPT-2 (6 layers, 6 heads, 384 wide, vocab 65: the char model's shape),
saved with `save_pretrained` and loaded into ours with `GPT.from_pretrained`. Greedy, batch 1.
Needs `transformers` (a test/benchmark-only dependency).
"""

import argparse
import copy
import tempfile
import time

import torch

from model import GPT
from model.generation import compile_decode_step, stream
from model.quantize import quantize_int8


def tokens_per_s(fn, new_tokens: int, repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return new_tokens / sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new", type=int, default=250, help="new tokens per generation")
    p.add_argument("--uncached-new", type=int, default=500, help="new tokens for the uncached path")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--embd", type=int, default=384)
    p.add_argument("--vocab", type=int, default=65)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=args.vocab, n_positions=args.block, n_embd=args.embd,
                                    n_layer=args.layers, n_head=args.heads, bos_token_id=0,
                                    eos_token_id=0)).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = GPT.from_pretrained(d).eval()
    prompt = torch.randint(0, args.vocab, (1, 1))
    n = args.new
    hf_out = hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    assert torch.equal(hf_out, ours.generate(prompt, n, temperature=0)), "outputs differ"

    fast = quantize_int8(copy.deepcopy(ours)).to(torch.bfloat16)
    agree = (fast.generate(prompt, n, temperature=0) == hf_out).float().mean().item()

    def compiled(model):
        step = compile_decode_step(model)
        return lambda: list(stream(model, prompt, n, temperature=0, decode_step=step))

    rows = {
        "HF generate, use_cache=True (fp32)": tokens_per_s(lambda: hf.generate(
            prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0), n),
        "ours, KV cache, eager, fp32": tokens_per_s(lambda: ours.generate(prompt, n, temperature=0), n),
        "ours, KV cache, compiled step, fp32": tokens_per_s(compiled(ours), n),
        "ours, KV cache, compiled step, int8 weights + bf16": tokens_per_s(compiled(fast), n),
        f"ours, no cache, fp32 ({args.uncached_new} new)": tokens_per_s(
            lambda: ours.generate(prompt, args.uncached_new, temperature=0, kv_cache=False),
            args.uncached_new, repeats=1),
    }
    print(f"{ours.num_params() / 1e6:.1f}M parameters ({args.layers}/{args.heads}/{args.embd}, "
          f"vocab {args.vocab}), batch 1, greedy, {n} new tokens, {torch.get_num_threads()} threads; "
          f"fp32 tokens identical to HF's; int8+bf16 agrees on {agree:.1%} of them")
    print("| decode | tokens/s | vs HF |\n| --- | --- | --- |")
    base = rows["HF generate, use_cache=True (fp32)"]
    for name, tps in rows.items():
        print(f"| {name} | {tps:,.0f} | {tps / base:.2f}x |")
    uncached = rows[list(rows)[-1]]
    print(f"\nbest cached vs HF: {max(rows.values()) / base:.1f}x; vs our uncached path at "
          f"{args.uncached_new} new tokens: {max(rows.values()) / uncached:.1f}x; fp32 cached, eager "
          f"vs uncached: {rows['ours, KV cache, eager, fp32'] / uncached:.1f}x")


if __name__ == "__main__":
    main()
