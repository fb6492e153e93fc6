"""Hugging Face transformers integration: any decoder-only model decodes (context-parallel) through its own
``generate()``.

``import cp_attention.hf`` registers the attention implementation ``"cp_attention"`` with
``transformers.AttentionInterface`` and its mask function with ``AttentionMaskInterface``; :class:`CPCache`
is the transformers ``Cache`` that holds this rank's shard of every layer's K/V::

    import cp_attention.hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="cp_attention", dtype=torch.bfloat16)
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cp_attention.hf.CPCache(model.config),
                         max_new_tokens=64)

Under ``torchrun`` every rank runs these lines with the same inputs and gets the same tokens.
``custom_generate=decode_ahead`` runs the same loop with the host one step ahead of the GPU.

Note [Context-parallel attention inside transformers]
-----------------------------------------------------
Placement. Global cache position ``p`` (an index into the left-padded batch, as in a ``DynamicCache``)
lives on rank ``p % W`` at local slot ``p // W``: the interleaved placement of
:class:`cp_attention.distributed.CPKVCache`. Every row of a batch has the same padded length, so one
global length ``L`` describes the whole cache; rank ``r`` holds ``ceil((L - r) / W)`` slots of every row.

Replicated model, split attention. Every rank runs the whole model on the whole input (prefill GEMMs,
MLPs and logits are replicated, not split); only attention is divided. A layer's cache ``update`` stores
the new tokens this rank owns and returns the new K/V untouched; the attention function then attends
every query to this rank's shard only -- with the causal rule, the sliding window and the padding in
global positions -- and merges the per-rank states with ⊕ (``merge_across_ranks``, bitwise identical on
every rank, so every rank computes the same hidden states and picks the same tokens). A prefill of ``S``
tokens thus costs each rank ``1 / W`` of the attention work; a decode step reads ``1 / W`` of the cache.
Attention sinks (gpt-oss ``s_aux``) join once, after the merge.

Local limits. A query at global position ``t`` sees the global positions ``[lo, t]`` with ``lo`` the row's
first real token (left padding) or ``t - window_left``, whichever is later. On rank ``r`` the owned
positions below ``x`` are the local slots below ``ceil((x - r) / W)`` (counted, not searched), so every
query row's local key range ``[lo_local, hi_local)`` is two such counts: ``flash_decode(row_limits=...)``
at decode, a mask over local slots (or, for unpadded prompts without window or softcap, square causal
FlashAttention calls per query residue ``t mod W``) at prefill.

Padding. The registered mask function turns the 2-D attention mask into each row's first real position
(a ``[B, 1, 1, 1]`` int32 tensor, which transformers passes through as a prepared mask), or ``None`` when
the prompt has no padding. A mask with a zero after a one (not left padding) raises at the prefill. The
first forward on the empty cache fixes each row's padding; every later forward's mask must hide the same
positions (``generate()`` extends the mask with ones), checked on the device once per forward (a decode
step's mask function marks a row with a hole, the cache compares the rows with the prefill's), so an
unpadded batch decodes without ``row_limits``. The one exception: a row that is padding at every cached
position takes a later eager forward's longer padding (the chunks of a chunked prefill that hold only its
zeros). A row with no real token attends nothing (``o = 0``), where transformers' eager attention averages
the padding's values; its later tokens attend the generated ones only.

Finding the cache. The attention function receives the module, not the cache. The cache layer's
``update`` records itself in a module-level slot that the attention function of the same layer reads and
clears right after; both run in this order within one module's forward, in eager and in traced code
(one forward at a time per process). Without a record (no cache, e.g. a plain forward), the function
attends the K/V it is given on one process.

Once per forward. What depends only on the global length and the mask (this rank's shard length, the
slots of the new tokens, the row limits of each window size) is computed once per forward, when layer 0
updates, and shared by all layers (eager); traced code recomputes it per layer, and the compiler fuses it.

CUDA graphs. With ``max_cache_len`` the layers are preallocated and the global length is a device tensor:
``update`` decides owner and slot on the device (a non-owner writes into a scratch slot that is never
read), so a decode step has no host sync and no data-dependent Python branch, and transformers'
compiled generation (``generate()`` compiles the forward itself for a compileable non-dynamic cache,
"reduce-overhead": CUDA graphs) runs. The first prefill runs eagerly; a traced forward of several tokens
(chunked prefill, assisted decoding) attends with ``flash_decode`` in groups of up to 16 query rows, each with
its row limits.
"""
from __future__ import annotations

import collections
import contextlib
import numbers
import threading
import zlib

import torch
import torch.distributed as dist
import transformers.generation.utils as generation_utils
from transformers import AttentionInterface, Cache, GenerationMixin
from transformers.cache_utils import CacheLayerMixin
from transformers.generation.configuration_utils import GenerationMode
from transformers.masking_utils import AttentionMaskInterface

from ._constants import FLOAT_DTYPES, FP8_DTYPES
from ._validate import INT32_MAX, MAX_Q_ROWS, check_device, check_int
from .decode import flash_decode
from .distributed import merge_across_ranks
from .distributed.exchange import all_gather_traceable
from .quant import amax_scale, dequantize, quantize
from .state import AttentionState, merge_states

__all__ = ["IMPLEMENTATION", "CPCache", "cp_attention_forward", "cp_attention_mask", "decode_ahead"]

IMPLEMENTATION = "cp_attention"
LAYER_TYPES = ("full_attention", "sliding_attention")
# Model types whose attention is not one causal softmax(q.k) per layer over the cached K/V as the cache holds them
_UNSUPPORTED_MODEL_TYPES = {
    "bloom": "ALiBi position biases", "mpt": "ALiBi position biases", "baichuan": "ALiBi position biases",
    "jais": "ALiBi position biases",
    "diffllama": "differential attention: two softmaxes a layer, over halves of the values",
    "jetmoe": "a mixture of attention heads that tiles the KV heads after the cache update",
    "doge": "dynamic-mask attention: a learned, input-dependent score bias",
    "moshi": "its sliding window is applied by the cache at decode only, not at the prefill",
}
PREFILL_BUDGET_BYTES = 256 << 20  # scores (or gathered states) of one query chunk of the prefill attention


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _counts(x, rank: int, world: int):
    """How many of this rank's positions (``p % world == rank``) lie below ``x >= 0`` (an int or an integer
    tensor): ``ceil((x - rank) / world)``, which is ``floor((x - rank + world - 1) / world)`` for ``x >= 0``."""
    if world == 1:
        return x
    if isinstance(x, torch.Tensor):
        return torch.div(x - rank + world - 1, world, rounding_mode="floor")
    return (x - rank + world - 1) // world


class _Slot:
    """Where a cache layer's ``update`` leaves itself and the K/V it returned for the attention function (Note
    [Context-parallel attention inside transformers], "Finding the cache")."""

    layer = None
    kv = None


_ACTIVE = _Slot()


# ------------------------------------------------------------------------------------------------------
# Configurations


def _check_config(config) -> tuple:
    """``(text config, head_dim, per-layer sliding windows)`` of a model this attention can run; a
    ``ValueError`` naming what it cannot express otherwise."""
    try:
        return _read_config(config)
    except RuntimeError as exc:  # transformers' AmbiguousGlobalPerLayerAttributeError: per-layer values differ
        if "PerLayer" not in type(exc).__name__:
            raise
        raise ValueError(f"CPCache: attention attributes that differ between layers (a heterogeneous per-layer "
                         f"config) are not supported: {exc}") from None


def _read_config(config) -> tuple:
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("CPCache: encoder-decoder models (cross-attention) are not supported")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", "")
    if model_type in _UNSUPPORTED_MODEL_TYPES:
        raise ValueError(f"CPCache: model_type {model_type!r} is not supported ({_UNSUPPORTED_MODEL_TYPES[model_type]})")
    if getattr(text, "alibi", False) or getattr(text, "position_embedding_type", None) == "alibi":
        raise ValueError("CPCache: ALiBi position biases are not supported")
    if getattr(text, "kv_lora_rank", None) or getattr(text, "q_lora_rank", None):
        raise ValueError("CPCache: multi-head latent attention (kv_lora_rank / q_lora_rank) is not supported: the "
                         "kernels need one head dim for K and V")
    if getattr(text, "attention_chunk_size", None):
        raise ValueError("CPCache: chunked attention (attention_chunk_size) is not supported")
    if getattr(text, "num_kv_shared_layers", 0):
        raise ValueError("CPCache: layers that share another layer's KV cache (num_kv_shared_layers) are not supported")
    if not getattr(text, "is_causal", True):
        raise ValueError("CPCache: bidirectional attention (is_causal=False) is not supported")
    if getattr(text, "cross_attention_layers", None):
        raise ValueError("CPCache: cross-attention layers are not supported")
    if getattr(text, "H_cycles", None) or getattr(text, "num_layers_per_stack", None):
        raise ValueError("CPCache: attention layers reused across cycles (H_cycles / num_layers_per_stack: one module "
                         "for several cache layers) are not supported")
    n_layers = getattr(text, "num_hidden_layers", None)
    hq = getattr(text, "num_attention_heads", None)
    if not isinstance(n_layers, int) or n_layers < 1 or not isinstance(hq, int) or hq < 1:
        raise ValueError("CPCache: the config gives no attention layers (num_hidden_layers and num_attention_heads): "
                         "a model without softmax attention (e.g. a state-space or recurrent model) has no KV cache "
                         "to shard")
    hkv = getattr(text, "num_key_value_heads", None) or hq
    if hq % hkv:
        raise ValueError(f"CPCache: num_attention_heads ({hq}) must be a multiple of num_key_value_heads ({hkv})")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // hq
    for name in ("v_head_dim", "qk_head_dim"):
        other = getattr(text, name, None)
        if other is not None and other != head_dim:
            raise ValueError(f"CPCache: {name} {other} differs from head_dim {head_dim}: the kernels need one head dim "
                             f"for queries, keys and values")
    if head_dim % 8 or not 32 <= head_dim <= 256:
        raise ValueError(f"CPCache: head_dim {head_dim} is not supported (a multiple of 8 in [32, 256])")
    sliding = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:  # Mistral: one window (or none) for every layer
        layer_types = ["sliding_attention" if sliding else "full_attention"] * n_layers
    bad = sorted(set(layer_types) - set(LAYER_TYPES))
    if bad:
        raise ValueError(f"CPCache: layer types {bad} are not supported (only {list(LAYER_TYPES)})")
    if len(layer_types) < n_layers:
        raise ValueError(f"CPCache: layer_types has {len(layer_types)} entries for {n_layers} layers")
    if "sliding_attention" in layer_types and not (isinstance(sliding, int) and sliding >= 1):
        raise ValueError(f"CPCache: sliding layers need a positive int sliding_window, got {sliding!r}")
    windows = tuple(sliding if t == "sliding_attention" else None for t in layer_types[:n_layers])
    return text, head_dim, windows


# ------------------------------------------------------------------------------------------------------
# The cache

_STEP_DIFFERS = ("CPCache: every rank must run the same decode step; layer 0's new keys differ between ranks (the "
                 "tokens fed back part: the generation settings -- sampling and its seed, logits processors -- must "
                 "be the same on every rank)")
_PADDING_RANKS = ("CPCache: every rank must run the same forward; the attention_mask's left padding differs between "
                  "ranks")
_PADDING_DIFFERS = ("CPCache: this forward's attention_mask hides other positions than the first forward's left "
                    "padding (a zero after a one, padding added or dropped, or no mask for a padded batch); the "
                    "cache attends the first forward's padding: pass that mask extended with ones, or reset() the "
                    "cache for a new batch")
_PADDING_LATER = ("CPCache: this forward's attention_mask hides other positions than the first forward's left "
                  "padding on some rank, or differs between ranks (a zero after a one, padding added or dropped, or "
                  "no mask for a padded batch); the cache attends the first forward's padding: pass that mask "
                  "extended with ones, or reset() the cache for a new batch")


def _key_sums(key_states) -> torch.Tensor:
    """``[3]`` float64: the sum of ``|k|``, a sum weighted by the (row, position) order and the plain sum of
    ``key_states [B, Hkv, S, D]`` (per position first: no copy of a prompt's keys)."""
    b, _, s, _ = key_states.shape
    k = key_states.detach()
    magnitude = torch.linalg.vector_norm(k, ord=1, dim=(1, 3), dtype=torch.float32).double()  # [B, S]
    total = k.sum(dim=(1, 3), dtype=torch.float32).double()
    weight = torch.arange(1, b * s + 1, device=k.device, dtype=torch.float64).view(b, s) / (b * s)
    return torch.stack([magnitude.sum(), (total * weight).sum(), total.sum()])


class _Shared:
    """What the layers of one :class:`CPCache` share: the group, the global length, this rank's shard
    length ``seq_lens`` and what a forward computes once for all layers."""

    def __init__(self, rank, world, group, max_cache_len, page_size, dtype, device):
        self.rank, self.world, self.group = rank, world, group
        self.static = max_cache_len is not None
        self.max_cache_len = max_cache_len
        self.capacity = None if max_cache_len is None else -(-max_cache_len // world)
        self.page_size, self.dtype, self.device = page_size, dtype, device
        self.batch = None
        self.length = 0  # dynamic layers: the global length (host)
        self.start = self.end = None  # static layers: 0-d int64 device tensors, global length before / after
        self.seq_lens = None  # [B] int32 on the device: this rank's shard length
        self.step = 0  # tokens of the current forward
        self.host_start = 0  # global length before the current forward, when known on the host (else None)
        self.padded = False  # the cache's rows have left padding (fixed by the first forward on the empty cache)
        self.pad = None  # [B] int32 on the device: each row's first real position (zeros without padding)
        self.fresh = False  # this forward starts on the empty cache (eager; traced forwards: False)
        self.step_values = None  # a decode step's agreement values, gathered at layer 0's attention (padding)
        self.host_end = 0  # static layers: the global length after the last forward, where the host knows it
        self.config, self.windows = None, ()  # the model's (text) config and its layers' windows
        self.memo = {}
        self.ahead = False  # decode_ahead runs the loop: a decode step's agreement is read a step late
        self.pending = collections.deque()  # (flag on the host, event after its copy, message) of those steps

    def allocate(self, batch, device) -> None:
        self.batch, self.device = batch, device
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.pad = torch.zeros(batch, dtype=torch.int32, device=device)
        if self.static:
            self.start = torch.zeros((), dtype=torch.int64, device=device)
            self.end = torch.zeros((), dtype=torch.int64, device=device)
            if not _compiling():
                for t in (self.seq_lens, self.pad, self.start, self.end):
                    torch._dynamo.mark_static_address(t)

    def begin(self, key_states) -> None:
        """A forward of ``S = key_states.shape[2]`` new tokens starts (layer 0 updates)."""
        b, hkv, s, d = key_states.shape
        if not _compiling():
            impl = getattr(self.config, "_attn_implementation", None)
            if impl not in (None, "cp_attention"):
                raise ValueError(f"CPCache: the model attends with attn_implementation={impl!r}; a CPCache needs "
                                 f"'cp_attention' (model.set_attn_implementation('cp_attention') after importing "
                                 f"cp_attention.hf), whose attention reads the sharded cache")
            if b != self.batch:
                raise ValueError(f"CPCache: this cache holds {self.batch} rows (fixed at its first forward, and kept "
                                 f"by reset()); a forward of {b} rows needs a new CPCache")
        if self.static:
            if not _compiling():
                # a prefill (eager) reads the device length: its host sync is cheap next to it
                start = int(self.end) if s > 1 or self.host_end is None else self.host_end
                if start + s > self.max_cache_len:
                    raise ValueError(f"CPCache: {start + s} tokens exceed max_cache_len = {self.max_cache_len} (a "
                                     f"forward of {s} after {start}); give the cache room for the prompt and every "
                                     f"new token")
                self.host_start = start if s > 1 else None
                self.host_end = start + s
                self.fresh = start == 0
            else:
                self.host_start = self.host_end = None
                self.fresh = False
                # a captured step cannot raise on the host: past max_cache_len it stops the device instead
                torch._assert_async(self.end + s <= self.max_cache_len,
                                    "CPCache: the tokens exceed max_cache_len")
            self.start.copy_(self.end)
            self.end.add_(s)
            self.seq_lens.copy_(_counts(self.end, self.rank, self.world).expand(b))
        else:
            self.host_start = self.length
            self.fresh = self.length == 0
            self.length += s
            self.seq_lens.fill_(_counts(self.length, self.rank, self.world))
        self.step = s
        if not _compiling():
            self.memo = {}
        self.step_values = None
        if self.world > 1:
            if s > 1 and not _compiling():
                self._agree(key_states)
            else:  # a decode step, or a traced forward of several tokens: gathered with the padding's verdict
                self.step_values = self._step_values(key_states)

    def _agree(self, key_states) -> None:
        """Every rank runs the same forward: the batch, tokens, global length, KV heads and head dim, the cache's
        dtype and the layers' windows exactly, and layer 0's new keys (which the prompt, its padding and the
        weights set) by two sums within 1e-3 of the sum of their magnitudes. Checked at each forward of several
        tokens (the prefill: eager, with a host read already), in one all-gather, so a mismatch raises on every
        rank instead of hanging or giving tokens that differ between ranks."""
        b, hkv, s, d = key_states.shape
        start = -1 if self.host_start is None else self.host_start
        dtypes = FLOAT_DTYPES + FP8_DTYPES
        dtype = self.dtype or key_states.dtype
        code = dtypes.index(dtype) if dtype in dtypes else len(dtypes)
        windows = zlib.crc32(repr(self.windows).encode())
        mine = torch.cat([torch.tensor([b, s, start, hkv, d, code, windows], dtype=torch.float64,
                                       device=key_states.device), _key_sums(key_states)])
        rows = all_gather_traceable(mine, self.group).view(self.world, -1).tolist()
        shapes = [[int(x) for x in row[:5]] for row in rows]
        if any(row != shapes[0] for row in shapes):
            raise ValueError(f"CPCache: every rank must run the same forward; (batch, new tokens, cached length, KV "
                             f"heads, head dim) per rank: {shapes}")
        if any(row[5:7] != rows[0][5:7] for row in rows):
            names = [str(dtypes[int(r[5])]) if r[5] < len(dtypes) else "another dtype" for r in rows]
            raise ValueError(f"CPCache: every rank must hold the same cache dtype and layer windows; per rank: "
                             f"{names}, window digests {[int(r[6]) for r in rows]}")
        tol = 1e-3 * max(r[7] for r in rows) + 1e-30
        if any(abs(r[j] - rows[0][j]) > tol for r in rows for j in (8, 9)):
            raise ValueError("CPCache: every rank must run the same forward with the same inputs and weights; layer "
                             "0's new keys differ between ranks (other prompts, padding or weights)")

    def _step_values(self, key_states) -> torch.Tensor:
        """A decode step (one new token a row; or a traced forward of several, a compiled chunk or verification
        step, which cannot read the host) is the same forward on every rank: the same global position, and
        layer 0's new keys (which the tokens fed back set) by the sums of :meth:`_agree`. Generation settings
        that differ between ranks (sampling and its seed, logits processors) make the tokens part; the step
        after that feeds different tokens, and merging its states would give every rank a wrong answer.

        The four float64 values this rank contributes; :meth:`padding` gathers them with the padding's verdict
        in one all-gather a step and compares them on the device (:meth:`_step_differs`)."""
        start = (self.start.to(torch.float64).view(1) if self.static else
                 torch.full((1,), float(self.host_start), dtype=torch.float64, device=key_states.device))
        return torch.cat([start, _key_sums(key_states)])

    @staticmethod
    def _step_differs(everyone) -> torch.Tensor:
        """``everyone [W, 4]``: every rank's :meth:`_step_values`; a 0-d bool, True where they disagree."""
        tol = 1e-3 * everyone[:, 1].max() + 1e-30
        return (everyone[:, 0] != everyone[0, 0]).any() | ((everyone[:, 2:] - everyone[0, 2:]).abs() > tol).any()

    def verdict(self, bad, message: str) -> None:
        """Act on a device-side check ``bad`` (a 0-d bool tensor) of a forward: eager, ``ValueError(message)``
        before the layer attends (one host read); under :func:`decode_ahead` the read comes a step late (the
        host must not wait for the GPU), the last ones when the loop ends; traced, a device assert (a failure
        stops the process, as past ``max_cache_len``)."""
        if _compiling():
            torch._assert_async(~bad, message)
        elif self.ahead:
            cuda = bad.is_cuda
            flag = torch.empty((), dtype=torch.bool, pin_memory=cuda).copy_(bad, non_blocking=cuda)
            done = torch.cuda.Event() if cuda else None
            if done is not None:
                done.record()
            self.pending.append((flag, done, message))
            self.check_pending(keep=2)
        elif bool(bad):
            raise ValueError(message)

    def check_pending(self, keep: int = 0) -> None:
        """Read the verdicts of the decode steps run under :func:`decode_ahead`, all but the last ``keep``
        (oldest first; every rank reads the same steps', so every rank raises at the same step)."""
        while len(self.pending) > keep:
            flag, done, message = self.pending.popleft()
            if done is not None:
                done.synchronize()
            if bool(flag):
                self.pending.clear()
                raise ValueError(message)

    def padding(self, first, layer_idx: int):
        """The rows' first real positions to attend with (``[B]`` int32, or ``None``: no padding), given those
        of this forward's mask (``first``, ``-1`` for a row that is not left padding, or ``None``). The first
        forward on the empty cache fixes the padding; every later forward's mask must give the same (checked at
        layer 0 through :meth:`verdict`): the positions a decode step's mask hides are those of the prefill. A
        row that is padding at every cached position may grow it in a later eager forward (a prompt prefilled
        in chunks, ``generate(prefill_chunk_size=...)``, whose first chunks hold only its padding).

        With several ranks every rank passes the same padding (by two sums over its rows) and a verdict holds
        on every rank: one all-gather, which at a decode step also carries the step's agreement
        (:meth:`_step_values`), so a step costs one all-gather of six float64 values."""
        if layer_idx != 0:
            return self.pad if self.padded else None
        given = torch.zeros_like(self.pad) if first is None else first.to(torch.int32)
        if self.fresh:
            pad, differs = given, None
            self.padded = first is not None
        else:
            pad = self.pad
            if not _compiling() and self.padded:  # rows padded at every cached position take more padding
                start = self.start if self.host_start is None else self.host_start
                pad = torch.where((self.pad == start) & (given >= self.pad), given, self.pad)
            differs = (given != pad).any()
        if self.world == 1:
            if differs is not None:
                self.verdict(differs, _PADDING_DIFFERS)
        else:
            weight = torch.arange(1, pad.shape[0] + 1, device=pad.device, dtype=torch.float64)
            total = pad.double().sum() if differs is None else torch.where(differs, -1.0, pad.double().sum())
            mine = torch.stack([total, (pad.double() * weight).sum()])  # -1: this rank's mask differs
            step, self.step_values = self.step_values, None
            everyone = all_gather_traceable(mine if step is None else torch.cat([step, mine]), self.group)
            everyone = everyone.view(self.world, -1)
            if step is not None:
                self.verdict(self._step_differs(everyone[:, :-2]), _STEP_DIFFERS)
            everyone = everyone[:, -2:]
            if differs is None:
                self.verdict((everyone != everyone[0]).any(), _PADDING_RANKS)
            else:  # one verdict a step: a rank's mask differs from its padding, or the ranks' padding differs
                self.verdict((everyone[:, 0] < 0).any() | (everyone != everyone[0]).any(), _PADDING_LATER)
        if pad is not self.pad:
            self.pad.copy_(pad)
        return self.pad if self.padded else None

    def end_value(self):
        """The global length after this forward: a host int, or the device tensor (static layers)."""
        return self.end if self.static else self.length

    def slots(self, s: int):
        """Static layers: the local slot of each new token, ``[S]`` int64, ``capacity`` (the scratch slot) for the
        tokens this rank does not own."""
        key = ("slots", s)
        hit = self.memo.get(key) if not _compiling() else None
        if hit is not None:
            return hit
        pos = self.start + torch.arange(s, device=self.start.device)
        local = torch.div(pos, self.world, rounding_mode="floor")
        mine = (pos % self.world == self.rank) & (local < self.capacity)
        out = torch.where(mine, local, self.capacity)
        if not _compiling():
            self.memo[key] = out
        return out

    def decode_limits(self, first, window_left, s: int, b: int, rows=None):
        """``(row_limits [B, n, 2] int32 or None, span, window_left for flash_decode)`` of the decode rows: the
        ``S`` of the forward, or its rows ``rows = (i0, i1)`` (Note [Context-parallel attention inside
        transformers], "Local limits")."""
        w, r = self.world, self.rank
        if rows is None and first is None and w == 1:
            return None, None, window_left  # flash_decode's own causal rule and window are the global ones
        if rows is None and first is None and s == 1 and window_left is None:
            return None, None, None  # the shard's length bounds the one row
        i0, i1 = (0, s) if rows is None else rows
        key = ("limits", window_left, s, first is None, rows)
        hit = self.memo.get(key) if not _compiling() else None
        if hit is not None:
            return hit
        end = self.end_value()
        device = first.device if first is not None else self.seq_lens.device
        t = torch.arange(i0, i1, device=device) + (end - s)  # global positions of the rows
        hi = _counts(t + 1, r, w)
        lo = torch.zeros_like(t) if first is None else first.to(t.dtype)[:, None]
        if window_left is not None:
            lo = torch.maximum(lo, (t - window_left).clamp(min=0))
        lo = _counts(lo, r, w)
        n = i1 - i0
        limits = torch.stack(torch.broadcast_tensors(lo.expand(b, n), hi.expand(b, n)), dim=-1).to(torch.int32)
        span = None if window_left is None else -(-(window_left + n) // w) + 1
        out = (limits, span, None)
        if not _compiling():
            self.memo[key] = out
        return out


class CPCacheLayer(CacheLayerMixin):
    """One layer of a :class:`CPCache`: this rank's interleaved shard of the layer's K/V.

    Attributes (after the first update):
        keys, values: dense: ``[B, Hkv, slots, D]`` (HND; ``capacity`` local slots when preallocated, else the
            grown allocation; the valid ones: ``seq_lens``); paged: page pools
            ``[num_pages, page_size, Hkv, D]`` (NHD) read through :attr:`block_table`.
        block_table: ``[B, pages]`` int32 (paged), else ``None``.
        k_scale, v_scale: ``[Hkv]`` float32 dequantisation scales of an FP8 layer, else ``None``.
        sliding_window: the layer's window (``None``: full attention), from the config.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, shared: _Shared, layer_idx: int, sliding_window=None):
        super().__init__()
        self.shared = shared
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.is_compileable = shared.static
        self.block_table = None
        self.k_scale = self.v_scale = None
        self._scaled = False  # FP8: the scales were set from this layer's first tokens

    # -- transformers' layer interface -------------------------------------------------------------------

    def lazy_initialization(self, key_states, value_states) -> None:
        sh = self.shared
        b, hkv, _, d = key_states.shape
        device = sh.device or key_states.device
        if sh.batch is None:
            sh.allocate(b, device)
        elif sh.batch != b:
            raise ValueError(f"CPCache: batch size {b} differs from the cache's {sh.batch}")
        self.device = device
        self.dtype = sh.dtype or key_states.dtype
        self.heads_kv, self.head_dim = hkv, d
        if self.dtype in FP8_DTYPES:
            self.k_scale = torch.ones(hkv, dtype=torch.float32, device=device)
            self.v_scale = torch.ones(hkv, dtype=torch.float32, device=device)
        if sh.static:
            self._allocate(sh.capacity, scratch=True)
            if not _compiling():
                for t in (self._k, self._v) + ((self.k_scale, self.v_scale) if self.k_scale is not None else ()):
                    torch._dynamo.mark_static_address(t)
        else:
            self._allocate(0, scratch=False)
        self.is_initialized = True

    def _allocate(self, slots: int, scratch: bool) -> None:
        """Buffers for ``slots`` local slots per row (a page more, or a slot more, for ``scratch``)."""
        sh, b, hkv, d = self.shared, self.shared.batch, self.heads_kv, self.head_dim
        if sh.page_size is None:
            shape = (b, hkv, slots + scratch, d)
            self._k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self._v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.keys, self.values = self._k[:, :, :slots], self._v[:, :, :slots]
        else:
            cols = -(-slots // sh.page_size)
            # Row b's page j is page j * B + b: growing adds pages at the end of the pool.
            shape = (cols * b + scratch, sh.page_size, hkv, d)
            self._k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self._v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.keys, self.values = self._k, self._v
            self.block_table = self._pages(cols)
        self._slots = slots

    def _pages(self, cols: int) -> torch.Tensor:
        b = self.shared.batch
        return torch.arange(cols * b, dtype=torch.int32, device=self.device).view(cols, b).t().contiguous()

    def _grow(self, slots: int) -> None:
        """Dynamic layers: room for at least ``slots`` local slots (capacity doubles, amortised O(1) per token)."""
        if slots <= self._slots:
            return
        old_k, old_v, old = self._k, self._v, self._slots
        self._allocate(max(slots, 2 * old, 16), scratch=False)
        if self.shared.page_size is None:
            self._k[:, :, :old].copy_(old_k[:, :, :old])
            self._v[:, :, :old].copy_(old_v[:, :, :old])
        else:
            self._k[: old_k.shape[0]].copy_(old_k)
            self._v[: old_v.shape[0]].copy_(old_v)

    def update(self, key_states, value_states, *args, **kwargs):
        """Store the new tokens ``[B, Hkv, S, D]`` this rank owns; return ``(key_states, value_states)``
        unchanged (the attention function reads the shard, Note [Context-parallel attention inside
        transformers])."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        sh = self.shared
        s = key_states.shape[2]
        if not _compiling():
            stale = _ACTIVE.layer
            if stale is not None and stale.shared is sh:
                raise ValueError(f"cp_attention: cache layer {stale.layer_idx} was updated but its attention did not "
                                 f"run through attn_implementation='cp_attention' (a model whose attention does not "
                                 f"use transformers' AttentionInterface cannot attend a sharded cache)")
            if s != sh.step or key_states.shape[0] != sh.batch:
                raise RuntimeError(f"CPCache: layer {self.layer_idx} updated with {tuple(key_states.shape)} in a "
                                   f"forward of {sh.step} tokens for {sh.batch} rows (layer 0 starts each forward)")
            if key_states.shape[1] != self.heads_kv or key_states.shape[3] != self.head_dim:
                raise ValueError(f"CPCache: layer {self.layer_idx} got K/V of shape {tuple(key_states.shape)}, "
                                 f"expected [B, {self.heads_kv}, S, {self.head_dim}]")
        k_new, v_new = self._to_cache_dtype(key_states, value_states)
        if sh.static:
            slot = sh.slots(s)
            if sh.page_size is None:
                for dst, src in ((self._k, k_new), (self._v, v_new)):
                    if dst.element_size() == 1:  # FP8: copied as bytes (the CPU has no FP8 index_copy)
                        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
                    dst.index_copy_(2, slot, src)
            else:
                self._store_pages(slot, k_new, v_new, scratch=True)
        else:
            start = sh.host_start
            n0, n1 = _counts(start, sh.rank, sh.world), _counts(start + s, sh.rank, sh.world)
            if n1 > n0:
                first = (sh.rank - start) % sh.world  # offset of this rank's first new token
                self._grow(n1)
                k_mine, v_mine = k_new[:, :, first::sh.world], v_new[:, :, first::sh.world]
                if sh.page_size is None:
                    self._k[:, :, n0:n1].copy_(k_mine)
                    self._v[:, :, n0:n1].copy_(v_mine)
                else:
                    self._store_pages(torch.arange(n0, n1, device=self.device), k_mine, v_mine, scratch=False)
        _ACTIVE.layer, _ACTIVE.kv = self, (key_states, value_states)
        return key_states, value_states

    def _store_pages(self, slot, k_new, v_new, scratch: bool) -> None:
        """Write ``k_new``/``v_new [B, Hkv, n, D]`` at local ``slot [n]``; with ``scratch``, the slot
        ``capacity`` stands for the scratch page (the pool's last)."""
        ps = self.shared.page_size
        col = torch.div(slot, ps, rounding_mode="floor")
        if scratch:
            mine = slot < self.shared.capacity
            page = torch.where(mine[None, :], self.block_table[:, col.clamp(max=self.block_table.shape[1] - 1)].long(),
                               self._k.shape[0] - 1)
            off = torch.where(mine, slot % ps, 0)
        else:
            page, off = self.block_table[:, col].long(), slot % ps
        self._k[page, off[None, :]] = k_new.transpose(1, 2)
        self._v[page, off[None, :]] = v_new.transpose(1, 2)

    def _to_cache_dtype(self, k, v):
        """The new K/V in the cache's dtype: FP8 layers quantise them with the layer's scales (set from the
        amax of the layer's first update, widened by later eager forwards of several tokens; see
        :class:`CPCache`), saturating."""
        if self.dtype not in FP8_DTYPES:
            return (k, v) if k.dtype == self.dtype else (k.to(self.dtype), v.to(self.dtype))
        if not _compiling():
            if not self._scaled:
                self.k_scale.copy_(amax_scale(k, self.dtype, 1))
                self.v_scale.copy_(amax_scale(v, self.dtype, 1))
                self._scaled = True
            elif k.shape[2] > 1:
                self._widen_scales(k, v)
        return quantize(k, self.k_scale, self.dtype, 1), quantize(v, self.v_scale, self.dtype, 1)

    def _widen_scales(self, k, v) -> None:
        """A later eager forward of several tokens (a prefill chunk, a prompt continued) whose K/V reach past
        the scales' range widens them to its amax, and the stored tokens are requantised (one more rounding):
        every rank computes the same K/V, so the scales stay equal on every rank."""
        new_k = torch.maximum(self.k_scale, amax_scale(k, self.dtype, 1))
        new_v = torch.maximum(self.v_scale, amax_scale(v, self.dtype, 1))
        if not bool(((new_k > self.k_scale) | (new_v > self.v_scale)).any()):  # one host read (eager)
            return
        layout = "HND" if self.shared.page_size is None else "NHD"  # [B, Hkv, slots, D] or [P, page, Hkv, D]
        k, v = dequantize(self._k, self._v, self.k_scale, self.v_scale, layout)
        head = 1 if layout == "HND" else 2
        self._k.copy_(quantize(k, new_k, self.dtype, head))
        self._v.copy_(quantize(v, new_v, self.dtype, head))
        self.k_scale.copy_(new_k)
        self.v_scale.copy_(new_v)

    def get_seq_length(self):
        """The global (padded) length, as a ``DynamicCache`` reports it (a 0-d tensor for preallocated layers,
        as transformers' ``StaticLayer``)."""
        if not self.is_initialized:
            return 0
        return self.shared.end if self.shared.static else self.shared.length

    def get_mask_sizes(self, query_length: int) -> tuple:
        if self.shared.static:
            return self.shared.max_cache_len, 0
        return self.shared.length + query_length, 0

    def get_max_length(self) -> int:
        return -1 if self.shared.max_cache_len is None else self.shared.max_cache_len

    def reset(self) -> None:
        """Forget the cached tokens (buffers and scales are kept; the FP8 scales are set again)."""
        self._scaled = False

    def reorder_cache(self, beam_idx) -> None:
        """Reorder the batch rows (beam search)."""
        if self.is_initialized:
            self._select(beam_idx.to(self.device))

    def _select(self, idx) -> None:
        if self.shared.page_size is None:
            self._k.copy_(self._k.index_select(0, idx))
            self._v.copy_(self._v.index_select(0, idx))
        else:  # rows are the second axis of the pool's [pages per row, B] page grid
            for t in (self._k, self._v):
                n = t.shape[0] - (t.shape[0] % self.shared.batch)
                grid = t[:n].view(-1, self.shared.batch, *t.shape[1:])
                grid.copy_(grid.index_select(1, idx))

    def crop(self, tokens_to_remove: int) -> None:
        pass  # the lengths are the cache's (CPCache.crop)

    # -- what the attention function reads ---------------------------------------------------------------

    def decode_args(self) -> tuple:
        """``(k, v, seq_lens, block_table, kv_layout, k_scale, v_scale)`` for ``flash_decode``."""
        if self.shared.page_size is None:
            # Sliced here, not read from ``keys``/``values``: a traced forward then takes only the buffers the
            # update writes, so no graph input aliases another (CUDA graphs need mutated inputs to be static).
            k, v, layout = self._k[:, :, :self._slots], self._v[:, :, :self._slots], "HND"
        else:
            k, v, layout = self._k, self._v, "NHD"
        return k, v, self.shared.seq_lens, self.block_table, layout, self.k_scale, self.v_scale

    def local_kv(self, n: int, dtype) -> tuple:
        """This rank's first ``n`` local slots as dense ``[B, Hkv, n, D]`` tensors in ``dtype`` (FP8
        dequantised)."""
        if self.shared.page_size is None:
            k, v = self._k[:, :, :n], self._v[:, :, :n]
        else:
            ps = self.shared.page_size
            cols = -(-n // ps)
            pages = self.block_table[:, :cols].long()
            b = pages.shape[0]
            k, v = (t[pages].reshape(b, cols * ps, self.heads_kv, self.head_dim)[:, :n].transpose(1, 2)
                    for t in (self._k, self._v))
        k, v = dequantize(k, v, self.k_scale, self.v_scale)  # FP8 to float32 (HND), else themselves
        return (k, v) if k.dtype == dtype else (k.to(dtype), v.to(dtype))


class CPCache(Cache):
    """A transformers ``Cache`` whose layers keep this rank's round-robin shard of every layer's K/V, for
    context-parallel attention with ``attn_implementation="cp_attention"`` (import :mod:`cp_attention.hf`).

    Args:
        config: the model's config (``model.config``); multimodal configs use their text config. Unsupported
            attention (cross-attention / encoder-decoder, ALiBi, multi-head latent attention, chunked
            attention, layer types other than full and sliding attention, head dims outside the multiples of 8
            in ``[32, 256]``) raises ``ValueError`` naming it.
        group: the process group whose ranks share the cache (default: the default group when
            ``torch.distributed`` is initialised, else one process with no communication at all). Every
            rank calls ``generate()`` / the forward with the same inputs.
        max_cache_len: preallocate every layer for this many global positions: ``is_compileable`` (transformers
            then compiles the decode step of ``generate()`` by itself on CUDA, with CUDA graphs) and
            capture-safe. ``None``: layers grow as needed, like a ``DynamicCache``.
        page_size: keep each rank's shard in pages of this many slots (page pools ``[P, page_size, Hkv, D]``
            with a block table, read by ``flash_decode(block_table=..., kv_layout="NHD")``).
        dtype: the cache's dtype (default: the model's K/V dtype). ``torch.float8_e4m3fn`` /
            ``torch.float8_e5m2``: FP8 shards. Each layer's scales (one per KV head, float32) come from the
            amax of that layer's first update -- the prefill, whose K/V every rank computes whole, so the
            scales agree on every rank -- mapped to the format's largest value. A later eager forward of
            several tokens (a chunk of a chunked prefill, a continued prompt) whose K/V reach further widens
            them and requantises the stored tokens; decode steps (and traced forwards) keep them and quantise
            with saturation, so a prompt of a few tokens gives narrow scales. At decode steps the queries of
            float32 models are rounded to bfloat16 for FP8 attention; a prefill attends in float32 against
            dequantised K/V.
        device: where the shards live (default: the device of the first K/V).

    ``get_seq_length()`` is the global, padded length (what a ``DynamicCache`` reports). The left padding of
    the batch is fixed by the first forward on the empty cache (a row padded at every cached position takes
    a later chunk's longer padding: ``generate(prefill_chunk_size=...)``); every later forward's mask must
    hide the same positions (``generate()`` extends the mask with ones), else ``ValueError`` (a traced
    forward: a device assert). A traced (compiled) forward of more than 16 tokens -- a chunk of a chunked
    prefill, an assistant's candidates -- attends in groups of 16 query rows; a compiled first forward of a
    left-padded batch is refused.

    >>> from transformers import AutoModelForCausalLM, LlamaConfig
    >>> config = LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    ...                      num_attention_heads=4, num_key_value_heads=2)      # a tiny random model
    >>> model = AutoModelForCausalLM.from_config(config, attn_implementation="cp_attention")
    >>> ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    >>> mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])                 # row 0 left-padded
    >>> cache = CPCache(model.config, max_cache_len=64)
    >>> model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, do_sample=False).shape
    torch.Size([2, 9])
    """

    def __init__(self, config, *, group=None, max_cache_len=None, page_size=None, dtype=None, device=None):
        text, _, windows = _check_config(config)
        for name, value in (("max_cache_len", max_cache_len), ("page_size", page_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
                raise ValueError(f"CPCache: {name} must be a positive int or None, got {value!r}")
        max_cache_len, page_size = (None if x is None else int(x) for x in (max_cache_len, page_size))
        if dtype is not None and dtype not in FLOAT_DTYPES + FP8_DTYPES:
            raise TypeError(f"CPCache: dtype must be one of {FLOAT_DTYPES + FP8_DTYPES} or None, got {dtype!r}")
        if group is not None or (dist.is_available() and dist.is_initialized()):
            rank, world = dist.get_rank(group), dist.get_world_size(group)
        else:
            rank, world = 0, 1
        device = None if device is None else check_device("CPCache: device", device)
        self._shared = _Shared(rank, world, group if world > 1 else None, max_cache_len, page_size, dtype, device)
        self._shared.config, self._shared.windows = text, windows
        super().__init__(layers=[CPCacheLayer(self._shared, i, w) for i, w in enumerate(windows)])

    @property
    def rank(self) -> int:
        return self._shared.rank

    @property
    def world_size(self) -> int:
        return self._shared.world

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:
            if not self.layers[0].is_initialized:
                self.layers[0].lazy_initialization(key_states, value_states)
            self._shared.begin(key_states)
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def set_seq_length(self, length: int) -> None:
        """Declare that every layer's shard holds the first ``length`` global positions (written into
        :attr:`CPCacheLayer.keys`/``values`` directly, e.g. random K/V to time long contexts); call
        ``early_initialization`` first. Dynamic layers grow to hold them."""
        sh = self._shared
        if sh.batch is None:
            raise RuntimeError("CPCache.set_seq_length: initialise the layers first (early_initialization)")
        if sh.static:
            if length > sh.max_cache_len:
                raise ValueError(f"CPCache: length {length} exceeds max_cache_len = {sh.max_cache_len}")
            sh.end.fill_(length)
            sh.start.fill_(length)
            sh.host_end = length
        else:
            sh.length = length
            for layer in self.layers:
                layer._grow(_counts(length, sh.rank, sh.world))
        sh.seq_lens.fill_(_counts(length, sh.rank, sh.world))

    def reset(self) -> None:
        sh = self._shared
        if sh.static and sh.end is not None:
            sh.end.zero_()
            sh.start.zero_()
        sh.host_end = 0
        sh.length, sh.padded, sh.memo = 0, False, {}
        if sh.seq_lens is not None:
            sh.seq_lens.zero_()
            sh.pad.zero_()
        super().reset()

    def reorder_cache(self, beam_idx) -> None:
        """Reorder the batch rows (beam search): every layer's shard and the rows' padding."""
        super().reorder_cache(beam_idx)
        sh = self._shared
        if sh.pad is not None:
            sh.pad.copy_(sh.pad.index_select(0, beam_idx.to(sh.pad.device)))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (a negative int, or a one-element integer tensor, as
        transformers' caches take it; read on the host)."""
        n = tokens_to_remove
        if isinstance(n, torch.Tensor) and n.numel() == 1 and not (n.is_floating_point() or n.is_complex()):
            n = n.item()
        tokens_to_remove = check_int("CPCache.crop: tokens_to_remove", n, -INT32_MAX)
        if tokens_to_remove > 0:
            raise ValueError(f"CPCache.crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        sh = self._shared
        if tokens_to_remove == 0 or sh.batch is None:
            return
        if sh.static:
            sh.end.sub_(-tokens_to_remove).clamp_(min=0)
            sh.host_end = None if sh.host_end is None else max(0, sh.host_end + tokens_to_remove)
            sh.start.copy_(sh.end)
            sh.seq_lens.copy_(_counts(sh.end, sh.rank, sh.world).expand(sh.batch))
        else:
            sh.length = max(0, sh.length + tokens_to_remove)
            sh.seq_lens.fill_(_counts(sh.length, sh.rank, sh.world))
        sh.memo = {}

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("CPCache keeps its batch: batch_select_indices is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("CPCache keeps its batch: batch_repeat_interleave is not supported")


# ------------------------------------------------------------------------------------------------------
# The mask function and the attention function


def cp_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                      attention_mask=None, **kwargs):
    """The mask function registered with ``AttentionMaskInterface``: each row's first real position
    (``[B, 1, 1, 1]`` int32, the count of left-padding zeros of the 2-D ``attention_mask [B, L]``), or
    ``None`` when there is no mask (or, for a forward of several tokens, no padding). A mask that is not
    left padding raises ``ValueError`` for eager forwards of several tokens; elsewhere (one token, traced) such
    a row's position is ``-1``, which :class:`CPCache` refuses. The causal rule and windows are the attention
    function's.

    >>> cp_attention_mask(2, 3, 3, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]).bool()).flatten()
    tensor([1, 0], dtype=torch.int32)
    """
    if q_length > 1 and not _compiling():  # a static cache's offsets come as 0-d tensors (an eager host read)
        q_offset, kv_offset = (int(x) if isinstance(x, torch.Tensor) and x.numel() == 1 else x
                               for x in (q_offset, kv_offset))
    problem = None if q_length == 1 or _compiling() else _mask_problem(
        mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, getattr(attention_mask, "device", None),
        getattr(kwargs.get("config"), "sliding_window", None))
    if problem:
        # marked, not refused: transformers also asks for masks that no layer uses (a decoder's cross-attention
        # mask without encoder states); the attention function refuses a marked mask
        first = (torch.zeros(batch_size, dtype=torch.int32) if attention_mask is None else
                 attention_mask.shape[1] - attention_mask.bool().sum(dim=1, dtype=torch.int32))
        first = first.view(-1, 1, 1, 1)
        first.cp_mask_problem = problem
        return first
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise ValueError(f"cp_attention takes a 2-D padding mask [B, L], got "
                         f"{type(attention_mask).__name__} of shape {tuple(getattr(attention_mask, 'shape', ()))}")
    mask = attention_mask.bool()
    if q_length > 1 and not _compiling():
        if (mask[:, 1:] < mask[:, :-1]).any():
            raise ValueError("cp_attention: attention_mask must be left padding (zeros only before the first one in "
                             "each row); pad on the left (tokenizer.padding_side = 'left')")
        if isinstance(q_offset, int) and mask.shape[1] != q_offset + q_length:
            raise ValueError(f"cp_attention: attention_mask must cover the {q_offset + q_length} positions of the "
                             f"cache ({q_offset} held) and the new tokens, got shape {tuple(mask.shape)}: a "
                             f"new batch needs reset() or a new CPCache, and generate(use_cache=False) no cache")
        if bool(mask.all()):
            return None
    first = mask.shape[1] - mask.sum(dim=1, dtype=torch.int32)
    if q_length == 1 or _compiling():  # checked on the device (no host read): -1 marks a row with a hole
        left = torch.arange(mask.shape[1], device=mask.device)[None, :] >= first[:, None]
        first = torch.where((mask != left).any(dim=1), -1, first)
    return first.view(-1, 1, 1, 1)


def _mask_problem(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, device=None,
                  sliding_window=None) -> str | None:
    """What transformers' ``mask_function(batch, head, q_idx, kv_idx)`` asks that the causal rule (with the
    config's ``sliding_window``, for the masks of sliding layers) does not give, on up to 65 evenly spaced query
    rows of every sequence (index tensors on ``device``, the 2-D mask's, broadcast as transformers evaluates its
    mask functions); ``None`` where it asks nothing else or cannot be evaluated so. The padding is not part of
    the function (transformers passes it as the 2-D mask)."""
    if mask_function is None or not isinstance(q_offset, int) or not isinstance(kv_offset, int):
        return None
    steps = max(2, min(65, q_length, (1 << 24) // max(1, batch_size * kv_length)))
    q_idx = q_offset + torch.linspace(0, q_length - 1, steps, device=device).round().long().unique()
    kv_idx = kv_offset + torch.arange(kv_length, device=device)
    try:
        seen = mask_function(torch.arange(batch_size, device=device)[:, None, None, None],
                             torch.zeros((1, 1, 1, 1), dtype=torch.long, device=device), q_idx[None, None, :, None],
                             kv_idx[None, None, None, :])
    except Exception:  # a mask function written for scalar indices only (vmap): not checked
        return None
    if not isinstance(seen, torch.Tensor):
        return None
    seen = seen.to(torch.bool)
    back = q_idx[None, None, :, None] - kv_idx[None, None, None, :]  # how far back each key lies
    back = back.to(seen.device)
    if bool((seen & (back < 0)).any()):
        return ("lets a position see later ones (bidirectional attention, e.g. a BERT-style model without "
                "config.is_decoder=True, or bidirectional image tokens)")
    causal = (back >= 0).expand_as(seen)
    if bool((seen == causal).all()):
        return None
    if isinstance(sliding_window, int) and bool((seen == (causal & (back < sliding_window))).all()):
        return None
    return ("hides earlier positions of a sequence beyond its window (packed sequences: position_ids that restart "
            "within a row, or a custom mask function)")


def _first_positions(attention_mask):
    """The ``[B]`` first real positions of the mask function's result, or ``None``."""
    if attention_mask is None:
        return None
    if (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4
            or tuple(attention_mask.shape[1:]) != (1, 1, 1) or attention_mask.is_floating_point()
            or attention_mask.dtype == torch.bool):
        raise ValueError(f"cp_attention: attention_mask must come from its mask function (a 2-D padding mask given "
                         f"to the model), got {type(attention_mask).__name__} of shape "
                         f"{tuple(getattr(attention_mask, 'shape', ()))}")
    return attention_mask.view(-1)


class _Given:
    """The K/V a forward without a :class:`CPCache` passes (no cache: the queries' own keys), read as a
    one-process shard."""

    rank, world, group, static = 0, 1, None, False

    def __init__(self, key, value, s):
        self.k, self.v = key, value
        self.length = key.shape[2]
        self.host_start, self.step, self.memo = self.length - s, s, {}
        self.seq_lens = None

    def end_value(self):
        return self.length

    decode_limits = _Shared.decode_limits

    def decode_args(self):
        return self.k, self.v, None, None, "HND", None, None

    def local_kv(self, n, dtype):
        return self.k[:, :, :n].to(dtype), self.v[:, :, :n].to(dtype)


def cp_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                         softcap=None, s_aux=None, **kwargs):
    """The attention function registered as ``"cp_attention"`` (``transformers.AttentionInterface``).

    Args:
        module: the attention module (``module.layer_idx`` names its cache layer).
        query: ``[B, Hq, S, D]`` (float16, bfloat16 or float32).
        key, value: what the cache's ``update`` returned (``[B, Hkv, S, D]``; read only without a
            :class:`CPCache`, when they must be the queries' own keys).
        attention_mask: the result of :func:`cp_attention_mask` (first real position per row) or ``None``.
        scaling: the score scale (default ``D ** -0.5``).
        sliding_window: the layer's window: a query sees itself and the ``sliding_window - 1`` keys before it.
        softcap: scores ``c * tanh(s / c)`` (Gemma 2).
        s_aux: ``[Hq]`` attention sinks (gpt-oss), joined once after the merge across ranks.

    Returns:
        ``(o [B, S, Hq, D] in query's dtype, None)``: attention over every cached position the causal rule,
        the window and the padding let each query see, merged across the ranks (Note [Context-parallel
        attention inside transformers]). A query that sees no key (a padding position) gets ``o = 0``.

    transformers calls it for a model loaded with ``attn_implementation="cp_attention"`` (:class:`CPCache`).
    """
    layer, kv = _ACTIVE.layer, _ACTIVE.kv
    _ACTIVE.layer = _ACTIVE.kv = None
    s, d = query.shape[2], query.shape[3]
    if layer is not None and getattr(module, "layer_idx", layer.layer_idx) != layer.layer_idx:
        raise RuntimeError(f"cp_attention: attention module {module.layer_idx} attends after the update of cache "
                           f"layer {layer.layer_idx}: the model does not pair each attention layer with its own "
                           f"cache layer (or two forwards ran at once in this process)")
    if not _compiling():
        if dropout:
            raise ValueError(f"cp_attention is an inference attention: dropout must be 0, got {dropout}")
        if kwargs.get("output_attentions"):
            raise ValueError("cp_attention computes no attention weights: output_attentions=True needs "
                             "attn_implementation='eager'")
        problem = getattr(attention_mask, "cp_mask_problem", None)
        if kwargs.get("is_causal") is False and problem is None:
            problem = "lets a position see later ones (is_causal=False)"
        if problem:
            raise ValueError(f"cp_attention attends causally, over the left-padded rows of its cache: "
                             f"{type(module).__name__} attends with a mask that {problem}, which is not supported")
        if layer is not None and (key is not kv[0] or value is not kv[1]):
            raise ValueError(f"cp_attention: {type(module).__name__} changes the keys or values between the cache "
                             f"update and the attention (e.g. tiles or splits them); the sharded cache holds them as "
                             f"updated, so this attention cannot run on it")
        if layer is not None and sliding_window is not None and sliding_window != layer.sliding_window:
            raise ValueError(f"cp_attention: layer {layer.layer_idx} attends with sliding_window={sliding_window}, "
                             f"its config gives {layer.sliding_window}")
        if value.shape[-1] != d or key.shape[-1] != d:
            raise ValueError(f"cp_attention: queries, keys and values need one head dim, got {d}, {key.shape[-1]}, "
                             f"{value.shape[-1]}")
        if layer is None and key.shape[2] != s:
            raise ValueError("cp_attention attends through a CPCache: pass past_key_values=cp_attention.hf.CPCache("
                             "model.config) (these keys come from another cache)")
    first = _first_positions(attention_mask)
    if layer is not None:
        shard = layer.shared
        first = shard.padding(first, layer.layer_idx)  # Note [...], "Padding"
        view = layer
    else:
        shard = view = _Given(key, value, s)
    if sliding_window is None and layer is not None:  # models that window only through their mask
        sliding_window = layer.sliding_window
    window_left = None if sliding_window is None else int(sliding_window) - 1
    scale = float(scaling) if scaling is not None else d ** -0.5
    cap = None if softcap is None else float(softcap)
    sinks = None if s_aux is None else s_aux.float()
    if shard.host_start is None and s > MAX_Q_ROWS:  # traced (a compiled prefill chunk or verification step)
        o = torch.cat([_decode(query, view, shard, first, window_left, scale, cap, sinks, (i, min(s, i + MAX_Q_ROWS)))
                       for i in range(0, s, MAX_Q_ROWS)], dim=1)
    elif s == 1 or (s <= MAX_Q_ROWS and shard.host_start != 0):
        o = _decode(query, view, shard, first, window_left, scale, cap, sinks)
    else:
        o = _prefill(query, view, shard, first, window_left, scale, cap, sinks)
    return o, None


def _decode(query, view, shard, first, window_left, scale, softcap, sinks, rows=None):
    """One ``flash_decode`` on the shard (and one merge across the ranks) for ``S <= 16`` rows, or for the
    rows ``rows = (i0, i1)`` (at most 16) of the ``S`` of a traced forward (``o [B, i1 - i0, Hq, D]``)."""
    b, s = query.shape[0], query.shape[2]
    k, v, seq_lens, block_table, layout, k_scale, v_scale = view.decode_args()
    limits, span, window = shard.decode_limits(first, window_left, s, b, rows)
    if rows is not None:
        q = query[:, :, rows[0]:rows[1]].transpose(1, 2)
    else:
        q = query[:, :, 0] if s == 1 else query.transpose(1, 2)
    dtype = _attention_dtype(query.dtype, k.dtype)
    if q.dtype != dtype:
        q = q.to(dtype)
    kwargs = dict(block_table=block_table, kv_layout=layout, sm_scale=scale, k_scale=k_scale, v_scale=v_scale,
                  window_left=window, logit_softcap=softcap, row_limits=limits, _span=span)
    if shard.world == 1:
        o = flash_decode(q, k, v, seq_lens, sinks=sinks, **kwargs)
    else:
        st = merge_across_ranks(flash_decode(q, k, v, seq_lens, return_lse=True, **kwargs), shard.group,
                                check_metadata=False)  # every rank's layer holds the same shapes (the cache's)
        o = st.o if sinks is None else merge_states(st.o[None], st.lse[None], sinks=sinks).o
    if o.dtype != query.dtype:
        o = o.to(query.dtype)
    return o[:, None] if o.dim() == 3 else o


def _attention_dtype(q_dtype, kv_dtype):
    if kv_dtype in FP8_DTYPES:
        return q_dtype if q_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    return kv_dtype


def _prefill(query, view, shard, first, window_left, scale, softcap, sinks):
    """Attention of ``S`` queries at global positions ``start + i`` over this rank's shard, merged across
    the ranks, in query chunks of bounded memory (eager)."""
    b, hq, s, d = query.shape
    start = shard.host_start
    end = start + s
    w, r = shard.world, shard.rank
    n_local = _counts(end, r, w)
    dtype = query.dtype
    k, v = view.local_kv(n_local, dtype)
    out = torch.empty(b, s, hq, d, dtype=dtype, device=query.device)
    # The same chunks on every rank (their collectives pair up): sized by rank 0's share of the keys.
    m = max(_counts(end, 0, w), d)
    chunk = max(1, min(s, PREFILL_BUDGET_BYTES // (4 * b * hq * m * max(w, 1))))
    whole = None
    if (first is None and softcap is None and start == 0 and (window_left is None or window_left >= s - 1)
            and (not query.is_cuda or dtype in (torch.float16, torch.bfloat16))):
        whole = _causal_residues(query, k, v, r, w, scale)
    for i0 in range(0, s, chunk):
        i1 = min(s, i0 + chunk)
        if whole is not None:
            st = AttentionState(whole.o[:, i0:i1], whole.lse[:, i0:i1])
        else:
            st = _masked_chunk(query[:, :, i0:i1], k, v, start + i0, first, window_left, r, w, scale, softcap)
        if w > 1:
            st = merge_across_ranks(AttentionState(st.o.contiguous(), st.lse.contiguous()), shard.group,
                                    check_metadata=False)
        o = st.o
        if sinks is not None:
            o = merge_states(st.o[None].float(), st.lse[None], sinks=sinks).o
        out[:, i0:i1] = o
    return out


def _masked_chunk(q, k, v, t0, first, window_left, rank, world, scale, softcap) -> AttentionState:
    """State of the queries ``q [B, Hq, c, D]`` at global positions ``t0 + i`` over this rank's local keys
    ``k``/``v [B, Hkv, n, D]`` (slot ``j`` at global position ``rank + world * j``): each sees the positions
    ``[max(first, t - window_left), t]``. Float32 scores (soft-capped if asked), only the local slots the
    chunk can reach. Returns ``o [B, c, Hq, D]`` float32, ``lse [B, c, Hq]``; empty rows ``o = 0, lse = -inf``."""
    b, hq, c, d = q.shape
    hkv = k.shape[1]
    device = q.device
    t = t0 + torch.arange(c, device=device)
    hi = _counts(t + 1, rank, world)  # [c]
    j1 = _counts(t0 + c, rank, world)
    j0 = 0 if window_left is None else _counts(max(0, t0 - window_left), rank, world)
    lo = torch.zeros_like(t)[None, :] if first is None else first.to(t.dtype)[:, None].expand(b, c)
    if window_left is not None:
        lo = torch.maximum(lo, (t - window_left).clamp(min=0)[None, :])
    lo = _counts(lo, rank, world)  # [B or 1, c]
    j = torch.arange(j0, j1, device=device)
    visible = (j[None, None, :] >= lo[:, :, None]) & (j[None, None, :] < hi[None, :, None])  # [B|1, c, m]
    qg = q.float().view(b, hkv, hq // hkv, c, d)
    kk, vv = k[:, :, j0:j1].float(), v[:, :, j0:j1].float()
    scores = torch.einsum("bhgcd,bhmd->bhgcm", qg, kk) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G, c]
    p = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    o = torch.einsum("bhgcm,bhmd->bhgcd", p, vv)
    o = o.reshape(b, hq, c, d).transpose(1, 2)
    lse = lse.reshape(b, hq, c).transpose(1, 2)
    return AttentionState(o, lse)


def _flash_causal(q, k, v, scale) -> AttentionState:
    """FlashAttention with the top-left causal rule (query ``i`` sees keys ``j <= i``; ``q``, ``k``, ``v``
    ``[B, H, n, D]`` with one head per query head) returning its natural-log LSE ``[B, H, n]`` float32."""
    if q.is_cuda:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[:2]
    else:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)[:2]
    return AttentionState(o, lse)


def _causal_residues(query, k, v, rank, world, scale) -> AttentionState:
    """A prompt's causal attention (global positions ``0..S-1``, no padding, window or softcap) over this
    rank's local keys, as one square causal FlashAttention call per query residue ``s = t mod W``: query
    ``t = s + W m`` sees local slots ``j <= m`` if ``s >= rank``, else ``j <= m - 1`` (so its query 0 sees
    nothing). Returns ``o [B, S, Hq, D]`` in query's dtype, ``lse [B, S, Hq]`` float32."""
    b, hq, s, d = query.shape
    group = hq // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) if group > 1 else t for t in (k, v))
    o = torch.zeros(b, s, hq, d, dtype=query.dtype, device=query.device)
    lse = torch.full((b, s, hq), float("-inf"), dtype=torch.float32, device=query.device)
    for res in range(min(world, s)):
        n = -(-(s - res) // world)  # queries of this residue
        q_res = query[:, :, res::world]
        if res >= rank:
            st = _flash_causal(q_res.contiguous(), k[:, :, :n].contiguous(), v[:, :, :n].contiguous(), scale)
            o[:, res::world] = st.o.transpose(1, 2)
            lse[:, res::world] = st.lse.transpose(1, 2)
        elif n > 1:
            st = _flash_causal(q_res[:, :, 1:].contiguous(), k[:, :, :n - 1].contiguous(),
                               v[:, :, :n - 1].contiguous(), scale)
            o[:, res + world::world] = st.o.transpose(1, 2)
            lse[:, res + world::world] = st.lse.transpose(1, 2)
    return AttentionState(o, lse)


# ------------------------------------------------------------------------------------------------------
# A decoding loop whose host runs one step ahead of the GPU


class _LateStop:
    """The stop check of transformers' decoding loop (``generation.utils.StopCheck``'s interface:
    ``__call__(unfinished_sequences, tokens, length) -> stop``, ``finish() -> steps to undo``), read one step
    late on a :class:`CPCache`.

    ``unfinished_sequences.max() == 0`` is copied to pinned host memory without waiting, and read at the next
    step, after that step has been queued: the host waits for step ``t - 1`` while the GPU already runs step
    ``t``, and prepares step ``t + 1`` meanwhile. When the flag read says every row had finished, step ``t``
    was one too many: ``finish`` returns 1 (transformers drops that step's token) and crops the cache by the
    one position that step wrote. The length limit is known on the host and stops without an extra step.
    """

    @staticmethod
    def is_supported(device, cache, cache_is_returned, is_assistant=False) -> bool:
        return isinstance(cache, CPCache) and not is_assistant

    def __init__(self, input_ids, max_length, cache, cache_is_returned, streamer=None):
        self.max_length, self.cache, self.streamer = max_length, cache, streamer
        cuda = input_ids.device.type == "cuda"
        # (finished flag, that step's tokens, an event after both copies); CPU copies are done on return
        self.slots = collections.deque((torch.zeros((), dtype=torch.bool, pin_memory=cuda),
                                        torch.zeros(input_ids.shape[0], dtype=input_ids.dtype, pin_memory=cuda),
                                        torch.cuda.Event() if cuda else None) for _ in range(2))
        self.steps, self.stopped = 0, False

    def __call__(self, unfinished_sequences, tokens, length) -> bool:
        flag, host_tokens, done = self.slots[0]
        flag.copy_(unfinished_sequences.max() == 0, non_blocking=True)
        if self.streamer is not None:
            host_tokens.copy_(tokens, non_blocking=True)
        if done is not None:
            done.record()
        self.slots.rotate()
        if self.steps:  # the previous step's flag (and tokens)
            flag, host_tokens, done = self.slots[0]
            if done is not None:
                done.synchronize()
            if self.streamer is not None:
                self.streamer.put(host_tokens.clone())
            self.stopped = bool(flag)
        self.steps += 1
        return self.stopped or (self.max_length is not None and length >= self.max_length)

    def finish(self) -> int:
        for _, _, done in self.slots:
            if done is not None:
                done.synchronize()
        self.cache._shared.check_pending()  # the last decode steps' agreement
        if self.stopped:
            self.cache.crop(-1)
        elif self.streamer is not None and self.steps:
            self.streamer.put(self.slots[1][1].clone())  # the last step's tokens
        return int(self.stopped)


_LOOP_LOCK = threading.Lock()


@contextlib.contextmanager
def _late_stop():
    """transformers' decoding loop takes :class:`_LateStop` for its deferred stop check while this is open."""
    if not hasattr(generation_utils, "DeferredStopCheck"):
        raise RuntimeError("cp_attention.hf.decode_ahead needs a transformers whose decoding loop defers its stop "
                           "check (transformers.generation.utils.DeferredStopCheck, in 5.17 and later)")
    with _LOOP_LOCK:
        own, generation_utils.DeferredStopCheck = generation_utils.DeferredStopCheck, _LateStop
        try:
            yield
        finally:
            generation_utils.DeferredStopCheck = own


def decode_ahead(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                 streamer=None, **model_kwargs):
    """transformers' greedy search and sampling on a :class:`CPCache` with the host one step ahead of the GPU:
    pass it to ``generate()`` as ``custom_generate``.

    ``generate()`` asks the GPU after every step whether all rows have finished, and prepares the next step
    only once the answer is back, so the host's work between steps (inputs, logits processors, Dynamo's guards,
    the launch of a compiled step's CUDA graph) adds to every step's time. This loop is transformers' own
    (``GenerationMixin._sample``) with that answer read one step late: the host prepares step ``t + 1`` while
    the GPU runs step ``t``. When every row has finished (an EOS token in each), one extra step has run; its
    token is dropped and the position it wrote is cropped from the cache, so the tokens, the logits and the
    cache are those of ``generate()`` without it. Stopping at ``max_new_tokens`` / ``max_length`` costs no
    extra step.

    Greedy search and sampling only (beam search, assisted and other modes raise ``ValueError``), on a
    :class:`CPCache` passed to ``generate()`` (else ``ValueError``); the decode steps are compiled, as
    without it, for a preallocated cache (``max_cache_len``) on CUDA. transformers does not hand a
    ``streamer`` to a ``custom_generate`` callable.

    >>> from transformers import AutoModelForCausalLM, LlamaConfig
    >>> config = LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    ...                      num_attention_heads=4, num_key_value_heads=2)      # a tiny random model
    >>> model = AutoModelForCausalLM.from_config(config, attn_implementation="cp_attention")
    >>> ids = torch.tensor([[1, 2, 3, 4, 5]])
    >>> kw = dict(max_new_tokens=4, do_sample=False)
    >>> out = model.generate(ids, past_key_values=CPCache(model.config, max_cache_len=16),
    ...                      custom_generate=decode_ahead, **kw)
    >>> torch.equal(out, model.generate(ids, past_key_values=CPCache(model.config, max_cache_len=16), **kw))
    True
    """
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(f"cp_attention.hf.decode_ahead runs greedy search and sampling, not {mode.value} "
                         f"(num_beams={generation_config.num_beams}); call generate() without custom_generate")
    cache = next((v for v in model_kwargs.values() if isinstance(v, CPCache)), None)
    if cache is None:
        raise ValueError("cp_attention.hf.decode_ahead decodes on a CPCache: pass past_key_values="
                         "cp_attention.hf.CPCache(model.config, ...) to generate()")
    cache._shared.ahead = True
    try:
        with _late_stop():
            return GenerationMixin._sample(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                           synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
    finally:
        cache._shared.ahead = False
        cache._shared.pending.clear()


AttentionInterface.register(IMPLEMENTATION, cp_attention_forward)
AttentionMaskInterface.register(IMPLEMENTATION, cp_attention_mask)
