"""training/optimizer.py: which parameters Muon and AdamW each get, BatchedMuon's step is PyTorch's Muon
step (bit for bit in bfloat16, as on a GPU; in float32 on a CPU), and train.optimizer=muon trains,
checkpoints and resumes bit-identically, as AdamW does."""

import pytest
import torch

from model import checkpoint
from tests.helpers import compose, read_metrics, step_losses, tiny_model, train_checked
from training.optimizer import BatchedMuon, MuonAndAdamW, configure_optimizer, newton_schulz


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = tiny_model(bias=True, norm="layernorm")
    optimizer = configure_optimizer(model, "muon", lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    assert isinstance(optimizer, MuonAndAdamW)
    assert isinstance(optimizer.optimizers["muon"], BatchedMuon)  # float32 Newton-Schulz on a CPU
    names = {id(p): n for n, p in model.named_parameters()}
    on_muon = {names[id(p)] for g in optimizer.optimizers["muon"].param_groups for p in g["params"]}
    on_adamw = {names[id(p)] for g in optimizer.optimizers["adamw"].param_groups for p in g["params"]}
    assert on_muon == {f"blocks.{i}.{m}.weight" for i in range(2)
                       for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
    assert on_muon.isdisjoint(on_adamw) and on_muon | on_adamw == set(names.values())
    assert {"wte.weight", "wpe.weight", "norm_f.weight", "blocks.0.attn.qkv.bias"} <= on_adamw
    # one learning rate for all: the loop sets it on every group
    assert len(optimizer.param_groups) == 3
    decayed = [g["weight_decay"] for g in optimizer.optimizers["adamw"].param_groups]
    assert decayed == [0.1, 0.0]  # AdamW decays the embeddings, not norms and biases


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (24, 24)])
@pytest.mark.parametrize("ns_dtype", [None, torch.bfloat16])
def test_batched_muon_steps_as_torch_muon(shape, ns_dtype):
    """In bfloat16 (a GPU's default) bit for bit; in float32 (a CPU's) up to bfloat16's rounding."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for _ in range(2)]
    params.append(torch.nn.Parameter(torch.randn(8, 8)))  # another shape: a stack of its own
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    ours, theirs = BatchedMuon(params, ns_dtype=ns_dtype, **kw), torch.optim.Muon(copies, **kw)
    for _ in range(3):
        grads = [torch.randn(p.shape) for p in params]
        for p, c, g in zip(params, copies, grads):
            p.grad, c.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for p, c in zip(params, copies):
        assert torch.equal(ours.state[p]["momentum_buffer"], theirs.state[c]["momentum_buffer"])
        step = kw["lr"] * 0.2 * max(p.shape) ** 0.5  # the update's size, per step
        if ns_dtype == torch.bfloat16:
            assert torch.equal(p, c)  # the same iteration, batched
        else:
            assert 0 < (p - c).abs().max() < 0.05 * step  # float32 against bfloat16 Newton-Schulz
    assert ours.state_dict()["param_groups"] == theirs.state_dict()["param_groups"]


def test_newton_schulz_in_float32_orthogonalises_each_matrix_of_a_stack_as_alone():
    stack = torch.randn(3, 16, 40, generator=torch.Generator().manual_seed(1))
    coefficients = (3.4445, -4.7750, 2.0315)
    alone = torch.stack([newton_schulz(m[None], coefficients, 5, 1e-7)[0] for m in stack])
    torch.testing.assert_close(newton_schulz(stack, coefficients, 5, 1e-7), alone, atol=1e-5, rtol=0)
    tall = stack.mT.contiguous()                                         # (3, 40, 16)
    torch.testing.assert_close(newton_schulz(tall, coefficients, 5, 1e-7), alone.mT, atol=1e-5, rtol=0)


def test_newton_schulz_in_float32_orthogonalises():
    g = torch.randn(32, 96, generator=torch.Generator().manual_seed(0))
    x = newton_schulz(g[None], (3.4445, -4.7750, 2.0315), 5, 1e-7)[0]
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    in_g_basis = u.T @ x @ vh.T                                          # (32, 32): diagonal if x = U S' V^T
    diagonal = in_g_basis.diagonal()
    assert x.dtype == torch.float32 and x.shape == g.shape
    assert 0.5 < diagonal.min() and diagonal.max() < 1.5  # Muon's quintic: near 1, not exactly
    assert (in_g_basis - torch.diag(diagonal)).abs().max() < 1e-3  # g's singular vectors, kept


def test_adamw_is_one_torch_optimizer_over_every_parameter():
    model = tiny_model()
    optimizer = configure_optimizer(model, "adamw", lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))


def test_muon_trains_checkpoints_and_resumes_bit_identically(tiny_run, tmp_path):
    muon = [*tiny_run, "train.optimizer=muon"]
    straight = train_checked(compose(*muon, "train.full_val=true"), tmp_path / "straight")
    train_checked(compose(*muon, "train.max_iters=6", "train.lr_decay_iters=12"), tmp_path / "first")
    train_checked(compose(*muon, f"train.resume={tmp_path / 'first'}"), tmp_path / "second")
    straight_losses = step_losses(tmp_path / "straight")
    assert step_losses(tmp_path / "second") == {s: v for s, v in straight_losses.items() if s > 6}
    a, b = checkpoint.load(tmp_path / "straight"), checkpoint.load(tmp_path / "second")
    assert all(torch.equal(a.model[k], b.model[k]) for k in a.model)
    assert set(a.optimizer) == {"muon", "adamw"} and a.optimizer["muon"]["state"]  # momentum saved
    evals = [m["val_loss"] for m in read_metrics(tmp_path / "straight") if "val_loss" in m]
    assert evals[-1] < evals[0] and straight["val_loss_full"] < evals[0]


def test_resuming_with_the_other_optimizer_names_the_option(tiny_run, tmp_path):
    train_checked(compose(*tiny_run, "train.max_iters=2", "train.optimizer=muon"), tmp_path / "a")
    with pytest.raises(ValueError, match=r"trained with train\.optimizer=muon, not adamw"):
        train_checked(compose(*tiny_run, "train.optimizer=adamw", f"train.resume={tmp_path / 'a'}"),
                      tmp_path / "b")
