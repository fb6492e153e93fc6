"""Tiny random transformers models for the ``cp_attention.hf`` tests (built from configs, no download), a
left-padded prompt batch and transformers' own eager reference. Shared by ``tests/test_hf.py`` and the
``torchrun`` worker ``tests/_hf_worker.py``."""
from __future__ import annotations

import inspect

import torch
import transformers

VOCAB = 97
NEW_TOKENS = 6
PROMPT_LENS = (11, 4, 8)  # left-padded to 11: rows 1 and 2 start with padding
# Per architecture: config class and overrides. Windows (5) are shorter than the prompts; head dims 32, 40, 48.
ARCHS = {
    "llama": ("LlamaConfig", {"head_dim": 40}),
    "mistral-window5": ("MistralConfig", {"head_dim": 32, "sliding_window": 5}),
    "qwen2": ("Qwen2Config", {}),  # head dim hidden_size / heads: 32 (tiny_config)
    "qwen3": ("Qwen3Config", {"head_dim": 48}),
    "gemma2-softcap-window5": ("Gemma2Config", {
        "head_dim": 32, "sliding_window": 5, "attn_logit_softcapping": 30.0, "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 24, "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma3-window5": ("Gemma3TextConfig", {
        "head_dim": 40, "sliding_window": 5, "query_pre_attn_scalar": 40,
        "layer_types": ["sliding_attention", "full_attention"]}),
    "gpt-oss-sinks-window5": ("GptOssConfig", {
        "head_dim": 32, "sliding_window": 5, "num_local_experts": 4, "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention", "full_attention"]}),
}


def tiny_config(arch: str, **overrides):
    """A 2-layer config: hidden 64, 4 query heads, 2 KV heads, vocab 97, large initial weights (greedy choices
    well apart, float32 tokens then agree exactly)."""
    cls, extra = ARCHS[arch]
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, initializer_range=0.5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "qwen2":
        kw.update(num_attention_heads=2, num_key_value_heads=1)  # head dim 64 / 2 = 32
    kw.update(extra)
    kw.update(overrides)
    return getattr(transformers, cls)(**kw)


def tiny_model(arch: str, seed: int = 0, dtype=torch.float32, **overrides):
    """The random model (eager attention), the same weights for the same seed in every process."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), attn_implementation="eager")
    if arch.startswith("gpt-oss"):  # sinks of a few units, so that they change the softmax
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model.to(dtype).eval()


def prompts(seed: int = 1, padded: bool = True, row: int | None = None):
    """``(input_ids [3, 11], attention_mask [3, 11])``: three prompts of lengths 11, 4, 8, left-padded (or,
    with ``padded=False``, three of length 11); ``row``: that prompt alone, as a batch of one."""
    gen = torch.Generator().manual_seed(seed)
    n = max(PROMPT_LENS)
    ids = torch.randint(1, VOCAB, (len(PROMPT_LENS), n), generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        for b, length in enumerate(PROMPT_LENS):
            mask[b, : n - length] = 0
            ids[b, : n - length] = 0
    return (ids, mask) if row is None else (ids[row:row + 1], mask[row:row + 1])


def cache_kwarg(model) -> str:
    """The name under which the installed transformers takes a cache (``cache`` in newer releases,
    ``past_key_values`` before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# Generation modes beside greedy search that change what the cache sees: beam search reorders its rows
# (``reorder_cache``); prompt lookup (batch 1) verifies several drafted tokens per forward and crops the
# rejected ones (``crop``).
MODES = {
    "beam2": dict(num_beams=2, num_return_sequences=2),
    "lookup3": dict(prompt_lookup_num_tokens=3),
    "sample": dict(do_sample=True, top_k=8),
}


def generate(model, ids, mask, cache=None, new_tokens=NEW_TOKENS, mode=None, ahead=False, seed=0, **kwargs):
    """``generate`` (greedy, or the generation mode ``MODES[mode]``; ``ahead``: through
    ``cp_attention.hf.decode_ahead``; ``seed``: torch's seed for the modes that sample, set right before) ->
    (new tokens [B', N], per-step logits [N, B', V] float32)."""
    extra = {"do_sample": False} if cache is None else {"do_sample": False, cache_kwarg(model): cache}
    extra.update(MODES[mode] if mode else {}, **kwargs)
    if extra["do_sample"] and mode:
        torch.manual_seed(seed)
    if ahead:
        import cp_attention.hf

        extra["custom_generate"] = cp_attention.hf.decode_ahead
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, **extra)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits).float()


def reference(model, ids, mask, new_tokens=NEW_TOKENS, mode=None):
    """transformers' eager attention with a DynamicCache: (tokens, logits, smallest top-2 logit gap, the
    cache's ``get_seq_length()``)."""
    model.set_attn_implementation("eager")
    cache = transformers.DynamicCache(config=model.config)
    tokens, logits = generate(model, ids, mask, cache, new_tokens=new_tokens, mode=mode)
    top2 = logits.topk(2, dim=-1).values
    return tokens, logits, float((top2[..., 0] - top2[..., 1]).min()), int(cache.get_seq_length())


def forward_rows(model, ids, mask, cache, rows: int = 3, seed: int = 2):
    """A prefill forward of the prompts, then one forward of ``rows`` more tokens per row on the same cache:
    that forward's logits ``[B, rows, V]`` float32 (several query rows of a non-empty cache)."""
    more = torch.randint(1, VOCAB, (ids.shape[0], rows), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
        full = torch.cat([mask, torch.ones_like(more)], dim=1)
        positions = (full.cumsum(-1) - 1).clamp(min=0)[:, -rows:]
        out = model(input_ids=more, attention_mask=full, position_ids=positions, use_cache=True,
                    **{cache_kwarg(model): cache})
    return out.logits.float()
