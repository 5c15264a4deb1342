"""The optimizers a GPT trains with, picked by name (`train.optimizer`):

    adamw  AdamW (fused) on every parameter, weight decay on matrices only (nanoGPT's setup).
    muon   Muon (torch.optim.Muon: momentum, then the update orthogonalised by Newton-Schulz) on the
           2-D weight matrices inside the blocks, AdamW on the rest: embeddings, the head, norms
           and biases (modded-nanogpt's split). Muon's step is scaled to AdamW's update size
           (adjust_lr_fn="match_rms_adamw"), so both take the one learning rate of the schedule.
           `BatchedMuon`: that step with Newton-Schulz batched by matrix shape (float32 off CUDA).

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
    muon = BatchedMuon([params[n] for n in on_muon], lr=lr, weight_decay=weight_decay, momentum=0.95,
                       adjust_lr_fn="match_rms_adamw")
    return MuonAndAdamW(muon, adamw)


class BatchedMuon(torch.optim.Muon):
    """torch.optim.Muon (PyTorch 2.13) with its Newton-Schulz iteration run on all the matrices of
    one shape at once: a batched matrix product instead of one per matrix, a few kernel launches a
    step instead of ~40 per matrix (a GPU's launch overhead at this model size). On CUDA in
    bfloat16, as PyTorch's; elsewhere in float32 (MPS's bf16 needs macOS 14). On a CPU, one without
    bf16 matrix instructions (AVX2) emulates them, a step of the CPU main job taking 8x AdamW's, and
    one with them (AVX512-BF16) ran the main job no faster (63-72 s against 59-65 s in float32;
    benchmarks/RESULTS.md). Same hyperparameters, state ("momentum_buffer") and update; only the
    batching and, off CUDA, the precision differ (PyTorch has no option for either). `ns_dtype`
    overrides the precision."""

    def __init__(self, params, ns_dtype: torch.dtype | None = None, **muon_options):
        super().__init__(params, **muon_options)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            updates = []
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = self.state[p]["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                updates.append(p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf)
            shapes = {}  # shape -> indices of the params of that shape
            for i, p in enumerate(params):
                shapes.setdefault(p.shape, []).append(i)
            for indices in shapes.values():
                stack = torch.stack([updates[i] for i in indices])       # (n, A, B)
                dtype = self.ns_dtype or (torch.bfloat16 if stack.device.type == "cuda" else torch.float32)
                ortho = newton_schulz(stack, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
                for i, update in zip(indices, ortho):
                    p = params[i]
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(update, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape))


def newton_schulz(grads, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype=torch.float32) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration, as torch.optim.Muon's, in `dtype`, on a stack of n
    matrices (n, A, B): each becomes an approximately orthogonal matrix with its singular vectors."""
    a, b, c = coefficients
    x = grads.to(dtype)
    tall = grads.size(1) > grads.size(2)
    if tall:
        x = x.mT                                                         # (n, min, max): the smaller Gram
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.mT                                                  # (n, min, min)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).to(grads.dtype)


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
