"""The core GPT's one-token cached step, compiled once for a model and its static KV cache: one class a
way of building it. Compiled by torch.compile (`CompiledCpuStep`; on CUDA `CompiledGraphStep`), exported
ahead of time as an AOTInductor package (`AheadOfTimeStep`: an int8 model on a CPU), or captured as a CUDA
graph that also draws the next token (`CudaGraphStep`); here too, the SDPA kernels a decode uses."""

import contextlib
import functools
import warnings

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from model.config import check_integer
from model.kernels import SplitKV
from model.kv_cache import is_int4, storage_dtype
from model.sampling import Sampling, sample_next
from model.step_package import (
    announce_compile,
    build_package,
    folder_errors,
    inductor_folder,
    load_package,
    mark_compiled,
    package_key,
    package_runner,
    writable_folder,
)


def decode_backends(device: torch.device) -> list[SDPBackend]:
    """The SDPA kernels a decode may use, in the order it prefers them. Never cuDNN's attention: it
    builds an execution plan per exact shape (~50 ms each on an H200), and an eager decode's key
    length grows by one a token (`stream` runs under `CudnnAttentionOff`). Flash takes an unmasked
    call and, on a CPU, a masked one; on CUDA memory-efficient attention takes a masked call (the
    static step's unwritten cells, padding, a ring). Compiled on a CPU, SDPA's math kernel becomes a
    loop over the keys that recomputes the query's RoPE per key (3.4x slower; benchmarks/RESULTS.md)."""
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class CudnnAttentionOff:
    """A context in which SDPA never picks cuDNN's attention (decode_backends says why), restored
    on exit. A flag, not sdpa_kernel's priority list: entering and leaving it costs ~1 µs a token
    on a 2-core CPU, sdpa_kernel's ~37 µs (4% of the CPU's eager step of a tiny model)."""

    def __enter__(self):
        self.was = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(False)

    def __exit__(self, *exc):
        torch.backends.cuda.enable_cudnn_sdp(self.was)


STEP_BACKENDS = ("inductor", "aot_eager", "cuda_graph")


class CompiledDecodeStep:
    """The one-token step built once for a model, with one static KV cache (block_size cells per
    layer, or a ring of its window and sinks; batch_size rows; stored in kv_dtype) that every
    `stream` given this step reuses. The cache, token, starts and position are tensors allocated here
    and written in place (a smaller batch uses the first rows), so every prompt length, number of
    new tokens and batch up to batch_size runs one graph. `backend` says how, and so which class
    `CompiledDecodeStep(...)` makes (`step_class`):

        cuda_graph  the eager step captured once as a CUDA graph and replayed (CUDA only): no code
                    generated, captured in well under a second; `generate.py`'s default on CUDA
        inductor    torch.compile generates the step's code (fused kernels), on CUDA captured as a
                    CUDA graph too: seconds to compile, the fastest step once compiled
        aot_eager   torch.compile traces the same graph and runs it eagerly: a quick check of the
                    traced step (tests, the GPU plan's smoke run)

    On CUDA nothing the step reads changes shape (`CudaGraphStep`, `CompiledGraphStep`). On a CPU
    it reads the cells written so far, in a graph compiled once for any number of them
    (`CompiledCpuStep`); an int8 model's CPU step is compiled ahead of time instead
    (`AheadOfTimeStep`). Built, and on a CPU run, once when made: what that prints comes before a
    sample's text. A subclass says how it is built (`build`) and how it runs (`run`)."""

    uses_torch_compile = False  # whether building it compiles (inductor: its cache folder checked first)

    def __new__(cls, model, batch_size: int = 1, kv_dtype=None, backend: str = "inductor",
                split_kv: bool | None = None, max_len: int | None = None):
        chosen = step_class(model, backend)
        if cls not in (CompiledDecodeStep, chosen):
            raise ValueError(f"backend={backend!r} builds a {chosen.__name__}, not a {cls.__name__}")
        return super().__new__(chosen)

    def __init__(self, model, batch_size: int = 1, kv_dtype=None, backend: str = "inductor",
                 split_kv: bool | None = None, max_len: int | None = None):
        device = model.wte.weight.device
        check_integer(batch_size, "batch_size", 1)
        if is_int4(kv_dtype):
            raise ValueError("kv_dtype='int4': a compiled decode step does not take an int4 cache (its reads "
                             "depend on the position); decode it eagerly")
        self.model, self.backend = model, backend
        self.split_kv = backend == "inductor" if split_kv is None else split_kv
        self.cache = model.new_kv_cache(batch_size, max_len, None if kv_dtype is None else
                                        storage_dtype(kv_dtype, "kv_dtype"))  # max_len: block_size
        self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)   # (batch_size, 1)
        self.starts = torch.zeros(batch_size, dtype=torch.long, device=device)        # (batch_size,)
        self.input_pos = torch.zeros(1, dtype=torch.long, device=device)           # (1,) the cell written
        # SDPA's kernels, set around every call that compiles or captures the step (set inside the
        # traced function, they keep AOTAutograd's cache from storing it: ~1 s of each CPU start).
        self.kernels = functools.partial(sdpa_kernel, decode_backends(device), set_priority=True)
        self.inputs = (self.token, self.input_pos, self.cache, self.starts)
        # On a CPU, a cache that is not one ring is read up to its last written cell: the step is
        # given carrier[:cells_read], whose size is its one dynamic dimension. (A ring reads every cell.)
        reads_written = device.type != "cuda" and not self.cache.ring
        self.cells_read_carrier = torch.empty(self.cache.max_len, device=device) if reads_written else None
        self.logits_at = step_function(model)
        # Inductor writes what it compiles to its cache folder: a folder it cannot write to (full,
        # read-only, not a folder) is said in one line, before compiling, or when a write is refused.
        compiles = backend == "inductor" and self.uses_torch_compile  # (a package checks its own room)
        folder = writable_folder(inductor_folder()) if compiles else None
        if compiles:  # (a cold compile of a large model takes a minute or more: said first)
            key = package_key(model, self.cache, dynamic_cells(self.cache), weights=False)
            compiled = announce_compile(folder, key, model.config.n_layer)
        with folder_errors(folder) if compiles else contextlib.nullcontext(), warnings.catch_warnings(), \
                torch.inference_mode(), self.kernels():
            # float32 is asked for, not TF32 (inductor advises it): the advice is not the user's concern
            warnings.filterwarnings("ignore", message=".*TensorFloat32 tensor cores")
            # nor is autotune's own use of a deprecated storage API (timing an int8 step's products)
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            self.build()
        if compiles:
            mark_compiled(compiled)

    def build(self) -> None:
        """Make the step `run` calls (compile, export or capture it), inside the kernels' context."""
        raise NotImplementedError

    def run(self, cells_read: int) -> torch.Tensor:
        """The logits (batch_size, 1, vocab) of the static inputs, attention reading `cells_read` cells."""
        raise NotImplementedError

    def torch_compiled(self, backend: str):
        """The step compiled by torch.compile's `backend`: one fixed-shape graph (on CUDA, captured
        as a CUDA graph after), or on a CPU one whose number of cells read is dynamic."""
        on_cpu = self.token.device.type == "cpu"
        if not on_cpu:  # a CUDA graph reads its inputs where they were captured: no copy in
            for buffer in [*self.cache.buffers, *self.cache.read_buffer.values(), self.token, self.starts,
                           self.input_pos]:
                torch._dynamo.mark_static_address(buffer)
        # A code object of its own: dynamo's recompile limit (8) counts the graphs of one code object.
        self.logits_at.__code__ = self.logits_at.__code__.replace()
        # No guard runs per call: like a CUDA graph, the step serves one model and one cache, read in
        # place (dynamo's ~500 guards cost the main job's CPU step a quarter of its time). On a CPU,
        # inductor's wrapper around its kernels is C++ too (cpp_wrapper): another fifth.
        options = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
        if backend == "inductor" and on_cpu:
            options["cpp_wrapper"] = True
        dynamic = None if self.cells_read_carrier is not None else False  # None: the size that changes
        return torch.compile(self.logits_at, backend=backend, dynamic=dynamic, fullgraph=True,
                             options=options)

    def eager(self, cells_read: int) -> torch.Tensor:
        """The step run eagerly (a size a CPU step was not compiled for), reading `cells_read` cells."""
        carrier = None if self.cells_read_carrier is None else self.cells_read_carrier[:cells_read]
        with self.kernels():
            return self.logits_at(*self.inputs, carrier)

    def compile_now(self) -> None:
        """Run a CPU step once, with 2 cells read, so that it compiles now, not at a sample's first
        token (sizes 0 and 1 would be compiled as constants)."""
        self.cache.advance(min(1, self.cache.max_len - 1))
        self(self.token, self.cache)
        self.cache.reset()

    def sampler(self, sampling: Sampling, vocab_size, generator, B: int):
        """A step that also draws the next tokens (CUDA graphs: CudaGraphStep.sampler); None here."""
        return None

    def write_inputs(self, token, cache, starts=None):
        """token (B, 1), B <= batch_size, starts (B,) or None and the cell cache.length to the static
        inputs."""
        B = token.size(0)
        self.token[:B] = token
        self.starts[:B] = 0 if starts is None else starts
        self.input_pos.fill_(cache.length)                               # a kernel, not a host copy

    def __call__(self, token, cache, starts=None):
        """The logits (B, vocab) after token (B, 1), B <= batch_size, at cell cache.length: read them
        before the next call, which writes over them."""
        self.write_inputs(token, cache, starts)
        logits = self.run(min(cache.length + 1, cache.max_len))          # (batch_size, 1, vocab)
        cache.advance(1)
        return logits[:token.size(0), -1]


class CompiledCpuStep(CompiledDecodeStep):
    """On a CPU (inductor, aot_eager): torch.compile's step over the cells written so far (all of a
    ring's), in a graph compiled once for any number of them (one dynamic dimension), called with no
    guard of torch.compile's checked (the step is its model's and its cache's)."""

    uses_torch_compile = True

    def build(self) -> None:
        self.compiled, self.marked_dynamic = self.torch_compiled(self.backend), False
        self.compile_now()

    def run(self, cells_read: int) -> torch.Tensor:
        if self.cells_read_carrier is None:
            return self.compiled(*self.inputs)
        if cells_read < 2:  # 1 cell (a refill that kept no token): a size dynamo makes a constant
            return self.eager(cells_read)  # so it runs eagerly
        carrier = self.cells_read_carrier[:cells_read]                   # (cells_read,)
        # The first call compiles the graph for every number in 2 .. max_len: the whole cache too,
        # which comes once a refill (eager, the main job's step took 3 ms there; compiled, 0.4)
        if not self.marked_dynamic:
            torch._dynamo.mark_dynamic(carrier, 0)
            self.marked_dynamic = True
        return self.compiled(*self.inputs, carrier)


class AheadOfTimeStep(CompiledDecodeStep):
    """On a CPU, inductor's step of an int8 model: exported (torch.export) and compiled by
    AOTInductor with its weights frozen in (inductor's own C++ int8 products), kept on disk as a
    package (model.step_package) that a later process loads in milliseconds, and called through
    the package's C++ runner: no dynamo, AOTAutograd or guard between two steps. Its numbers of
    cells (the cache's and those read) are dynamic sizes: one package serves every length. A
    number outside those it was exported for (below 2, or where export specialised) runs eagerly."""

    def build(self) -> None:
        reads_written = self.cells_read_carrier is not None
        self.runner, self.cells_read_range = None, (0, 0)  # no runner: every step eager
        if not reads_written or self.cache.max_len >= 3:  # (export would take 2 cells read for the cache's 2)
            self.load_or_build_package()
        self.compile_now()

    def load_or_build_package(self) -> None:
        """The runner of this step's package, loaded, or built then loaded as it is (its digest is its
        name: not read again); the range of cells read it takes; None if the cache's size is not one
        it was exported for."""
        reads_written = self.cells_read_carrier is not None
        # a ring reads every cell: its carrier input is a placeholder of fixed size
        carrier = (self.cells_read_carrier[:self.cache.max_len - 1] if reads_written else
                   self.token.new_empty(0))
        tensors, dynamic = self.cache.tensors, dynamic_cells(self.cache)
        folder = inductor_folder() / "kvgpt"
        key = package_key(self.model, self.cache, dynamic)
        runner = load_package(folder, key)
        if runner is None:
            example = (self.token, self.input_pos, self.starts, carrier, tensors)
            export = functools.partial(export_step, self.model, self.cache, example, reads_written, dynamic,
                                       kernels=self.kernels)
            runner = package_runner(path := build_package(folder, key, export, self.model))
            if runner is None:
                raise RuntimeError(f"the decode step just compiled, {path}, does not load")
        ranges = runner.get_metadata()
        self.cells_read_range = tuple(int(n) for n in ranges["cells_read"].split())
        cells_low, cells_high = (int(n) for n in ranges["cells"].split())
        self.runner = runner if cells_low <= self.cache.max_len <= cells_high else None
        self.package_inputs = [self.token, self.input_pos, self.starts, carrier, *tensors]

    def run(self, cells_read: int) -> torch.Tensor:
        reads_written = self.cells_read_carrier is not None
        low, high = self.cells_read_range
        if self.runner is None or reads_written and not low <= cells_read <= high:
            return self.eager(cells_read)
        if reads_written:
            self.package_inputs[3] = self.cells_read_carrier[:cells_read]  # (cells_read,)
        return self.runner.run(self.package_inputs)[0]


class CudaGraphStep(CompiledDecodeStep):
    """On CUDA (cuda_graph): the eager step captured once as a CUDA graph over the static inputs,
    each call a replay whose logits are written to the same tensor. Nothing it reads changes shape:
    it reads every cell, unwritten ones masked, and draws the next token inside a graph too
    (`sampler`), so the host launches one graph a token. With `split_kv` (by default when inductor
    compiles) its one-query attention is split across the GPU's multiprocessors (`attend_split_kv`)."""

    def to_capture(self):
        """The step the graph captures: the model's own."""
        return self.logits_at

    def build(self) -> None:
        self.captured_step, self.sampling_graphs = self.to_capture(), {}
        # logits (batch_size, 1, vocab); the graph kept alive with its memory pool
        self.graph, self.logits = self.capture(lambda: self.captured_step(*self.inputs))

    def run(self, cells_read: int) -> torch.Tensor:
        self.graph.replay()
        return self.logits

    def capture(self, body, generator=None, restore_rng=False):
        """(a CUDA graph of body(), what body returned): warmed up twice on a side stream (as capturing
        needs: lazy initialisations; torch.compile's or an int8 cache's kernel compiled), then
        recorded once, in a memory pool of its own, with attention split across the GPU (split_kv)
        and SDPA's kernels in the step's order (decode_backends).
        With restore_rng the warm-ups leave `generator` (None: CUDA's default) as they found it, and
        the graph advances it at every replay as the eager draws would."""
        split = SplitKV() if self.split_kv else contextlib.nullcontext()
        if restore_rng:  # (the warm-ups draw too)
            rng = torch.cuda.get_rng_state() if generator is None else generator.get_state()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), split, self.kernels():
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(side)
        if restore_rng:
            torch.cuda.set_rng_state(rng) if generator is None else generator.set_state(rng)
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            graph.register_generator_state(generator)
        with split, self.kernels(), torch.cuda.graph(graph):
            out = body()
        return graph, out

    def sampler(self, sampling: Sampling, vocab_size, generator, B: int):
        """A step that also draws the next tokens, (token (B, 1), cache, starts) -> (B,): one CUDA graph
        of the step and `sample_next` (greedy, temperature, top-k, top-p, `generator`), captured on
        the first call for each way of sampling and batch size (the draws of a smaller batch are
        others), kept for the 4 latest. The same tokens as sampling after the step's logits, seeded
        too. None for a list of generators (one per row: drawn after the step)."""
        if isinstance(generator, (list, tuple)):
            return None
        key = (B, sampling.temperature, sampling.top_k, sampling.top_p, vocab_size, generator)
        if key not in self.sampling_graphs:
            if len(self.sampling_graphs) == 4:
                del self.sampling_graphs[next(iter(self.sampling_graphs))]
            with torch.inference_mode():
                logits = lambda: self.captured_step(*self.inputs)[:B, -1, :vocab_size]  # noqa: E731  (B, vocab)
                self.sampling_graphs[key] = self.capture(lambda: sample_next(logits(), sampling, generator),
                                                         generator, restore_rng=True)
        graph, drawn = self.sampling_graphs[key]                         # drawn: (B,)

        def step_and_draw(token, cache, starts=None):
            self.write_inputs(token, cache, starts)
            graph.replay()
            cache.advance(1)
            return drawn

        return step_and_draw


class CompiledGraphStep(CudaGraphStep):
    """On CUDA (inductor, aot_eager): torch.compile's fixed-shape step, captured as a CUDA graph."""

    uses_torch_compile = True

    def to_capture(self):
        return self.torch_compiled(self.backend)


def step_class(model, backend: str) -> type:
    """The class of the step `backend` builds for `model`, on its weights' device."""
    device = model.wte.weight.device
    if backend not in STEP_BACKENDS or (backend == "cuda_graph" and device.type != "cuda"):
        raise ValueError(f"backend must be one of {', '.join(STEP_BACKENDS)} (cuda_graph on CUDA), got "
                         f"{backend!r} for a model on {device.type}")
    if device.type == "cuda":
        return CudaGraphStep if backend == "cuda_graph" else CompiledGraphStep
    return AheadOfTimeStep if backend == "inductor" and int8_weights(model) else CompiledCpuStep


def step_function(model):
    """The step as a function of its inputs, one of its own (each step compiles its own code object):
    (token, input_pos, cache, starts, carrier (cells_read,) or None) -> logits (B, 1, vocab)."""
    def logits_at(token, input_pos, cache, starts, carrier=None):
        cells_read = None if carrier is None else carrier.size(0)
        return model.logits_at(token, input_pos, cache, starts, cells_read=cells_read)

    return logits_at


def int8_weights(model) -> bool:
    """Whether every product of the model's layers is an int8 one (quantize_int8): no nn.Linear left."""
    return not any(isinstance(module, torch.nn.Linear) for module in model.modules())


class ExportedStep(torch.nn.Module):
    """The one-token step as torch.export takes it: the cache's tensors are inputs (a tensor export
    finds on a Python object it keeps as a constant, and the compiled step would write into a copy)."""

    def __init__(self, model, cache, reads_written: bool):
        super().__init__()
        self.model, self.cache, self.reads_written = model, cache, reads_written

    def forward(self, token, input_pos, starts, carrier, tensors):
        cells_read = carrier.size(0) if self.reads_written else None
        return self.model.logits_at(token, input_pos, self.cache.over(tensors), starts, cells_read=cells_read)


def dynamic_cells(cache) -> list[bool]:
    """For each of cache.tensors, whether its number of cells is the cache's length (a plain group's,
    or the read buffer's), a size the exported step leaves dynamic; a ring's is its window's."""
    plain = [not cache.groups[g].ring and stored.cells == cache.max_len
             for g, _, stored in cache.stores() for _ in stored.tensors]
    return plain + [True] * len(cache.read_buffer)


def export_step(model, cache, example, reads_written: bool, dynamic: list[bool], path, kernels) -> None:
    """Export the step over `cache` (example: token, input_pos, starts, carrier, the cache's tensors)
    with the number of cells read (where it reads the written cells) and the cache's length (the
    tensors `dynamic` marks) as dynamic sizes, and compile it with AOTInductor into the package
    `path`, whose metadata records the sizes export kept dynamic ("low high" of each: a view of the
    whole cache is contiguous, so export may stop short of it)."""
    import torch._inductor
    from torch._inductor.exc import InductorError

    block = model.config.block_size
    cells_read_dim = {0: torch.export.Dim.DYNAMIC(min=2, max=block)} if reads_written else None
    cells_dims = [{2: torch.export.Dim.DYNAMIC(min=2, max=block)} if d else None for d in dynamic]
    with kernels(), torch.inference_mode(False), torch.no_grad():
        program = torch.export.export(ExportedStep(model, cache, reads_written), example,
                                      dynamic_shapes=(None, None, None, cells_read_dim, cells_dims))
    inputs = [node.meta["val"] for node in program.graph.find_nodes(op="placeholder")]
    n = len(example[4])
    cells_read_size, cell_sizes = inputs[-n - 1].size(0), [t.size(2) for t in inputs[-n:]]
    symbol = lambda size: size.node.expr if isinstance(size, torch.SymInt) else None  # noqa: E731
    if reads_written and symbol(cells_read_size) in {symbol(size) for size in cell_sizes} - {None}:
        raise RuntimeError("export took the cells read for the cache's: the package would be wrong")
    cells_read = size_range(program, cells_read_size)
    cells = [size_range(program, size) for size, d in zip(cell_sizes, dynamic) if d]
    cells = (max(r[0] for r in cells), min(r[1] for r in cells)) if cells else (cache.max_len, cache.max_len)
    # Inductor's C++ int8 products, untimed (they won at every shape, and each timing costs ~3.5 s);
    # where its template takes no product (a CPU, a shape), each is timed against ATen's.
    options = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP",
               "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False,
               "aot_inductor.metadata": {name: f"{low} {high}" for name, (low, high) in
                                         (("cells_read", cells_read), ("cells", cells))}}
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=options)
    except InductorError:
        options["max_autotune_gemm_backends"] = "CPP,ATEN"
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=options)


def size_range(program, size) -> tuple[int, int]:
    """(low, high) of a size of an exported program: a dynamic one's range, or a fixed one's value."""
    if not isinstance(size, torch.SymInt):
        return size, size
    bounds = program.range_constraints[size.node.expr]
    return int(bounds.lower), int(bounds.upper)
