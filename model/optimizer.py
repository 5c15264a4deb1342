"""The optimizers a GPT trains with, picked by name (`train.optimizer`):

    adamw  AdamW (fused) on every parameter, weight decay on matrices only (nanoGPT's setup).
    muon   Muon (torch.optim.Muon: momentum, then the update orthogonalised by Newton-Schulz) on the
           2-D weight matrices inside the blocks, AdamW on the rest: embeddings, the head, norms
           and biases (modded-nanogpt's split). Muon's step is scaled to AdamW's update size
           (adjust_lr_fn="match_rms_adamw"), so both take the one learning rate of the schedule.
           On a CPU without bfloat16 matrix instructions (AVX512-BF16), `Float32Muon`: the same step
           with Newton-Schulz in float32, which such a CPU runs far faster than emulated bfloat16.

Both are one object with `param_groups`, `step`, `zero_grad` and `state_dict`, so the training
loop and checkpoints treat them alike.
"""

import torch
import torch.nn as nn
from torch.optim._muon import _adjust_lr

OPTIMIZERS = ("adamw", "muon")


def configure_optimizer(model: nn.Module, name: str, lr: float, betas: tuple[float, float],
                        weight_decay: float, fused: bool = True) -> torch.optim.Optimizer:
    """The optimizer `name` over the model's trainable parameters (see the module docstring). AdamW
    is PyTorch's fused kernel by default: one step for all parameters, on a CPU (4-5% of a CPU
    main job's iteration) as on CUDA."""
    if name not in OPTIMIZERS:
        raise ValueError(f"name={name!r} is not one of {', '.join(OPTIMIZERS)}")
    muon_wanted = name == "muon"
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    on_muon = [n for n, p in params.items() if muon_wanted and p.dim() == 2 and n.startswith("blocks.")]
    rest = [p for n, p in params.items() if n not in on_muon]
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=lr, betas=betas, fused=fused)
    if not on_muon:
        return adamw
    emulates_bf16 = params[on_muon[0]].device.type == "cpu" and not torch.cpu._is_avx512_bf16_supported()
    muon = (Float32Muon if emulates_bf16 else torch.optim.Muon)([params[n] for n in on_muon], lr=lr,
                                                                weight_decay=weight_decay, momentum=0.95,
                                                                adjust_lr_fn="match_rms_adamw")
    return MuonAndAdamW(muon, adamw)


class Float32Muon(torch.optim.Muon):
    """torch.optim.Muon (PyTorch 2.13) with its Newton-Schulz iteration in float32. PyTorch's runs it
    in bfloat16, which a CPU without bf16 matrix instructions emulates: a training step of the CPU
    main job took 8x AdamW's on such a CPU (AVX2; benchmarks/RESULTS.md). On a CPU with them
    (AVX512-BF16) bfloat16 is as fast as float32, and PyTorch's own Muon is used. Same
    hyperparameters, state ("momentum_buffer") and update; only the iteration's precision differs
    (PyTorch has no option for it)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape))


def newton_schulz(grad, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration, as torch.optim.Muon's, in float32: grad (A, B) ->
    an approximately orthogonal matrix (A, B) with its singular vectors."""
    a, b, c = coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T                                                          # (min, max): the smaller Gram
    x = x / x.norm().clamp(min=eps)  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.T                                                   # (min, min)
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if grad.size(0) > grad.size(1) else x).to(grad.dtype)


class MuonAndAdamW:
    """Two optimizers stepped as one. `param_groups` lists both's groups (the loop sets each
    group's lr); the state dict keeps them apart, by name."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW):
        self.optimizers = {"muon": muon, "adamw": adamw}

    @property
    def param_groups(self) -> list[dict]:  # looked up each time: load_state_dict replaces the groups
        return [group for optimizer in self.optimizers.values() for group in optimizer.param_groups]

    def step(self) -> None:
        for optimizer in self.optimizers.values():
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: optimizer.state_dict() for name, optimizer in self.optimizers.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, optimizer in self.optimizers.items():
            optimizer.load_state_dict(state[name])


def optimizer_name(state: dict) -> str:
    """The optimizer (one of OPTIMIZERS) that saved a state dict."""
    return "muon" if set(state) == {"muon", "adamw"} else "adamw"
