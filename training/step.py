"""One optimizer step of the training loop: the forward and backward passes of its grad_accum
micro-batches, clipping, and the optimizer's step. `TrainStep` runs it as written, or captures it
once as a CUDA graph and replays it (`train.cuda_graph`): one launch a step instead of the ~1,000
kernel launches Python makes, which on a small model cost more than the kernels themselves.

    step = TrainStep(model, stepped, optimizer, batches, cfg, amp, rows, graph=False)
    loss = step(lr)    # draws the batches, steps, returns the last micro-batch's loss (on the device)
"""

from contextlib import nullcontext

import torch


class TrainStep:
    """The loop's step. `model` is the plain model (its parameters), `stepped` what runs the forward
    pass (the model, compiled, or wrapped in DDP); `rows` this process's rows of every batch.

    As a CUDA graph (one process, AdamW; `graph=True`), the step reads its batches from static
    tensors that each call fills, and its learning rate from a tensor on the GPU (fused AdamW takes
    one when `capturable`). The first call warms the step up (lazy initialisations, the optimizer's
    state, anything compiled), puts the weights, optimizer state and RNG back as they were, and
    captures it: the warm-up steps leave no trace, so the run trains as if the graph had always run.
    Dropout's random numbers then come from the graph's own offsets of the same generator: the same
    run every time, not the same draws as the eager step."""

    def __init__(self, model, stepped, optimizer, batches, cfg, amp, rows: slice, graph: bool = False,
                 world_size: int = 1):
        self.model, self.stepped, self.optimizer, self.batches = model, stepped, optimizer, batches
        self.grad_accum, self.grad_clip, self.amp, self.rows = cfg.grad_accum, cfg.grad_clip, amp, rows
        self.world_size, self.graphed, self.graph = world_size, graph, None  # captured by the first call
        if graph:
            device = next(model.parameters()).device
            shape = (cfg.grad_accum, cfg.batch_size, batches.block_size)   # (grad_accum, B, T)
            self.x = torch.zeros(shape, dtype=torch.long, device=device)
            self.y = torch.zeros(shape, dtype=torch.long, device=device)
            for group in optimizer.param_groups:  # a tensor the graph reads, filled before each replay
                group["lr"] = torch.tensor(float(group["lr"]), device=device)
                group["capturable"] = True

    def __call__(self, lr: float) -> torch.Tensor:
        if not self.graphed:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            return self.run([self.batches.next() for _ in range(self.grad_accum)])
        for micro in range(self.grad_accum):
            x, y = self.batches.next()
            self.x[micro].copy_(x[self.rows])
            self.y[micro].copy_(y[self.rows])
        for group in self.optimizer.param_groups:
            group["lr"].fill_(lr)
        if self.graph is None:
            self.graph, self.loss = self.capture()
        self.graph.replay()
        return self.loss

    def run(self, batches) -> torch.Tensor:
        """The step as written: forward and backward per micro-batch (DDP syncs gradients on the
        last only), clipping, the optimizer's step. Returns the last micro-batch's loss."""
        for micro, (x, y) in enumerate(batches):
            last_micro = micro == self.grad_accum - 1  # DDP syncs gradients only then
            syncing = self.stepped.no_sync() if self.world_size > 1 and not last_micro else nullcontext()
            with syncing, self.amp:
                _, loss = self.stepped(x[self.rows], y[self.rows])
            (loss / self.grad_accum).backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def capture(self) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (as capturing needs), restore what the warm-up changed, then
        record one step over the static batches: (the graph, its loss tensor)."""
        static = list(zip(self.x, self.y))
        before = Snapshot(self.model, self.optimizer)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.run(static)
        torch.cuda.current_stream().wait_stream(side)
        before.restore()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = self.run(static)  # its zero_grad(set_to_none) leaves the gradients to the graph's pool
        return graph, loss


class Snapshot:
    """The weights, optimizer state and CUDA RNG state now, to put back after a warm-up. State the
    optimizer creates in the meantime goes back to zeros: a fresh AdamW (or momentum) state."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.weights = {k: v.clone() for k, v in model.state_dict().items()}
        self.state = {p: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                      for p, s in optimizer.state.items()}
        self.device = next(model.parameters()).device
        self.rng = torch.cuda.get_rng_state(self.device)

    @torch.no_grad()
    def restore(self) -> None:
        for name, tensor in self.model.state_dict().items():
            tensor.copy_(self.weights[name])
        for p, state in self.optimizer.state.items():
            for k, v in state.items():
                if torch.is_tensor(v):
                    v.copy_(self.state[p][k]) if p in self.state else v.zero_()
        torch.cuda.set_rng_state(self.rng, self.device)


def portable_state(optimizer) -> dict:
    """The optimizer's state_dict as an eager step keeps it (a float learning rate, not capturable),
    so that a checkpoint saved by a graphed run resumes anywhere, on a CPU too."""
    state = optimizer.state_dict()
    for group in state.get("param_groups", []):  # (Muon with AdamW nests theirs: never graphed)
        if torch.is_tensor(group["lr"]):
            group["lr"], group["capturable"] = float(group["lr"]), False
    return state
