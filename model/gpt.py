"""The GPT of every variant, built on the core GPT (model/core/gpt.py). It has layers of any
attention variant, reads caches of groups, rings and storage kinds (checking they fit), takes
batched prompts left-padded and chunks of any length, reads Hugging Face folders, and pads its
output layer for CUDA's fast kernels."""

import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.attention import CausalSelfAttention
from model.config import GPTConfig, check_integer
from model.core.gpt import GPT as CoreGPT
from model.core.gpt import Block as CoreBlock
from model.device import on_meta
from model.kv_cache import KVCache, is_int4, layout, storage_dtype
from model.latent import LatentAttention
from model.pretrained import FAMILIES, read_folder
from model.rope import rope_at
from model.windows import visible


class Block(CoreBlock):
    """The core block with the variant's attention layer (MLA's where mla_latent_dim is set). It returns
    the keys and values its layer attended over too: a kv_share group's later layers attend over them."""

    def attention(self, config: GPTConfig, layer_idx: int):
        return (CausalSelfAttention if config.mla_latent_dim is None else LatentAttention)(config, layer_idx)

    def forward(self, x, rope=None, kv_cache=None, input_pos=None, attn_mask=None, shared_kv=None,
                cells_read=None, starts=None):
        """(the new x, the keys and values attended over). The other arguments are the attention's
        (CausalSelfAttention.forward), passed in its order."""
        out, kv = self.attn(self.norm_1(x), rope, kv_cache, input_pos, attn_mask, shared_kv, cells_read,
                            starts)
        x = x + self.dropout(out)
        return x + self.dropout(self.mlp(self.norm_2(x))), kv


class GPT(CoreGPT):
    """The core GPT with every extension: its blocks are `Block`s, and it reads caches of any kind."""

    block = Block

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        # Each window the layers have (None: the whole context), with the cache group of its first
        # layer: attention_masks makes one mask each, every step.
        self.window_groups = {w: config.kv_windows.index(w) for w in dict.fromkeys(config.windows)}
        scaling = None if config.rope_scaling is None else tuple(config.rope_scaling)
        self.rope = (config.rope_dim, config.rope_base, scaling)  # rope_at's arguments after the positions
        if config.mla_rope_pairs is not None:  # a retrofit's RoPE key: chosen pairs of the heads' table
            self.rope = (config.head_dim, config.rope_base, scaling, tuple(config.mla_rope_pairs))
        # The layouts of the caches this model reads (KVCache.layout): its windows as rings, or none
        self.kv_layouts = {layout(windows, *self.kv_shape(), config.attn_sinks)
                           for windows in (config.kv_windows, [None] * config.kv_layers)}

    @classmethod
    def from_pretrained(cls, path, dropout: float = 0.0, dtype=torch.float32) -> "GPT":
        """The model of a local Hugging Face folder (config.json and safetensors, as `save_pretrained`
        writes them) of GPT-2 or the Llama family: model.pretrained reads it, no `transformers` needed."""
        family, config, state = read_folder(path, dropout)
        return cls.from_state(config, state, dtype, path, FAMILIES[family])

    @classmethod
    def from_state(cls, config: GPTConfig, state: dict, dtype, source, kind: str) -> "GPT":
        """The model of `config` holding `state`, every weight of it (a tied head aside), in `dtype`.
        Built on the meta device and then given memory, so no weight is initialised only to be
        overwritten (seconds at a billion parameters) nor held twice. A state that does not fit is a
        ValueError naming `source` (the file read) and `kind` (the model it should be)."""
        with on_meta():
            model = cls(config).to(dtype)
        model.to_empty(device="cpu")
        if config.tie_embeddings:
            model.lm_head.weight = model.wte.weight  # (to_empty gives each module a tensor of its own)
        expected = set(model.state_dict()) - ({"lm_head.weight"} if config.tie_embeddings else set())
        missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
        if missing or unexpected:
            raise ValueError(f"{source}: weights do not match {kind} (missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]})")
        try:
            model.load_state_dict(state, strict=False)
        except RuntimeError as e:  # a tensor whose shape its config does not give
            raise ValueError(f"{source}: weights do not match its config "
                             f"({str(e).strip().splitlines()[-1].strip()})") from e
        return model

    def num_params(self) -> int:
        """Parameters, each counted once (a tied head shares the embedding's), pad_head_rows' zeros not."""
        padding = (self.lm_head.weight.size(0) - self.config.vocab_size) * self.config.n_embd
        return sum(p.numel() for p in self.parameters()) - padding

    def pad_head_rows(self, multiple: int = 64) -> "GPT":
        """For decoding on CUDA: the output layer's weight with rows for vocab_size rounded up to a
        multiple of `multiple` (nanoGPT pads GPT-2's 50,257 to 50,304 for the same reason), the new
        rows zero and a tied embedding sharing the padded weight (its ids never reach them). Its
        logits then lie a multiple of 8 apart, as cuBLAS's fast kernels need: on an H200 at batch
        256, GPT-2's 50,257 a row ran an unaligned kernel of 214 µs a step. logits_at returns the
        first vocab_size. In place; returns the model."""
        check_integer(multiple, "multiple", 1)
        head, vocab = self.lm_head, self.config.vocab_size
        rows = -(-vocab // multiple) * multiple
        weight = head.weight
        if weight.size(0) != rows:
            padded = F.pad(weight.detach()[:vocab], (0, 0, 0, rows - vocab))  # (rows, n_embd)
            head.weight = nn.Parameter(padded, requires_grad=weight.requires_grad)
            head.out_features = rows
            if self.wte.weight is weight:
                self.wte.weight = head.weight
        return self

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per parameter plus attention's 12·n_layer·n_embd·block_size."""
        c = self.config
        return 6 * self.num_params() + 12 * c.n_layer * c.n_embd * c.block_size

    def new_kv_cache(self, batch_size: int, max_len: int | None = None, dtype=None, ring: bool = True, *,
                     int4_recent: int = 128, int4_group: int = 32) -> KVCache:
        """A cache sized for this model, on its device, handing attention its dtype; it stores in
        `dtype` (by default the model's; else float32, bfloat16 or int8, a torch dtype or its name;
        int8: one scale per position and K/V head; "int4": a scale per int4_group numbers, and the
        last int4_recent positions as given, which a query reads so (kv_cache.Int4)). max_len (default
        block_size) is the positions the cache must hold. A windowed layer holds at most its window
        (and the sinks), in a ring that takes positions without end; with ring=False, every layer
        holds max_len positions (an int4 cache needs that of a windowed model)."""
        c = self.config
        max_len = c.block_size if max_len is None else max_len
        check_integer(batch_size, "batch_size", 1)
        check_integer(max_len, "max_len", 1, c.block_size)
        weight = self.wte.weight
        dtype = weight.dtype if dtype is None else dtype if is_int4(dtype) else storage_dtype(dtype)
        windows = c.kv_windows if ring else [None] * c.kv_layers
        n_kv_head, key_dim, value_dim_in_keys = self.kv_shape()
        return KVCache(windows, batch_size, n_kv_head, max_len, key_dim, value_dim_in_keys=value_dim_in_keys,
                       sinks=c.attn_sinks, dtype=dtype, compute_dtype=weight.dtype, device=weight.device,
                       int4_recent=int4_recent, int4_group=int4_group)

    def kv_shape(self) -> tuple[int, int, int]:
        """(K/V heads, key width, value width inside the key or 0) of this model's cache: K and V per
        K/V head, or MLA's one latent + RoPE key per position, its values the latent inside it."""
        c = self.config
        if c.mla_latent_dim is not None:
            return 1, c.mla_latent_dim + c.mla_rope_dim, c.mla_latent_dim
        return c.n_kv_head, c.head_dim, 0

    def forward(self, idx, targets=None, *, kv_cache=None, starts=None, last_only=False):
        """idx: (B, T) token ids. Returns logits (B, T, vocab_size), or (logits, loss) with targets;
        with `last_only`, the last position's alone (B, 1, vocab_size), all a prefill needs.

        With `kv_cache`, the tokens continue the cached sequence: they take positions
        kv_cache.length .. +T-1, and the cache advances by T (any T: a chunk goes through a ring
        too). `starts` (B,) is the column of each row's position 0: a batch of prompts of different
        lengths is left-padded by starts[b] tokens, never attended to; a row whose context was cut from
        a longer sequence (prefill.context_of) starts below 0, its positions continuing from there.
        """
        T = idx.size(1)
        start = 0 if kv_cache is None else kv_cache.length
        if kv_cache is not None and not self.fits(kv_cache, idx.size(0)):  # before anything is written
            raise ValueError(self.cache_misfit(kv_cache, idx.size(0)))
        limit = self.config.max_positions if kv_cache is None or kv_cache.ring else kv_cache.max_len
        if limit is not None and start + T > limit:
            raise ValueError(f"{start + T} positions exceed the {'cache' if kv_cache else 'block'} "
                             f"size {limit}")
        input_pos = torch.arange(start, start + T, device=idx.device)
        logits = self.logits_at(idx, input_pos, kv_cache, starts, start + T, last_only)
        if kv_cache is not None:
            kv_cache.advance(T)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(),             # (B*T, vocab_size)
                               targets.flatten(), ignore_index=-1)       # (B*T,)
        return logits, loss

    def fits(self, cache: KVCache, rows: int) -> bool:
        """Whether this model can decode `rows` rows into `cache` (one made by new_kv_cache, with room).
        Its layout is compared once per model (`cache.fitted`): a step pays three comparisons."""
        weight = self.wte.weight
        if cache.fitted() is not self:
            if cache.layout not in self.kv_layouts:
                return False
            cache.fitted = weakref.ref(self)
        fitting = rows <= cache.batch_size and cache.compute_dtype is weight.dtype
        return fitting and cache.device == weight.device

    def cache_misfit(self, cache: KVCache, rows: int) -> str:
        """Why `cache` does not fit (`fits`), in a sentence."""
        weight, (windows, heads, key_dim, in_keys, _) = self.wte.weight, cache.layout
        n_kv_head, width, model_in_keys = self.kv_shape()
        reasons = [(rows > cache.batch_size, f"{cache.batch_size} row(s), fewer than the batch's {rows}"),
                   (in_keys != model_in_keys,
                    "an MLA latent per position" if in_keys else "K and V per K/V head"),
                   (len(windows) != self.config.kv_layers,
                    f"{len(windows)} layer groups, not the model's {self.config.kv_layers}"),
                   ((heads, key_dim) != (n_kv_head, width),
                    f"{heads} K/V heads of {key_dim}, not the model's {n_kv_head} of {width}"),
                   (cache.compute_dtype != weight.dtype,
                    f"keys for attention in dtype {cache.compute_dtype}, not the model's {weight.dtype}"),
                   (cache.device != weight.device,
                    f"its memory on {cache.device}, not the model's {weight.device}")]
        why = next((why for wrong, why in reasons if wrong), "other windows or sinks than the model's")
        return f"kv_cache does not fit this model: it holds {why} (make it with model.new_kv_cache)"

    def logits_at(self, idx, input_pos, kv_cache=None, starts=None, cells_read=None, last_only=False):
        """Logits for tokens idx (B, T) at positions input_pos (T,); touches no Python state, so a
        decode step built on it compiles to one fixed-shape graph. Attention reads what the cache
        holds of positions 0 .. cells_read - 1, or with None every cell, masked by the position it
        holds (the compiled step's fixed shape)."""
        masks = self.attention_masks(input_pos, kv_cache, starts, cells_read)  # per layer window
        positions = input_pos if starts is None else (input_pos - starts[:, None]).clamp(min=0)  # (B, T)
        x = self.wte(idx)                                                # (B, T, n_embd)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(positions)
        else:
            cos, sin = rope_at(positions, *self.rope)                # (T or B,T, rope_dim)
            if positions.dim() == 2:
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)            # (B, 1, T, rope_dim)
            rope = (cos, sin)
        x = self.drop(x)
        kv = None  # the keys/values of the current group of kv_share layers, from its first
        for block in self.blocks:
            x, kv = block(x, rope, kv_cache, input_pos, masks[block.attn.window], kv, cells_read, starts)
        if last_only:
            x = x[:, -1:]                                                # (B, 1, n_embd)
        logits = self.lm_head(self.norm_f(x))                            # (B, T or 1, rows >= vocab_size)
        vocab = self.config.vocab_size  # (rows past it: pad_head_rows', on CUDA only)
        return logits if logits.size(-1) == vocab else logits[..., :vocab]  # (B, T or 1, vocab_size)

    def attention_masks(self, input_pos, kv_cache=None, starts=None, cells_read=None) -> dict:
        """{window: mask} for each window the layers have (None: the whole context): the mask of the
        keys a layer with that window reads (GroupCache.key_positions), or None where they are positions
        0 .. S-1 in order and no row is padded, which attention's own causal mask covers (and SDPA's
        fused kernels run). Each from the one rule, `visible`."""
        masks, attn_sinks = {}, self.config.attn_sinks
        for window, group in self.window_groups.items():
            key_pos = None if kv_cache is None else kv_cache.groups[group].key_positions(
                input_pos, cells_read, starts)                                       # (S,), (B, S) or None
            if key_pos is None and starts is not None:
                S = input_pos.size(0) if kv_cache is None else cells_read
                key_pos = torch.arange(S, device=input_pos.device)
            masks[window] = None if key_pos is None else visible(input_pos, key_pos, window, attn_sinks,
                                                                 starts)
        return masks
