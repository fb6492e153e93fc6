"""A Llama-family decoder in plain torch (gpt-fast style), with the attention left to the caller.

Llama 2/3 (RMSNorm, rotary embeddings with ``rope_type`` default or ``llama3``, grouped-query attention with
any head dim, SwiGLU MLP, tied or untied embeddings), Mistral (a sliding window on every layer), Qwen2
(biases on the q/k/v projections; sliding windows per ``layer_types``) and Gemma 2 (RMSNorm scaled by ``1 +
weight`` in float32, norms after attention and around the MLP, embeddings times ``sqrt(hidden_size)``, a
GELU-tanh MLP, the score scale ``query_pre_attn_scalar ** -0.5``, attention logits soft-capped, sliding
windows on alternate layers, final logits soft-capped). Module and parameter names are the Hugging Face
ones (``model.layers.0.self_attn.q_proj.weight``), so a checkpoint written by ``save_pretrained`` loads with
``load_state_dict``.

The model computes everything but attention: :meth:`Transformer.forward` takes a callable ``attention(layer,
q, k, v) -> o`` that owns the KV cache (a context-parallel prefill, or ``CPKVCache.append`` + ``decode`` in
``launch/generate.py``). RoPE, RMSNorm and the gated activation follow ``transformers`` operation by
operation (same dtypes, same roundings), so float32 logits agree with ``LlamaForCausalLM`` to rounding. On a
GPU they are the Triton kernels of ``launch/model_kernels.py`` (the residual adds folded into the norms), and the
q/k/v and gate/up projections are one GEMM each (:meth:`Transformer.fuse_projections`, done by the loaders):
a decode step launches about ten kernels per layer instead of forty.

Checkpoints are checked from ``config.json`` and the safetensors headers (:func:`inspect_checkpoint`) before
any tensor is read: unsupported architectures, head dims the decode kernels do not take and missing or
misshapen tensors raise :class:`CheckpointError` naming what is wrong.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from launch.model_kernels import gated_act, rmsnorm, rope_

MODEL_TYPES = ("llama", "mistral", "qwen2", "gemma2")


class CheckpointError(ValueError):
    """A checkpoint this model cannot run (unsupported architecture, missing or misshapen tensor)."""


@dataclass(frozen=True)
class ModelArgs:
    """Shapes and options of one model (the fields of a Hugging Face ``config.json`` that matter here).

    ``windows``: per layer, ``None`` (full causal attention) or the sliding window ``W`` of Hugging Face
    configs, which lets a query see itself and the ``W - 1`` keys before it (``window_left = W - 1``).
    ``gemma_norms``: Gemma 2's norms (``1 + weight``, after attention and around the MLP) and embeddings
    scaled by ``sqrt(dim)``. ``attn_scale``: the score scale (``None``: ``head_dim ** -0.5``);
    ``attn_softcap``, ``final_softcap``: ``c * tanh(x / c)`` of the attention scores and of the logits.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Llama 3.1's: factor, low/high_freq_factor, original_max_position_embeddings
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    windows: tuple = ()  # per layer: None or a sliding window; () means none anywhere
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma 2)
    gemma_norms: bool = False
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None

    @property
    def sm_scale(self) -> float:
        """The attention score scale."""
        return self.head_dim ** -0.5 if self.attn_scale is None else self.attn_scale

    def window_left(self, layer: int) -> int | None:
        """``window_left`` of ``flash_decode`` for ``layer`` (``None``: no window)."""
        w = self.windows[layer] if self.windows else None
        return None if w is None else w - 1

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        """Arguments from a parsed Hugging Face ``config.json``; :class:`CheckpointError` for what this model
        does not run."""
        model_type = cfg.get("model_type")
        if model_type not in MODEL_TYPES:
            raise CheckpointError(f"unsupported model_type {model_type!r} (supported: {', '.join(MODEL_TYPES)})")
        archs = [a for a in cfg.get("architectures") or [] if not a.endswith("ForCausalLM")]
        if archs:
            raise CheckpointError(f"unsupported architecture {archs[0]!r} (a *ForCausalLM checkpoint is needed)")
        gemma = model_type == "gemma2"
        act_key = "hidden_activation" if gemma and "hidden_activation" in cfg else "hidden_act"
        act = cfg.get(act_key) or ("gelu_pytorch_tanh" if gemma else "silu")
        if act != ("gelu_pytorch_tanh" if gemma else "silu"):
            raise CheckpointError(f"unsupported {act_key} {act!r} (the MLP of {model_type} needs "
                                  f"{'gelu_pytorch_tanh' if gemma else 'silu'!r})")
        if cfg.get("use_bidirectional_attention"):
            raise CheckpointError("unsupported use_bidirectional_attention (a causal decoder is needed)")
        try:
            n_heads, dim = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
            n_layers = int(cfg["num_hidden_layers"])
            args = dict(vocab_size=int(cfg["vocab_size"]), dim=dim, n_layers=n_layers, n_heads=n_heads,
                        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
                        head_dim=int(cfg.get("head_dim") or dim // n_heads),
                        intermediate_size=int(cfg["intermediate_size"]))
        except KeyError as exc:
            raise CheckpointError(f"config.json lacks {exc.args[0]!r}") from None
        args["norm_eps"] = float(cfg.get("rms_norm_eps", 1e-6))
        args["tie_embeddings"] = bool(cfg.get("tie_word_embeddings", gemma))
        if gemma:
            args.update(hidden_act=act, gemma_norms=True,
                        attn_scale=float(cfg.get("query_pre_attn_scalar") or args["head_dim"]) ** -0.5,
                        attn_softcap=_positive_or_none(cfg, "attn_logit_softcapping"),
                        final_softcap=_positive_or_none(cfg, "final_logit_softcapping"))
        # transformers >= 5 writes rope_parameters (theta included); older configs rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        args["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            args["rope_scaling"] = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                         "original_max_position_embeddings")}
        elif rope_type != "default":
            raise CheckpointError(f"unsupported rope type {rope_type!r} (supported: default, llama3)")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise CheckpointError("unsupported partial_rotary_factor (rotary embeddings over the whole head only)")
        if model_type == "qwen2":
            args["qkv_bias"] = True
        else:
            args["qkv_bias"] = args["o_bias"] = bool(cfg.get("attention_bias", False))
        args["mlp_bias"] = bool(cfg.get("mlp_bias", False))
        args["windows"] = _windows(cfg, model_type, n_layers)
        return cls(**args)

    def check(self) -> None:
        """Raise :class:`CheckpointError` for shapes the decode kernels or the model do not take."""
        d = self.head_dim
        if d % 8 or not 32 <= d <= 256:
            raise CheckpointError(f"head_dim {d} is not supported: the decode kernels take a multiple of 8 in "
                                  f"[32, 256]")
        if self.n_heads % self.n_kv_heads:
            raise CheckpointError(f"num_attention_heads ({self.n_heads}) must be a multiple of "
                                  f"num_key_value_heads ({self.n_kv_heads})")
        if self.windows and len(self.windows) != self.n_layers:
            raise CheckpointError(f"layer_types has {len(self.windows)} entries for {self.n_layers} layers")
        if any(w is not None and w < 1 for w in self.windows):
            raise CheckpointError(f"sliding_window must be >= 1, got {self.windows}")


def _positive_or_none(cfg: dict, key: str) -> float | None:
    """``cfg[key]`` as a positive float, or ``None`` when absent or null."""
    value = cfg.get(key)
    if value is None:
        return None
    if float(value) <= 0:
        raise CheckpointError(f"{key} must be positive, got {value}")
    return float(value)


def _windows(cfg: dict, model_type: str, n_layers: int) -> tuple:
    """Per-layer sliding windows (``()`` when no layer has one)."""
    window = cfg.get("sliding_window")
    if model_type == "llama" or window is None:
        return ()
    if model_type == "mistral":
        return (int(window),) * n_layers
    types = cfg.get("layer_types")
    if types is None and model_type == "gemma2":  # Gemma 2 configs before layer_types: even layers slide
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    if types is None:  # Qwen2 configs before layer_types: windows from layer max_window_layers on
        use = cfg.get("use_sliding_window", False)
        types = ["sliding_attention" if use and i >= cfg.get("max_window_layers", 0) else "full_attention"
                 for i in range(n_layers)]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise CheckpointError(f"unsupported layer_types {sorted(unknown)}")
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


# Shapes of public models, for --random-config (random weights; no checkpoint needed).
CONFIGS = {
    "llama3-8b": ModelArgs(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                           intermediate_size=14336, norm_eps=1e-5, rope_theta=500000.0,
                           rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}),
    "llama3.2-1b": ModelArgs(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                             intermediate_size=8192, norm_eps=1e-5, rope_theta=500000.0,
                             rope_scaling={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192}, tie_embeddings=True),
    "llama2-7b": ModelArgs(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
                           intermediate_size=11008, norm_eps=1e-5),
    "tiny": ModelArgs(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                      intermediate_size=256),
}


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, computed as ``transformers`` does (on the CPU)."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = args.rope_scaling
    if sc is None:
        return inv_freq
    # Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend in between.
    factor, low, high, old_len = (sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"],
                                  sc["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, gemma: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self.eps = eps
        self.gemma = gemma

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """``[..., dim]`` -> ``[..., dim]``, after ``x += delta`` in place when ``delta`` is given
        (:func:`launch.model_kernels.rmsnorm`)."""
        return rmsnorm(x, self.weight, self.eps, delta, self.gemma)


def _fused_linear(*parts: nn.Linear) -> nn.Linear:
    """One ``nn.Linear`` whose output is the outputs of ``parts`` side by side (their weights concatenated)."""
    bias = parts[0].bias is not None
    weight = parts[0].weight
    fused = nn.Linear(weight.shape[1], sum(p.weight.shape[0] for p in parts), bias=bias, device="meta")
    fused.weight = nn.Parameter(torch.cat([p.weight.data for p in parts]), requires_grad=False)
    if bias:
        fused.bias = nn.Parameter(torch.cat([p.bias.data for p in parts]), requires_grad=False)
    return fused


class Attention(nn.Module):
    """The projections around attention; the attention itself is the caller's (:meth:`Transformer.forward`).

    Built with the checkpoint's ``q_proj``/``k_proj``/``v_proj``; :meth:`Transformer.fuse_projections` then
    replaces them by ``qkv_proj`` (one GEMM)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)

    def qkv(self, x, cos, sin):
        """``x [..., dim]``, ``cos``/``sin [..., head_dim]`` -> ``q [..., Hq, D]``, ``k``/``v [..., Hkv, D]``
        (RoPE applied to q and k), x's dtype: views of one fused projection's output."""
        lead, hq, hkv, d = x.shape[:-1], self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        rope_(qkv, cos, sin, hq + hkv, d)
        heads = qkv.unflatten(-1, (hq + 2 * hkv, d))
        return heads[..., :hq, :], heads[..., hq: hq + hkv, :], heads[..., hq + hkv:, :]


class MLP(nn.Module):
    """Gate, up and down projections; :meth:`Transformer.fuse_projections` replaces ``gate_proj``/``up_proj``
    by ``gate_up_proj`` (one GEMM)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)
        self.gelu = args.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_act(self.gate_up_proj(x), self.gelu))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        g = args.gemma_norms
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps, g)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps, g)
        if g:  # Gemma 2: post_attention_layernorm normalises the attention output; two more around the MLP
            self.pre_feedforward_layernorm = RMSNorm(args.dim, args.norm_eps, g)
            self.post_feedforward_layernorm = RMSNorm(args.dim, args.norm_eps, g)


class Body(nn.Module):
    """``LlamaModel``'s parameters: embeddings, blocks, final norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, args.gemma_norms)


class Transformer(nn.Module):
    """``LlamaForCausalLM``: ``model`` (:class:`Body`) and ``lm_head`` (absent when tied to the embeddings)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Body(args)
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """Hidden states after the final norm.

        Args:
            tokens: ``[B, n]`` or ``[B]`` int64 token ids.
            positions: their positions, int64, broadcastable to ``tokens``: ``[n]`` (shared by the batch) or
                ``[B]`` (one per sequence in a decode step).
            attention: ``attention(layer, q, k, v) -> o`` with ``q [*tokens.shape, Hq, D]``, ``k``/``v
                [*tokens.shape, Hkv, D]`` (RoPE applied) and ``o`` shaped like ``q``: the causal attention of
                each query over the keys of its sequence up to its position (the caller's KV cache), with
                the scores scaled by ``args.sm_scale``, soft-capped by ``args.attn_softcap`` and windowed by
                ``args.window_left(layer)``.

        Returns:
            ``[*tokens.shape, dim]`` in the model's dtype.
        """
        x = self.model.embed_tokens(tokens)
        gemma = self.args.gemma_norms
        if gemma:  # as transformers: sqrt(hidden_size) rounded to the model's dtype
            x = x * torch.tensor(self.args.dim ** 0.5, dtype=x.dtype)
        freqs = positions[..., None].float() * self.inv_freq  # as transformers: float32, then cos/sin
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        layers = self.model.layers
        h = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            q, k, v = layer.self_attn.qkv(h, cos, sin)
            a = layer.self_attn.o_proj(attention(i, q, k, v).flatten(-2))
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            if gemma:
                x = x + layer.post_attention_layernorm(a)
                x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
                h = after(x)
            else:  # the residual adds fold into the norms that follow them (x updated in place)
                m = layer.mlp(layer.post_attention_layernorm(x, a))
                h = after(x, m)
        return h

    def fuse_projections(self) -> "Transformer":
        """Replace each layer's q/k/v projections by one ``qkv_proj`` and gate/up by one ``gate_up_proj``
        (weights concatenated; the originals dropped, so the memory does not double). :meth:`forward` needs
        it; the loaders call it after the checkpoint's tensors are in place."""
        for layer in self.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            att.qkv_proj = _fused_linear(att.q_proj, att.k_proj, att.v_proj)
            del att.q_proj, att.k_proj, att.v_proj
            mlp.gate_up_proj = _fused_linear(mlp.gate_proj, mlp.up_proj)
            del mlp.gate_proj, mlp.up_proj
        return self

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[..., dim]`` final hidden states -> ``[..., vocab]`` logits in the model's dtype."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(h, weight)
        cap = self.args.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def expected_shapes(args: ModelArgs) -> dict:
    """Every tensor a checkpoint for ``args`` must hold, name -> shape."""
    with torch.device("meta"):
        model = Transformer(args)
    return {name: tuple(p.shape) for name, p in model.state_dict().items()}


def inspect_checkpoint(path) -> tuple[ModelArgs, dict]:
    """Read ``config.json`` and the safetensors headers of a Hugging Face checkpoint directory, and check them
    (no tensor data is read).

    Returns:
        ``(args, files)``: the model's :class:`ModelArgs` and ``{tensor name: safetensors file}`` for every
        tensor the model needs. Raises :class:`CheckpointError` for an unsupported architecture or head dim, a
        missing tensor or a tensor of the wrong shape.
    """
    from safetensors import safe_open

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json (expected a Hugging Face checkpoint directory)")
    args = ModelArgs.from_hf_config(json.loads((path / "config.json").read_text()))
    args.check()
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors files")
    shapes, where = {}, {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                shapes[name] = tuple(st.get_slice(name).get_shape())
                where[name] = f
    expected = expected_shapes(args)
    missing = sorted(set(expected) - set(shapes))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{path} lacks tensor(s) {', '.join(missing[:5])}{more}")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise CheckpointError(f"tensor {name} in {where[name].name} has shape {list(shapes[name])}, expected "
                                  f"{list(shape)} from config.json")
    return args, {name: where[name] for name in expected}


def load_checkpoint(args: ModelArgs, files: dict, device, dtype) -> Transformer:
    """The model of :func:`inspect_checkpoint`'s ``(args, files)`` on ``device`` in ``dtype`` (in eval mode)."""
    from safetensors import safe_open

    state = {}
    for f in sorted(set(files.values())):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                if name in files:
                    state[name] = st.get_tensor(name).to(device=device, dtype=dtype)
    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(state, strict=True, assign=True)
    del state
    model.inv_freq = rope_inv_freq(args).to(device)
    return model.fuse_projections().eval()


def random_model(args: ModelArgs, device, dtype, seed: int = 0, std: float = 0.02) -> Transformer:
    """A model with seeded random weights (normal(0, std) matrices, identity norms, zero biases), generated on
    ``device``: the same weights on every process that passes the same seed and device type."""
    with torch.device("meta"):
        model = Transformer(args).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(0.0 if args.gemma_norms else 1.0)
        elif name.endswith(".bias"):
            p.data.zero_()
        else:
            p.data.normal_(0.0, std, generator=gen)
    model.inv_freq = rope_inv_freq(args).to(device)
    return model.fuse_projections().eval()
