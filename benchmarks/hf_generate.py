"""Sample from one of our checkpoints with transformers' `generate` and its static cache, as a whole
process that prints as it samples: the same weights as `python generate.py` (a GPT-NeoX holds the
GPU recipe's architecture, model.convert.neox_weights), the same sampling (temperature 0.8, top_k
200), the same precision (bf16 on CUDA). gpu.py's coldstart section times the two side by side.

    python benchmarks/hf_generate.py outputs/<run> --max-new-tokens 500
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the GPU machine runs it from a checkout

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from cli.errors import ArgumentParser, exit_on_user_error, naming  # noqa: E402
from data.tokenizer import TextStream, tokenizer_from_meta  # noqa: E402
from model.config import check_integer  # noqa: E402
from model.convert import neox_weights  # noqa: E402
from model.device import Precision, pick_device  # noqa: E402
from model.loading import load_model  # noqa: E402


class Printer(BaseStreamer):
    """Prints each new token's text as generate() makes it (the prompt is already printed)."""

    def __init__(self, tokenizer, prompt_len: int):
        self.text, self.skip = TextStream(tokenizer), prompt_len

    def put(self, value):
        for token in value.flatten().tolist():
            if self.skip:  # generate() hands the prompt over first
                self.skip -= 1
                continue
            print(self.text.add(token), end="", flush=True)

    def end(self):
        print(self.text.end(), flush=True)


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", help="a run dir or checkpoint of ours")
    parser.add_argument("--max-new-tokens", type=int, default=500)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompt", default="\n")
    parser.add_argument("--seed", type=int, default=1337)
    exit_on_user_error(sample, parser.parse_args())


def sample(args) -> None:
    """The sample, its options checked first (each error names the option)."""
    check_integer(args.max_new_tokens, "--max-new-tokens", 1, 1_000_000)  # generate.py's bound (hours)
    check_integer(args.seed, "--seed", 0)
    if not args.prompt:
        raise ValueError("--prompt is empty: give at least one character, e.g. --prompt 'ROMEO:'")
    with naming("--device", "device"):
        device = pick_device(args.device)
    with naming("ckpt"):  # on the CPU: the weights as trained (decoding on CUDA pads the head's rows)
        model, ckpt = load_model(args.ckpt, torch.device("cpu"), Precision("float32", None))
    config, state = neox_weights(model)
    hf = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**config)).eval()
    if "embed_out.weight" in hf.state_dict():  # (transformers before 5.x's rename)
        state["embed_out.weight"] = state.pop("lm_head.weight")
    hf.load_state_dict(state)
    hf.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    tokenizer = tokenizer_from_meta(ckpt.data_meta)
    prompt = torch.tensor([tokenizer.encode(args.prompt)], device=device)
    print(args.prompt, end="", flush=True)
    torch.manual_seed(args.seed)
    new = args.max_new_tokens
    hf.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=True,
                temperature=0.8, top_k=200, pad_token_id=0, cache_implementation="static",
                streamer=Printer(tokenizer, prompt.size(1)))


if __name__ == "__main__":
    main()
