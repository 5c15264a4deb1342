"""model/retrofit.py on small random Llamas (GQA: 4 heads, 2 K/V heads, head_dim 16, 3 layers): each
conversion at no compression is the model it came from, the MLA retrofit's cache decodes what its
plain form computes, its truncation loses less as the latent grows, and what does not apply is refused."""

import pytest
import torch

import model.gpt as gpt_file
from model import GPT, GPTConfig, generate
from model import checkpoint as checkpoints
from model.checkpoint import Checkpoint
from model.convert import deepseek_v3_weights
from model.retrofit import mla_retrofit, pool_kv_heads, rope_pair_scores, share_kv
from tests.helpers import hf_folder, tiny_model

IDX = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))  # (B, T) token ids
HALF = 8  # head_dim 16: 8 RoPE pairs per head
FULL_RANK = 2 * 16  # every pair kept: M is the 2 K/V heads' value rows alone


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf_folder(path, "llama")  # (GQA, Llama 3's RoPE scaling)
    return GPT.from_pretrained(path).eval()


def max_diff(a: GPT, b: GPT) -> float:
    with torch.no_grad():
        return (a(IDX) - b(IDX)).abs().max().item()


def test_mla_keeping_every_pair_at_full_rank_is_the_model(llama):
    mla = mla_retrofit(llama, FULL_RANK, HALF)
    c = mla.config
    assert (c.n_kv_head, c.mla_latent_dim, c.mla_rope_dim, c.mla_kv_norm) == (4, FULL_RANK, 4 * HALF, False)
    assert c.mla_rope_pairs == [*range(HALF)] * 2 and not any("kv_norm" in k for k in mla.state_dict())
    assert max_diff(mla, llama) < 1e-5
    assert not mla.training and mla.wte.weight.dtype == torch.float32


def partial_rope(model: GPT, pairs: torch.Tensor):
    """A stand-in for model.gpt's rope_at under which `model` (GQA) turns only K/V head g's `pairs[g]`
    (and its query heads'): cos and sin per head, (heads, T, hd), 1 and 0 on the other dims."""
    c = model.config
    group = torch.arange(c.n_head) // (c.n_head // c.n_kv_head)
    kept = torch.zeros(c.n_kv_head, c.head_dim, dtype=torch.bool)
    kept.scatter_(1, torch.cat([pairs, pairs + c.head_dim // 2], dim=1), True)
    kept = torch.cat([kept[group], kept])[:, None]                          # (n_head + n_kv_head, 1, hd)

    def turned(positions, *args):
        cos, sin = ROPE_AT(positions, *args)                                # (T, hd) each
        return torch.where(kept, cos, 1.0), torch.where(kept, sin, 0.0)     # (heads, T, hd) each
    return turned


ROPE_AT = gpt_file.rope_at  # (the original, kept before any test patches it)


@pytest.mark.parametrize("scored", [False, True])
def test_at_full_rank_with_some_pairs_kept_mla_is_the_partial_rope_model(llama, scored, monkeypatch):
    """Only the truncation loses anything the retrofit does not say: the pairs made position-free
    change the function (MHA2MLA's partial RoPE), so the reference turns only the kept pairs."""
    scores = rope_pair_scores(llama, IDX) if scored else None
    mla = mla_retrofit(llama, 48, 3, scores)  # full rank: M's 52 rows span at most n_embd = 48
    pairs = torch.tensor(mla.config.mla_rope_pairs).view(2, 3)              # (n_kv_head, rope_pairs)
    assert scored or pairs.tolist() == [[0, 1, 2]] * 2
    assert max_diff(mla, llama) > 1e-3  # (partial RoPE is another function: slow pairs, a small change)
    monkeypatch.setattr(gpt_file, "rope_at", partial_rope(llama, pairs))
    with torch.no_grad():
        partial = llama(IDX)
    monkeypatch.undo()
    with torch.no_grad():
        assert (mla(IDX) - partial).abs().max() < 1e-5


def test_the_retrofits_cache_decodes_what_its_plain_form_computes(llama):
    mla = mla_retrofit(llama, 12, 2, rope_pair_scores(llama, IDX))
    with torch.no_grad():
        plain = mla(IDX)
        cache = mla.new_kv_cache(batch_size=2)
        steps = [mla(IDX[:, :12], kv_cache=cache)]                          # the prefill, then a token a step
        steps += [mla(IDX[:, t:t + 1], kv_cache=cache) for t in range(12, 20)]
    assert (torch.cat(steps, dim=1) - plain).abs().max() < 1e-4
    cached, uncached = (generate(mla, IDX[:, :8], 10, temperature=0, kv_cache=kv) for kv in (True, False))
    assert torch.equal(cached, uncached)


def test_the_truncated_latent_loses_less_as_it_grows(llama):
    with torch.no_grad():
        reference = llama(IDX)
        errors = [(mla_retrofit(llama, latent, HALF)(IDX) - reference).abs().mean().item()
                  for latent in (8, 16, 24)]
    assert errors[0] > errors[1] > errors[2] > 1e-3, errors


def test_sharing_one_layer_and_pooling_to_the_same_heads_are_the_model(llama, tmp_path):
    assert max_diff(share_kv(llama, 1), llama) < 1e-6
    assert max_diff(pool_kv_heads(llama, 2), llama) < 1e-6
    hf_folder(tmp_path, "llama", num_key_value_heads=1, num_hidden_layers=2)
    mqa = GPT.from_pretrained(tmp_path).eval()
    assert max_diff(pool_kv_heads(mqa, 1), mqa) < 1e-6


def test_sharing_and_pooling_shrink_the_cache_and_change_the_model(llama):
    shared = share_kv(llama, 2)  # 3 layers: groups of 2 and 1
    assert shared.config.kv_layers == 2 and shared.blocks[1].attn.qkv.weight.size(0) == 4 * 16
    qkv = [block.attn.qkv.weight for block in llama.blocks]
    assert torch.allclose(shared.blocks[0].attn.qkv.weight[64:], (qkv[0][64:] + qkv[1][64:]) / 2)
    assert torch.equal(shared.blocks[2].attn.qkv.weight, qkv[2])
    mqa = pool_kv_heads(llama, 1)
    assert mqa.config.n_kv_head == 1 and max_diff(shared, llama) > 1e-3 and max_diff(mqa, llama) > 1e-3


def test_a_conversion_keeps_the_dtype_and_the_mode(llama):
    trained = mla_retrofit(share_kv(llama, 1).to(torch.bfloat16).train(), 16, 2)
    assert trained.training and trained.wte.weight.dtype == torch.bfloat16
    assert not share_kv(llama, 3).training


def test_rope_pair_scores_are_zero_where_a_pairs_rows_are_zero(llama):
    scores = rope_pair_scores(llama, IDX)
    assert scores.shape == (3, 2, HALF) and (scores > 0).all()
    zeroed = share_kv(llama, 1)  # (a copy)
    with torch.no_grad():
        k_rows = 4 * 16 + 16 * 1                                            # K/V head 1's key rows
        zeroed.blocks[2].attn.qkv.weight[[k_rows + 5, k_rows + 5 + HALF]] = 0  # its pair 5
        zeroed.blocks[0].attn.qkv.weight[[16 * h + 3 for h in (0, 1)] + [16 * h + 11 for h in (0, 1)]] = 0
    got = rope_pair_scores(zeroed, IDX)                                      # query heads 0, 1: pair 3
    assert got[2, 1, 5] == 0 and got[0, 0, 3] == 0 and (got[2, 0] > 0).all() and got[0, 1, 3] > 0


def test_a_retrofits_config_survives_a_checkpoint(llama, tmp_path):
    mla = mla_retrofit(llama, 20, 3, rope_pair_scores(llama, IDX))
    checkpoints.save(tmp_path / "mla.pt", Checkpoint(model=mla.state_dict(), model_config=mla.config,
                                                     data_meta={"tokenizer": "hf", "vocab_size": None}))
    ckpt = checkpoints.load(tmp_path / "mla.pt")
    assert ckpt.model_config == mla.config and ckpt.model_config.mla_rope_pairs == mla.config.mla_rope_pairs
    loaded = GPT(ckpt.model_config).eval()
    checkpoints.load_weights(loaded, ckpt.model)
    assert max_diff(loaded, mla) == 0
    with pytest.raises(ValueError, match="a DeepseekV3 needs model.mla_kv_norm=true"):
        deepseek_v3_weights(mla)


ROPE = {"pos_emb": "rope", "bias": False}  # tiny_model: head_dim 4, 2 layers
REFUSALS = [
    (lambda m: mla_retrofit(tiny_model(**ROPE, mla_latent_dim=6, mla_rope_dim=2), 4, 1), "already uses"),
    (lambda m: mla_retrofit(tiny_model(bias=False), 4, 1), "learned positions"),
    (lambda m: mla_retrofit(tiny_model(**ROPE, kv_share=2), 4, 1), r"kv_share=2"),
    (lambda m: mla_retrofit(tiny_model(**ROPE, qk_norm=True), 4, 1), "qk_norm"),
    (lambda m: mla_retrofit(tiny_model(pos_emb="rope"), 4, 1), "biases on q, k and v"),
    (lambda m: rope_pair_scores(tiny_model(**ROPE, kv_share=2), IDX[:, :4] % 37), "kv_share=2"),
    (lambda m: mla_retrofit(m, 8, 0), r"^rope_pairs must be an integer >= 1, got 0$"),
    (lambda m: mla_retrofit(m, 8, HALF + 1), rf"^rope_pairs must be at most {HALF}"),
    (lambda m: mla_retrofit(m, 0, 2), r"^latent_dim must be an integer >= 1"),
    (lambda m: mla_retrofit(m, 2 * 12 + 32 + 1, 2), r"^latent_dim must be at most 48"),  # n_embd 48
    (lambda m: mla_retrofit(m, FULL_RANK + 1, HALF), rf"^latent_dim must be at most {FULL_RANK}\b"),
    (lambda m: mla_retrofit(m, 8, 2, torch.ones(2, HALF)), r"scores must be .* = \(3, 2, 8\)"),
    (lambda m: share_kv(tiny_model(**ROPE, mla_latent_dim=6, mla_rope_dim=2), 2), "multi-head latent"),
    (lambda m: share_kv(share_kv(m, 2), 3), "already shares K/V"),
    (lambda m: share_kv(m, 0), r"^share must be an integer >= 1"),
    (lambda m: share_kv(m, 4), r"^share must be at most 3"),
    (lambda m: pool_kv_heads(m, 3), "n_kv_head=3 must divide"),
]


@pytest.mark.parametrize("convert,message", REFUSALS)
def test_what_does_not_apply_is_refused_in_one_line(llama, convert, message):
    with pytest.raises(ValueError, match=message) as error:
        convert(llama)
    assert "\n" not in str(error.value)


MLA = {"mla_latent_dim": 8, "mla_rope_dim": 4}  # head_dim 4: pairs 0..1


@pytest.mark.parametrize("fields,message", [
    ({"mla_rope_pairs": [0]}, "mla_rope_pairs=.* is for multi-head latent"),
    ({"mla_kv_norm": False}, "mla_kv_norm=False is for multi-head latent"),
    (MLA | {"mla_kv_norm": 0}, "mla_kv_norm must be true or false"),
    (MLA | {"mla_rope_pairs": [0]}, r"mla_rope_pairs must .* = 2 indices"),
    (MLA | {"mla_rope_pairs": [0, 2]}, r"mla_rope_pairs must .* each an integer in 0\.\.1 "),
    (MLA | {"mla_rope_pairs": [0, True]}, "mla_rope_pairs must be"),
    (MLA | {"mla_rope_pairs": "01"}, "mla_rope_pairs must be"),
    (MLA | {"mla_rope_pairs": [0, 1], "pos_emb": "learned"}, "mla_rope_pairs is for pos_emb='rope'"),
])
def test_the_new_fields_are_checked_by_name(fields, message):
    with pytest.raises(ValueError, match=rf"^GPTConfig\.{message}") as error:
        GPTConfig(**{"vocab_size": 37, "block_size": 24, "n_layer": 2, "n_head": 4, "n_embd": 16,
                     "pos_emb": "rope"} | fields)
    assert "\n" not in str(error.value)


def test_chosen_pairs_turn_at_the_head_tables_frequencies():
    """mla_rope_pairs [1, 1, 0]: the RoPE key's pairs turn at frequencies 1, 1 and 0 of the head_dim
    table (head_dim 4: base^0 and base^-1/2), Llama 3's scaling included."""
    from model.rope import rope_at, scaled_rope_frequencies

    config = GPTConfig(vocab_size=37, block_size=24, n_layer=1, n_head=2, n_embd=8, pos_emb="rope",
                       mla_latent_dim=4, mla_rope_dim=6, mla_rope_pairs=[1, 1, 0],
                       rope_scaling=[8.0, 1.0, 4.0, 16.0])
    gpt = GPT(config)
    assert gpt.rope == (4, 10000.0, (8.0, 1.0, 4.0, 16.0), (1, 1, 0))
    table = scaled_rope_frequencies(4, 10000.0, (8.0, 1.0, 4.0, 16.0))
    cos, _ = rope_at(torch.arange(3), *gpt.rope)                           # (3, 6)
    assert torch.allclose(cos[2], torch.cat([(2 * table[[1, 1, 0]]).cos()] * 2))
