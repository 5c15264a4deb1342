"""A decode recorded from inside the layers and the cache, for the page `generate.py inspect=page.html`
writes. After
each forward pass: which position each cache cell holds, where each head attended, and how far an
int8 cache's numbers are from those it was given."""

import torch

WEIGHT_DECIMALS = 6  # the recorded weights are within 5e-7 of the model's
MAX_WEIGHTS = 2**23  # attention weights one recording may hold: ~8 bytes each in the page, so ~70 MB


def weights_to_record(config, prompt_len: int, max_new_tokens: int, kv_cache: bool = True) -> int:
    """At most how many attention weights recording `max_new_tokens` tokens after a prompt of
    prompt_len keeps: per token, every head of every layer over the cells it read. The token made
    after n tokens: with the cache, a windowed layer's sinks and at most its window (a ring's cells,
    all of them once it is full), another layer's at most block_size; without, the context the
    forward ran (at most context_size, every layer)."""
    if not kv_cache:
        return config.n_layer * config.n_head * keys_summed(prompt_len, max_new_tokens, config.context_size)
    per_head = sum(keys_summed(prompt_len, max_new_tokens, config.block_size) if window is None else
                   max_new_tokens * config.attn_sinks + keys_summed(prompt_len, max_new_tokens, window)
                   for window in config.windows)
    return config.n_head * per_head


def keys_summed(first: int, count: int, cap: int | None = None) -> int:
    """The sum of min(n, cap) over n = first .. first + count - 1 (cap None: of n), in closed form."""
    below = count if cap is None else max(0, min(count, cap - first))   # the terms n < cap
    return below * (2 * first + below - 1) // 2 + (count - below) * (cap or 0)


class DecodeRecorder:
    """A decode seen from the inside, for the page `generate.py inspect=page.html` writes:

        with DecodeRecorder(model, prompt_ids) as recorder:
            for token in recorder.watch(stream(model, idx, sampling)): ...
        recorder.record()  # the model, its cache and one entry per new token, ready for JSON

    After every forward pass of the stream it keeps which position each cache cell holds and which
    cells were just written, where each head of each layer attended (the decode's own weights, laid
    over the cells) and, for an int8 cache, how far the K and V it stored are from those it was
    given. Hooks on the model record the batch's first row, while entered; a decode nobody watches
    runs without them. Entered, every attention layer keeps its weights, which runs it on the naive
    backend (SDPA's function, to float rounding; an int8 cache's step reads the numbers its int8
    values and scales stand for). The stream must run the model's forward (no compiled decode_step),
    and only into its own cache: a batch whose rows share a prompt prefix records with
    share_prefix=False. The first row's left padding is no token: its cells are empty (-1), as a
    row's cells before it is written."""

    def __init__(self, model, prompt):
        self.model, self.tokens, self.prompt_len = model, [int(t) for t in prompt], len(prompt)
        self.steps, self.cache, self.stream_cache = [], None, None
        self.last, self.first_start, self.refilled = None, None, False  # the forwards since the last token

    def __enter__(self):
        for block in self.model.blocks:
            block.attn.keep_weights = True
        self.hooks = [self.model.register_forward_pre_hook(self.before_forward, with_kwargs=True),
                      self.model.register_forward_hook(self.after_forward, with_kwargs=True)]
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        for block in self.model.blocks:
            block.attn.keep_weights, block.attn.weights = False, None

    def watch(self, tokens):
        """`stream`'s steps, (B,) each, passed on as they come; each closes its token's entry."""
        for token in tokens:
            self.close_step(int(token[0]))
            yield token

    def before_forward(self, model, args, kwargs):
        cache = kwargs.get("kv_cache")
        for _, _, stored in [] if cache is None or not cache.quantized else cache.stores():
            stored.keep_error, stored.error = True, None  # set by each write of this forward

    def after_forward(self, model, args, kwargs, output):
        """What this forward pass left: each group's cells, the last query's weights per layer."""
        T, cache, starts = args[0].size(1), kwargs.get("kv_cache"), kwargs.get("starts")
        if cache is not None and self.stream_cache not in (None, cache):
            raise ValueError("DecodeRecorder records the forward passes into one cache, but its rows share a "
                             "prompt prefix, computed once in a cache of its own: record the stream with "
                             "share_prefix=False")
        self.stream_cache = self.stream_cache or cache
        end = T if cache is None else cache.length       # columns 0 .. end-1 hold the context
        start = end - T                                   # the columns this forward wrote
        first_start = None if starts is None else starts[:1]        # (1,): the first row's
        shift = len(self.tokens) - end                    # column end-1 holds the latest token
        input_pos = torch.arange(start, end, device=args[0].device)  # (T,)
        groups = [self.held_columns(cache, g, input_pos, end, first_start)
                  for g in range(1 if cache is None else len(cache.groups))]
        weights = []
        for block in self.model.blocks:
            g = 0 if cache is None else block.attn.kv_group
            keys = None if cache is None else cache.groups[g].key_positions(input_pos, end, first_start)
            w = block.attn.weights[0, :, -1].float().cpu()                  # (n_head, S): the last query's
            keys = torch.arange(w.size(-1)) if keys is None else keys.reshape(-1).cpu()  # (S,) columns
            weights.append(over_cells(w, keys, groups[g]))
        if cache is not None:
            self.cache = self.cache or describe_cache(model.config, cache)
            if start == 0 and self.steps:
                self.refilled = True
            self.first_start = start if self.first_start is None else self.first_start
        errors = None  # int8: per group, K's and V's relative error (None: V is inside K)
        if cache is not None and cache.quantized:
            errors = [[None, None] for _ in groups]
            for g, name, stored in cache.stores():
                errors[g][name == "v"] = None if stored.error is None else float(stored.error)
                stored.keep_error = False
        offset = shift + (0 if starts is None else int(starts[0]))  # the token at position 0
        self.last = dict(shift=shift, offset=offset, start=start, groups=groups, weights=weights,
                         errors=errors)

    @staticmethod
    def held_columns(cache, g, input_pos, end, first_start) -> torch.Tensor:
        """(cells,): the column each cell of group g holds once `end` are written, -1 for none and
        for the row's padding (its columns before first_start: no token of its own, the mask hides them);
        for no cache, the context's columns 0 .. end-1."""
        if cache is None:
            held = torch.arange(end)
        else:
            held = cache.groups[g].key_positions(input_pos[-1:], None, first_start)
            held = held.reshape(-1).cpu()                                    # (cells,)
        padding = held < (0 if first_start is None else int(first_start))  # starts < 0: no column is one
        return held.masked_fill((held >= end) | padding, -1)

    def close_step(self, token: int) -> None:
        """The entry of the token the forward passes since the last one made."""
        last, written_from = self.last, self.first_start
        if last is None:
            raise ValueError("DecodeRecorder saw no forward pass of the model for this token: a compiled "
                             "decode_step runs none; record a stream without one")
        groups = []
        for held in last["groups"]:
            used = int((held >= 0).nonzero().max()) + 1 if (held >= 0).any() else 0
            held = held[:used]
            seq = torch.where(held >= 0, held + last["shift"], -1)
            written = [] if written_from is None else (held >= written_from).nonzero().flatten().tolist()
            groups.append({"seq": seq.tolist(), "written": written})
        weights = []  # [layer][head][cell], over the cells its group uses
        for block, w in zip(self.model.blocks, last["weights"]):
            used = len(groups[0 if self.cache is None else block.attn.kv_group]["seq"])
            weights.append([[round(x, WEIGHT_DECIMALS) for x in head[:used]] for head in w.double().tolist()])
        self.steps.append({"token": token, "offset": last["offset"], "groups": groups, "weights": weights,
                           "errors": last["errors"], "refill": last["start"] if self.refilled else None})
        self.tokens.append(token)
        self.last, self.first_start, self.refilled = None, None, False

    def record(self) -> dict:
        """Everything recorded, as plain numbers and lists: the model, the cache (None: decoded
        without one), the tokens (prompt, then new) and one entry per new token."""
        c = self.model.config
        return {"model": describe_model(c, self.model.num_params()), "cache": self.cache,
                "tokens": self.tokens, "prompt_len": self.prompt_len, "steps": self.steps}


def over_cells(w: torch.Tensor, keys: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """w (n_head, S), the weights over keys at columns `keys` (S,; -1 unseen), laid over the cells
    holding columns `held` (cells,; -1 none): (n_head, cells), 0 where a cell's column was not read."""
    size = int(max(keys.max(), held.max(), 0)) + 1
    key_of_column = torch.full((size,), -1, dtype=torch.long)                  # (columns,)
    seen = keys >= 0
    key_of_column[keys[seen]] = torch.nonzero(seen).flatten()
    key = key_of_column[held.clamp(min=0)]                                     # (cells,)
    read = (held >= 0) & (key >= 0)
    return torch.where(read, w[:, key.clamp(min=0)], 0.0)                      # (n_head, cells)


def describe_model(c, params: int) -> dict:
    """The config fields the page shows, as plain values."""
    return {"params": params, "n_layer": c.n_layer, "n_head": c.n_head, "n_kv_head": c.n_kv_head,
            "head_dim": c.head_dim, "n_embd": c.n_embd, "block_size": c.block_size, "pos_emb": c.pos_emb,
            "mla": None if c.mla_latent_dim is None else {"latent": c.mla_latent_dim, "rope": c.mla_rope_dim},
            "kv_share": c.kv_share, "windows": c.windows, "sinks": c.attn_sinks,
            "sink_logit": c.attn_sink_logit, "layer_group": [i // c.kv_share for i in range(c.n_layer)]}


def describe_cache(c, cache) -> dict:
    """The cache's kind and bytes: the formula's and the tensors' own, per group of layers."""
    groups = [{"slots": group.cells, "ring": group.ring, "window": window,
               "layers": [i for i in range(c.n_layer) if i // c.kv_share == g],
               "bytes": sum(t.nbytes for stored in (group.k, group.v) if stored for t in stored.tensors)}
              for g, (group, window) in enumerate(zip(cache.groups, cache.windows))]
    return {"dtype": str(cache.dtype).removeprefix("torch."), "itemsize": cache.dtype.itemsize,
            "quantized": cache.quantized, "formula": c.kv_cache_formula(), "sinks": cache.sinks,
            "bytes_per_token": cache.bytes_per_token, "nbytes": cache.nbytes, "rows": cache.batch_size,
            "groups": groups, "scales_bytes": sum(stored.tensors[1].nbytes for _, _, stored in cache.stores()
                                                  if cache.quantized)}
