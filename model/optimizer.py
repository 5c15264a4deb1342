"""The optimizers a GPT trains with, picked by name (`train.optimizer`):

    adamw  AdamW on every parameter, weight decay on matrices only (nanoGPT's setup).
    muon   Muon (torch.optim.Muon: momentum, then the update orthogonalised by Newton-Schulz) on the
           2-D weight matrices inside the blocks, AdamW on the rest: embeddings, the head, norms
           and biases (modded-nanogpt's split). Muon's step is scaled to AdamW's update size
           (adjust_lr_fn="match_rms_adamw"), so both take the one learning rate of the schedule.

Both are one object with `param_groups`, `step`, `zero_grad` and `state_dict`, so the training
loop and checkpoints treat them alike.
"""

import torch
import torch.nn as nn

OPTIMIZERS = ("adamw", "muon")


def configure_optimizer(model: nn.Module, name: str, lr: float, betas: tuple[float, float],
                        weight_decay: float, fused: bool = False) -> torch.optim.Optimizer:
    """The optimizer `name` over the model's trainable parameters (see the module docstring)."""
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
    muon = torch.optim.Muon([params[n] for n in on_muon], lr=lr, weight_decay=weight_decay,
                            momentum=0.95, adjust_lr_fn="match_rms_adamw")
    return MuonAndAdamW(muon, adamw)


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
