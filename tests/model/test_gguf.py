"""GGUF files (model/gguf.py): a small random Llama written as llama.cpp's convert_hf_to_gguf.py
writes one (q and k reordered for its RoPE, tensors in F32, F16, Q8_0 and Q4_1) gives the logits
transformers gives reading the same file, tied or not, in the dtype asked; what we do not build is
refused in one line naming the file; and (`pytest -m real`) SmolLM2-135M-Instruct's Q4_1 file is its
float32 folder's model."""

import numpy as np
import pytest
import torch

from model import GPT
from model.gguf import gguf_config, is_gguf, read_gguf
from model.pretrained import folder_config
from tests.helpers import gguf_file

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

MIXED = (Q.Q8_0, Q.F16, Q.Q4_1, Q.F32)  # the matrices' types in turn (rows of 64 and 96: whole blocks)


@pytest.fixture(scope="module")
def llama():
    """A random Llama of 2 layers, 4 query heads and 2 K/V heads of 16, weights moved off their init."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def test_llama_gguf_gives_transformers_logits(llama, tmp_path):
    """A file of F32, F16, Q8_0 and Q4_1 matrices, with its own output layer and tied (no output.weight):
    our logits are transformers' reading the same file (the same dequantized numbers: rounding apart)."""
    for tied in (False, True):
        file = gguf_file(tmp_path / f"tied_{tied}.gguf", llama, MIXED,
                          tensors={"output.weight": None} if tied else {})
        assert is_gguf(file) and gguf_config(file).tie_embeddings == tied
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name,
                                                                   dtype=torch.float32).eval()
        ours = read_gguf(file).eval()
        assert (ours.lm_head.weight is ours.wte.weight) == tied
        idx = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            expected, got = theirs(idx).logits, ours(idx)
        assert expected.abs().max() > 1  # (logits of a model, not of zeros)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not is_gguf(tmp_path) and not is_gguf(tmp_path / "missing.gguf")


def test_float_gguf_is_the_model_it_was_written_from(llama, tmp_path):
    """All F32, q and k permuted by llama.cpp's code: ours undoes it, the source model's logits; read
    in bfloat16, every weight is the float32 one rounded."""
    file = gguf_file(tmp_path / "f32.gguf", llama)
    ours = read_gguf(file)
    idx = torch.randint(0, 96, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), llama(idx).logits, atol=1e-4, rtol=1e-4)
    half = read_gguf(file, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    assert all(torch.equal(p, ours.state_dict()[k].bfloat16()) for k, p in half.state_dict().items())


Q8_1_BLOCKS = np.zeros((96, 64 // 32 * 40), np.uint8)  # blk.*.ffn_up's rows as Q8_1 blocks of 40 bytes
REFUSED = {
    "another architecture": ({"arch": "qwen2"}, "general.architecture='qwen2' is not supported"),
    "experts": ({"meta": {"llama.expert_count": 4}}, "llama.expert_count=4 is not supported"),
    "YaRN": ({"meta": {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}},
             "llama.rope.scaling.type='yarn' with factor 4.0 is not supported"),
    "Llama 3.1's RoPE": ({"tensors": {"rope_freqs.weight": (np.ones(8, np.float32), Q.F32)}},
                         "rope_freqs.weight (Llama 3.1's RoPE scaling"),
    "a type gguf cannot dequantize": ({"tensors": {"blk.1.ffn_up.weight": (Q8_1_BLOCKS, Q.Q8_1)}},
                                      "blk.1.ffn_up.weight is of type Q8_1, which the gguf library cannot"),
    "a missing tensor": ({"tensors": {"blk.1.ffn_gate.weight": None}},
                         "1 missing (first blk.1.ffn_gate.weight)"),
    "a contradicting shape": ({"meta": {"llama.attention.head_count_kv": 4}},
                              "blk.0.attn_k.weight is [32, 64], its metadata makes it [head_count_kv x"),
    "partial RoPE": ({"meta": {"llama.rope.dimension_count": 8}}, "llama.rope.dimension_count=8 is not"),
    "a SentencePiece tokenizer": ({"meta": {"tokenizer.ggml.model": "llama"}},  # (before any weight is read)
                                  "tokenizer.ggml.model='llama' is not supported"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_we_do_not_build_is_refused_in_one_line(llama, tmp_path, case):
    """From the metadata and the tensors' headers alone (gguf_config), each a ValueError naming the file."""
    kwargs, message = REFUSED[case]
    file = gguf_file(tmp_path / "x.gguf", llama, **kwargs)
    with pytest.raises(ValueError) as error:
        gguf_config(file)
    text = str(error.value)
    assert text.startswith(str(file)) and message in text and "\n" not in text, text


def test_a_nan_weight_is_refused(llama, tmp_path):
    w = llama.state_dict()["model.layers.0.mlp.down_proj.weight"].numpy().copy()
    w[3, 5] = np.nan
    file = gguf_file(tmp_path / "nan.gguf", llama, tensors={"blk.0.ffn_down.weight": (w, Q.F32)})
    gguf_config(file)  # (its metadata is whole)
    with pytest.raises(ValueError, match=r"nan\.gguf: blk\.0\.ffn_down\.weight holds NaN or inf"):
        read_gguf(file)


@pytest.mark.real
def test_smollm2_gguf_is_its_folders_model(smollm2):
    """SmolLM2-135M-Instruct's Q4_1 file read directly: the config of the folder transformers wrote
    from it, and the same logits on a chat prompt (the folder holds the same dequantized numbers)."""
    folder, file = smollm2
    config = gguf_config(file)
    assert config == folder_config(folder)[1]
    ours, theirs = read_gguf(file), GPT.from_pretrained(folder)
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    from data.tokenizer import HFTokenizer

    idx = torch.tensor([HFTokenizer(folder / "tokenizer.json").encode(prompt)])
    with torch.no_grad():
        got, expected = ours(idx), theirs(idx)
    assert idx.size(1) > 15 and expected.abs().max() > 10
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
