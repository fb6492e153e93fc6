"""``cp_attention.hf``: unmodified transformers models decode through ``generate()`` with a :class:`CPCache`.

Tiny random float32 models of every supported architecture (``tests/_hf_models.py``), a left-padded batch of
three prompts, greedy: tokens and per-step logits equal transformers' eager attention with a ``DynamicCache``.
W = 1 runs in this process, with the Triton kernels under the interpreter (``interp``) and on the library's
torch path (``torch``); W = 2 (interpreter) and W = 3 (torch path) run every case in one ``torchrun``
launch each (``tests/_hf_worker.py``, gloo), whose ranks must agree bitwise.
"""
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers

import cp_attention.hf as cph
from cp_attention.reference import attention
from tests._hf_models import ARCHS, NEW_TOKENS, VOCAB, cache_kwarg, forward_rows, generate, prompts, reference, tiny_model

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_hf_worker.py"
TIMEOUT_S = 300
LOGIT_TOL = dict(atol=2e-4, rtol=1e-5)  # float32 logits of magnitude ~10-30, summed in another order
# Beam search on gpt-oss (sinks, window 5, weights of 0.5): each layer's float32 attention output lies up to
# ~2e-3 from the float64 model's, for eager's attention and this one alike, and the logits follow (up to
# ~5e-4 at the sixth step); a key set attended wrongly moves them by units.
MODE_TOL = dict(atol=1e-3, rtol=1e-5)
# FP8 shards: e4m3 keeps 3 mantissa bits (e5m2 2), a relative error up to 2^-4 (2^-3) per element; the
# logits then move by a few percent of their range.
FP8_TOL = {"float8_e4m3fn": 0.05, "float8_e5m2": 0.1}


@pytest.fixture(scope="module")
def refs():
    """arch (and prompt kind) -> (tokens, logits, top-2 gap, DynamicCache length), computed on first use."""
    done = {}

    def get(arch, padded=True, rows=None, init=0.5, mode=None, row=None):
        key = (arch, padded, rows, init, mode, row)
        if key not in done:
            model = tiny_model(arch, initializer_range=init)
            ids, mask = prompts(padded=padded, row=row)
            if rows:
                done[key] = forward_rows(model, ids, mask, transformers.DynamicCache(config=model.config), rows)
            else:
                done[key] = reference(model, ids, mask, mode=mode)
                assert done[key][2] > 1e-3, f"{arch}: greedy choices too close for an exact comparison"
        return done[key]

    return get


def _cp_generate(arch, padded=True, init=0.5, mode=None, row=None, **cache_kwargs):
    model = tiny_model(arch, initializer_range=init)
    model.set_attn_implementation("cp_attention")
    cache = cph.CPCache(model.config, **cache_kwargs)
    ids, mask = prompts(padded=padded, row=row)
    tokens, logits = generate(model, ids, mask, cache, mode=mode)
    return tokens, logits, cache


# ------------------------------------------------------------------------------------------------------
# One process


@pytest.mark.parametrize("path", ["interp", "torch"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_generate_matches_eager_W1(refs, monkeypatch, arch, path):
    if path == "torch":  # CPU tensors take the torch path when the interpreter is off (read at each call)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    ref_tokens, ref_logits, _, ref_len = refs(arch)
    tokens, logits, cache = _cp_generate(arch)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, **LOGIT_TOL)
    assert cache.get_seq_length() == ref_len and not cache.is_compileable and cache.get_max_length() == -1


VARIANTS = [
    pytest.param("mistral-window5", {"max_cache_len": 20}, id="mistral-window5-static"),
    pytest.param("gemma2-softcap-window5", {"max_cache_len": 17}, id="gemma2-static-exact-fit"),
    pytest.param("llama", {"page_size": 3}, id="llama-paged3"),
    pytest.param("gpt-oss-sinks-window5", {"page_size": 4, "max_cache_len": 19}, id="gpt-oss-static-paged4"),
    pytest.param("qwen3", {"page_size": 1}, id="qwen3-paged1"),
]


@pytest.mark.parametrize("arch, cache_kwargs", VARIANTS)
def test_cache_variants_match_eager(refs, arch, cache_kwargs):
    ref_tokens, ref_logits, _, ref_len = refs(arch)
    tokens, logits, cache = _cp_generate(arch, **cache_kwargs)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, **LOGIT_TOL)
    assert int(cache.get_seq_length()) == ref_len
    static = "max_cache_len" in cache_kwargs
    assert cache.is_compileable == static
    assert cache.get_max_length() == (cache_kwargs["max_cache_len"] if static else -1)
    layer = cache.layers[0]
    if "page_size" in cache_kwargs:
        assert layer.keys.shape[1] == cache_kwargs["page_size"] and layer.block_table.dtype == torch.int32
    else:
        assert layer.block_table is None and layer.keys.shape[:2] == (3, 2)


# Beam search over the padded batch (3 prompts x 2 beams: rows reordered at every step); prompt lookup on
# the left-padded prompt 1 alone, whose drafts are partly rejected (the cache is cropped by 2 at step 3).
MODE_CASES = [
    pytest.param(arch, mode, row, kw, id=f"{arch}-{mode}-{name}")
    for arch in ("llama", "gpt-oss-sinks-window5")
    for mode, row in (("beam2", None), ("lookup3", 1))
    for name, kw in (("dynamic", {}), ("static-paged3", {"max_cache_len": 24, "page_size": 3}))]


@pytest.mark.parametrize("arch, mode, row, cache_kwargs", MODE_CASES)
def test_generation_modes_match_eager(refs, monkeypatch, arch, mode, row, cache_kwargs):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch path: the modes' cache bookkeeping is the point
    calls = []
    for cls, name in ((cph.CPCacheLayer, "reorder_cache"), (cph.CPCache, "crop")):
        orig = getattr(cls, name)
        monkeypatch.setattr(cls, name,
                            lambda self, arg, orig=orig, name=name: (calls.append((name, arg)), orig(self, arg))[1])
    ref_tokens, ref_logits, _, ref_len = refs(arch, mode=mode, row=row)
    tokens, logits, cache = _cp_generate(arch, mode=mode, row=row, **cache_kwargs)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, **MODE_TOL)
    assert int(cache.get_seq_length()) == ref_len
    if mode == "beam2":  # some step picked the rows in another order
        assert any(n == "reorder_cache" and not torch.equal(a.cpu(), torch.arange(len(a))) for n, a in calls)
    else:  # some step rejected drafted tokens
        assert any(n == "crop" and a < 0 for n, a in calls)


def test_crop_takes_a_count_as_a_tensor(refs, monkeypatch):
    """Prompt lookup where transformers passes ``crop`` the rejected drafts' count as a 0-d tensor (as 5.17
    does): the same tokens; a count that is no integer is refused."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    crop = cph.CPCache.crop
    monkeypatch.setattr(cph.CPCache, "crop", lambda self, n: crop(self, torch.as_tensor(n)))
    ref_tokens, ref_logits, _, ref_len = refs("llama", mode="lookup3", row=1)
    tokens, logits, cache = _cp_generate("llama", mode="lookup3", row=1)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, **MODE_TOL)
    assert int(cache.get_seq_length()) == ref_len
    for bad in (torch.tensor(-1.0), torch.tensor([-1, -1]), -1.0, True):
        with pytest.raises(TypeError, match="crop"):
            crop(cache, bad)


@pytest.mark.parametrize("arch, fp8, cache_kwargs", [
    pytest.param("gemma2-softcap-window5", "float8_e4m3fn", {}, id="gemma2-e4m3"),
    pytest.param("llama", "float8_e5m2", {"page_size": 4, "max_cache_len": 20}, id="llama-e5m2-static-paged4"),
    pytest.param("qwen3", "float8_e4m3fn", {"max_cache_len": 20}, id="qwen3-e4m3-static"),
])
def test_fp8_shards_match_eager_loosely(refs, arch, fp8, cache_kwargs):
    """FP8 shards: per-KV-head scales from the prefill's amax; logits within a few percent of their range
    (weights of std 0.1: the large scores of std 0.5 turn FP8's rounding of K into larger logit errors)."""
    ref_tokens, ref_logits, _, ref_len = refs(arch, init=0.1)
    tokens, logits, cache = _cp_generate(arch, init=0.1, dtype=getattr(torch, fp8), **cache_kwargs)
    layer = cache.layers[1]
    assert layer.keys.dtype == getattr(torch, fp8) and layer.k_scale.shape == (2,)
    # the first step (the prefill's logits) is compared whatever the later tokens do
    tol = FP8_TOL[fp8] * float(ref_logits.abs().max())
    torch.testing.assert_close(logits[0], ref_logits[0], atol=tol, rtol=0)
    if torch.equal(tokens, ref_tokens):
        torch.testing.assert_close(logits, ref_logits, atol=tol, rtol=0)
    assert int(cache.get_seq_length()) == ref_len


def test_fp8_scales_widen_over_a_chunked_prefill(refs):
    """An FP8 layer's scales come from its first update; a later prefill chunk whose K/V reach further widens
    them (the stored tokens requantised), so a chunked prefill is as close to eager as a whole one."""
    ref_tokens, ref_logits, _, _ = refs("llama", padded=False, init=0.1)
    tol = FP8_TOL["float8_e4m3fn"] * float(ref_logits.abs().max())
    for cache_kwargs in ({}, {"max_cache_len": 20, "page_size": 4}):
        model = tiny_model("llama", initializer_range=0.1)
        model.set_attn_implementation("cp_attention")
        cache = cph.CPCache(model.config, dtype=torch.float8_e4m3fn, **cache_kwargs)
        ids, mask = prompts(padded=False)
        tokens, logits = generate(model, ids, mask, cache, prefill_chunk_size=2)
        torch.testing.assert_close(logits, ref_logits, atol=tol, rtol=0)
        assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("arch, padded", [("llama", True), ("gpt-oss-sinks-window5", False)])
def test_several_query_rows_on_a_filled_cache(refs, arch, padded):
    """A forward of 3 tokens on a non-empty cache (the multi-row decode path) equals the DynamicCache's."""
    model = tiny_model(arch)
    model.set_attn_implementation("cp_attention")
    ids, mask = prompts(padded=padded)
    got = forward_rows(model, ids, mask, cph.CPCache(model.config), 3)
    torch.testing.assert_close(got, refs(arch, padded, 3), **LOGIT_TOL)


def test_unpadded_prompts_take_the_flash_prefill(refs, monkeypatch):
    """Prompts without padding, window or softcap prefill with FlashAttention calls (no masked chunks)."""
    calls = []
    real = cph._masked_chunk
    monkeypatch.setattr(cph, "_masked_chunk", lambda *a: calls.append(1) or real(*a))
    ref_tokens, ref_logits, _, _ = refs("llama", False)
    tokens, logits, _ = _cp_generate("llama", padded=False)
    assert torch.equal(tokens, ref_tokens) and not calls
    torch.testing.assert_close(logits, ref_logits, **LOGIT_TOL)


def test_plain_forward_without_cache():
    """Without a cache (``use_cache=False``) the function attends the queries' own keys on one process."""
    model = tiny_model("gemma2-softcap-window5")
    ids, mask = prompts()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        model.set_attn_implementation("cp_attention")
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()[:, :, None].expand_as(ref)  # padding positions differ (eager attends them uniformly)
    torch.testing.assert_close(got[real], ref[real], **LOGIT_TOL)


def test_generate_without_cpcache_fails_clearly():
    model = tiny_model("llama")
    model.set_attn_implementation("cp_attention")
    ids, mask = prompts()
    with pytest.raises(ValueError, match="pass past_key_values=cp_attention.hf.CPCache"):
        generate(model, ids, mask)


def test_right_padding_is_refused():
    model = tiny_model("llama")
    model.set_attn_implementation("cp_attention")
    ids, mask = prompts()
    with pytest.raises(ValueError, match="must be left padding"):
        generate(model, ids, mask.flip(1), cph.CPCache(model.config))


def test_mask_function_gives_first_positions():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]]).bool()
    first = cph.cp_attention_mask(3, 4, 4, attention_mask=mask)
    assert first.shape == (3, 1, 1, 1) and first.flatten().tolist() == [2, 0, 3]
    assert cph.cp_attention_mask(3, 4, 4, attention_mask=torch.ones(3, 4, dtype=torch.bool)) is None
    assert cph.cp_attention_mask(3, 1, 5, attention_mask=None) is None


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("cache_kwargs", [{}, {"max_cache_len": 24}], ids=["dynamic", "static"])
def test_a_decode_mask_that_hides_other_positions_is_refused(padded, cache_kwargs):
    """After the prefill, a one-token forward whose mask hides other positions than the prefill's padding
    (a hole after a one, padding dropped, no mask for a padded batch) raises instead of attending the
    prefill's padding; the mask that generate() passes (extended with ones) is accepted."""
    model = tiny_model("llama")
    model.set_attn_implementation("cp_attention")
    ids, mask = prompts(padded=padded)
    token = torch.full((3, 1), 5)
    full = torch.cat([mask, torch.ones_like(token)], dim=1)
    hole = full.clone()
    hole[:, 8] = 0
    cases = [hole, None] + ([torch.ones_like(full)] if padded else [])
    for bad in cases:
        cache = cph.CPCache(model.config, **cache_kwargs)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
            step = dict(input_ids=token, position_ids=(full.cumsum(-1) - 1)[:, -1:], use_cache=True,
                        **{cache_kwarg(model): cache})
            if bad is None and not padded:
                model(attention_mask=None, **step)  # no mask and no padding: nothing hidden
                continue
            with pytest.raises(ValueError, match="hides other positions than the first forward's left padding"):
                model(attention_mask=bad, **step)
            model(attention_mask=full, **step)


def test_reorder_cache_reorders_the_padding():
    """Beam search's row reorder moves each row's padding with its shard."""
    model = tiny_model("llama")
    model.set_attn_implementation("cp_attention")
    ids, mask = prompts()
    cache = cph.CPCache(model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
    before = cache._shared.pad.clone()
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    assert torch.equal(cache._shared.pad, before[[2, 0, 1]])


def test_import_registers_without_transformers_in_the_core():
    code = ("import sys, cp_attention, cp_attention.distributed; assert 'transformers' not in sys.modules; "
            "import cp_attention.hf; from transformers import AttentionInterface; "
            "from transformers.masking_utils import AttentionMaskInterface; "
            "assert 'cp_attention' in AttentionInterface._global_mapping; "
            "assert 'cp_attention' in AttentionMaskInterface._global_mapping")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def _bad(kind):
    llama = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    if kind == "head-dim-20":
        return transformers.LlamaConfig(**llama, head_dim=20)
    if kind == "head-dim-264":
        return transformers.LlamaConfig(**llama, head_dim=264)
    if kind == "encoder-decoder":
        return transformers.T5Config(d_model=64, num_heads=4, d_kv=32)
    if kind == "alibi":
        return transformers.BloomConfig(hidden_size=64, n_head=4)
    if kind == "mla":
        return transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, kv_lora_rank=32)
    if kind == "chunked":
        return transformers.Llama4TextConfig(**llama, attention_chunk_size=16)
    if kind == "layer-types":
        return transformers.Qwen3Config(**llama, head_dim=32, layer_types=["full_attention", "linear_attention"])
    if kind == "no-attention":
        return transformers.MambaConfig(hidden_size=64, num_hidden_layers=2)
    if kind in ("diffllama", "jetmoe", "doge", "moshi", "hrm"):
        name = {"diffllama": "DiffLlamaConfig", "jetmoe": "JetMoeConfig", "doge": "DogeConfig",
                "moshi": "MoshiConfig", "hrm": "HrmTextConfig"}[kind]
        if not hasattr(transformers, name):
            pytest.skip(f"transformers {transformers.__version__} has no {name}")
        return getattr(transformers, name)()
    raise AssertionError(kind)


@pytest.mark.parametrize("kind, message", [
    ("head-dim-20", r"head_dim 20 is not supported \(a multiple of 8 in \[32, 256\]\)"),
    ("head-dim-264", "head_dim 264 is not supported"),
    ("encoder-decoder", "encoder-decoder models"),
    ("alibi", "ALiBi"),
    ("mla", "multi-head latent attention"),
    ("chunked", "chunked attention"),
    ("layer-types", r"layer types \['linear_attention'\] are not supported"),
    ("no-attention", "no attention layers"),
    ("diffllama", "differential attention"),
    ("jetmoe", "tiles the KV heads"),
    ("doge", "dynamic-mask attention"),
    ("moshi", "sliding window is applied by the cache at decode only"),
    ("hrm", "reused across cycles"),
])
def test_bad_configs_rejected(kind, message):
    with pytest.raises(ValueError, match=message):
        cph.CPCache(_bad(kind))


@pytest.mark.parametrize("kwargs, error, message", [
    ({"max_cache_len": 0}, ValueError, "max_cache_len must be a positive int"),
    ({"page_size": 2.0}, ValueError, "page_size must be a positive int"),
    ({"dtype": torch.int8}, TypeError, "dtype must be one of"),
    ({"device": "meta"}, ValueError, "device must be the CPU or a CUDA device"),
])
def test_bad_cache_arguments_rejected(kwargs, error, message):
    with pytest.raises(error, match=message):
        cph.CPCache(tiny_model("llama").config, **kwargs)


def _assert_generate_refused(model_class, config, match):
    """``generate()`` of a random ``model_class(config)`` with ``"cp_attention"`` and a CPCache raises ``ValueError``
    matching ``match``."""
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.set_attn_implementation(cph.IMPLEMENTATION)
    ids, mask = prompts(padded=False)
    with pytest.raises(ValueError, match=match):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                       **{cache_kwarg(model): cph.CPCache(model.config)})


def test_bidirectional_attention_is_refused():
    """A BERT-style decoder without config.is_decoder attends both ways (its mask lets a position see later
    ones): refused at the prefill, where a causal answer would silently differ."""
    config = transformers.BertConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, is_decoder=False)
    _assert_generate_refused(transformers.BertLMHeadModel, config, "lets a position see later ones")


def test_attention_outside_the_interface_is_refused():
    """GPT-Neo's attention does not go through transformers' AttentionInterface: its config keeps "eager",
    which the first update refuses (a layer that updates without attending is noticed by the next update:
    test_a_model_left_on_another_attention_is_refused)."""
    config = transformers.GPTNeoConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=2,
                                       attention_types=[[["global"], 2]], max_position_embeddings=64)
    _assert_generate_refused(transformers.GPTNeoForCausalLM, config,
                             "attn_implementation='eager'; a CPCache needs 'cp_attention'")


def test_a_model_left_on_another_attention_is_refused():
    """A CPCache given to a model that attends with sdpa: refused at the first update (one layer: no later
    layer's update could notice), and an update whose attention never ran is noticed at the next forward."""
    model = tiny_model("llama", num_hidden_layers=1)
    model.set_attn_implementation("sdpa")
    ids, mask = prompts(padded=False)
    with pytest.raises(ValueError, match="attn_implementation='sdpa'; a CPCache needs 'cp_attention'"):
        generate(model, ids, mask, cph.CPCache(model.config))
    model.set_attn_implementation("cp_attention")
    cache = cph.CPCache(model.config)
    cache.update(torch.zeros(3, 2, 11, 16), torch.zeros(3, 2, 11, 16), 0)  # no attention reads it
    with pytest.raises(ValueError, match="did not run through attn_implementation='cp_attention'"):
        cache.update(torch.zeros(3, 2, 1, 16), torch.zeros(3, 2, 1, 16), 0)


def test_attention_weights_are_refused():
    model = tiny_model("llama")
    model.set_attn_implementation("cp_attention")
    ids, mask = prompts()
    with pytest.raises(ValueError, match="output_attentions=True needs attn_implementation='eager'"):
        generate(model, ids, mask, cph.CPCache(model.config), output_attentions=True)


def test_packed_sequences_are_refused():
    """position_ids that restart within a row (packed sequences, no mask): transformers' mask keeps each
    sequence to itself, which the causal rule over the row would not."""
    model = tiny_model("llama")
    ids, _ = prompts(padded=False)
    pos = torch.cat([torch.arange(5), torch.arange(6)]).expand(3, -1)
    model.set_attn_implementation("cp_attention")
    with pytest.raises(ValueError, match="packed sequences"), torch.no_grad():
        model(input_ids=ids, position_ids=pos, use_cache=False)
    with torch.no_grad():  # the same positions unpacked are accepted
        model(input_ids=ids, position_ids=torch.arange(11).expand(3, -1), use_cache=False)


@pytest.mark.parametrize("cache_kwargs", [{"max_cache_len": 15}, {"max_cache_len": 15, "page_size": 4}])
def test_decode_past_max_cache_len_is_refused(cache_kwargs):
    """A preallocated cache too short for the new tokens (11 + 5 > 15) raises at the step that overflows,
    naming max_cache_len, instead of writing the token nowhere."""
    model = tiny_model("llama")
    model.set_attn_implementation("cp_attention")
    ids, mask = prompts()
    cache = cph.CPCache(model.config, **cache_kwargs)
    with pytest.raises(ValueError, match="16 tokens exceed max_cache_len = 15"):
        generate(model, ids, mask, cache, new_tokens=6)
    assert int(cache.get_seq_length()) == 15


def test_a_cache_keeps_its_batch():
    model = tiny_model("llama")
    model.set_attn_implementation("cp_attention")
    ids, mask = prompts()
    cache = cph.CPCache(model.config, max_cache_len=32)
    generate(model, ids, mask, cache, new_tokens=2)
    cache.reset()
    with pytest.raises(ValueError, match="holds 3 rows .* a forward of 1 rows needs a new CPCache"):
        generate(model, ids[:1], mask[:1], cache, new_tokens=2)
    # without reset() the filled cache's length meets the new batch's mask first (a preallocated cache's
    # offset comes as a tensor)
    for cache_kwargs in ({}, {"max_cache_len": 32}):
        cache = cph.CPCache(model.config, **cache_kwargs)
        generate(model, ids, mask, cache, new_tokens=2)
        for kwargs in ({}, {"use_cache": False}):
            with pytest.raises(ValueError, match=r"\(12 held\) .* needs reset\(\) .*use_cache=False\) no cache"):
                generate(model, ids[:2], mask[:2], cache, new_tokens=2, **kwargs)
    # the same prompt again on the cache that holds it: transformers feeds it whole, which would attend it twice
    for cache_kwargs in ({}, {"max_cache_len": 32}):
        cache = cph.CPCache(model.config, **cache_kwargs)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
        with pytest.raises(ValueError, match=r"cover the 22 positions of the cache \(11 held\)"):
            generate(model, ids, mask, cache, new_tokens=2)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
@pytest.mark.parametrize("cache_kwargs", [{}, {"max_cache_len": 24, "page_size": 3}], ids=["dynamic", "static-paged3"])
def test_a_chunked_prefill_of_left_padded_prompts_matches_eager(refs, monkeypatch, chunk, cache_kwargs):
    """generate(prefill_chunk_size=c) of the left-padded batch, whose first chunks hold only padding in some
    rows (prompt 1 has 7 zeros): those rows take more padding at each chunk until their first real token; the
    tokens and logits are eager's unchunked ones."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ref_tokens, ref_logits, _, ref_len = refs("llama")
    model = tiny_model("llama")
    model.set_attn_implementation("cp_attention")
    cache = cph.CPCache(model.config, **cache_kwargs)
    ids, mask = prompts()
    tokens, logits = generate(model, ids, mask, cache, prefill_chunk_size=chunk)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, **LOGIT_TOL)
    assert int(cache.get_seq_length()) == ref_len
    assert cache._shared.pad.tolist() == [0, 7, 3]


def test_a_window_given_only_by_the_config_is_applied():
    """Qwen2-MoE windows its sliding layers through the mask only (no sliding_window argument): the window
    comes from the config, as transformers' own mask applies it."""
    config = transformers.Qwen2MoeConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                         use_sliding_window=True, sliding_window=5, max_window_layers=2,
                                         initializer_range=0.5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ids, mask = prompts()
    ref, ref_logits = generate(model, ids, mask)
    model.set_attn_implementation(cph.IMPLEMENTATION)
    tokens, logits = generate(model, ids, mask, cph.CPCache(model.config))
    assert torch.equal(tokens, ref)
    torch.testing.assert_close(logits, ref_logits, **LOGIT_TOL)


# ------------------------------------------------------------------------------------------------------
# decode_ahead: transformers' loop with its stop check read one step late


@pytest.fixture
def late_stops(monkeypatch):
    """Every ``_LateStop`` the calls build, with the steps ``finish`` undid."""
    made = []
    init, finish = cph._LateStop.__init__, cph._LateStop.finish
    monkeypatch.setattr(cph._LateStop, "__init__", lambda self, *a, **k: (made.append(self), init(self, *a, **k))[1])
    monkeypatch.setattr(cph._LateStop, "finish", lambda self: setattr(self, "undone", finish(self)) or self.undone)
    return made


AHEAD_CASES = [
    pytest.param("llama", {}, id="llama-dynamic"),
    pytest.param("gemma2-softcap-window5", {"max_cache_len": 20}, id="gemma2-static"),
    pytest.param("gpt-oss-sinks-window5", {"max_cache_len": 19, "page_size": 4}, id="gpt-oss-static-paged4"),
]


@pytest.mark.parametrize("arch, cache_kwargs", AHEAD_CASES)
def test_decode_ahead_matches_generate(refs, monkeypatch, late_stops, arch, cache_kwargs):
    """Greedy to max_new_tokens: the tokens and logits of generate() with the same cache, bitwise, and of
    transformers' eager attention; no step undone."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ref_tokens, ref_logits, _, ref_len = refs(arch)
    tokens, logits, cache = _cp_generate(arch, **cache_kwargs)
    model = tiny_model(arch)
    model.set_attn_implementation("cp_attention")
    ahead_cache = cph.CPCache(model.config, **cache_kwargs)
    ahead_tokens, ahead_logits = generate(model, *prompts(), ahead_cache, ahead=True)
    assert len(late_stops) == 1 and late_stops[0].undone == 0 and late_stops[0].steps == NEW_TOKENS
    assert torch.equal(ahead_tokens, tokens) and torch.equal(ahead_logits, logits)
    assert torch.equal(ahead_tokens, ref_tokens)
    torch.testing.assert_close(ahead_logits, ref_logits, **LOGIT_TOL)
    assert int(ahead_cache.get_seq_length()) == int(cache.get_seq_length()) == ref_len


@pytest.mark.parametrize("cache_kwargs", [{}, {"max_cache_len": 24}, {"max_cache_len": 24, "page_size": 3}],
                         ids=["dynamic", "static", "static-paged3"])
def test_decode_ahead_undoes_the_step_after_every_row_stopped(monkeypatch, late_stops, cache_kwargs):
    """EOS tokens end every row before max_new_tokens: one extra step ran and is undone (its token dropped,
    its position cropped), so the sequences, the cache length and the next forward on the cache equal
    generate()'s."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_model("llama")
    model.set_attn_implementation("cp_attention")
    ids, mask = prompts()
    free, _ = generate(model, ids, mask, cph.CPCache(model.config, **cache_kwargs))
    eos = [int(free[0, 1]), int(free[1, 3]), int(free[2, 2])]  # every row ends by its fourth new token
    runs = []
    for ahead in (False, True):
        cache = cph.CPCache(model.config, **cache_kwargs)
        tokens, logits = generate(model, ids, mask, cache, ahead=ahead, eos_token_id=eos)
        more = torch.full((ids.shape[0], 1), 5)
        full = torch.cat([mask, torch.ones_like(tokens), torch.ones_like(more)], dim=1)
        with torch.no_grad():
            after = model(input_ids=more, attention_mask=full, position_ids=(full.sum(1, keepdim=True) - 1),
                          use_cache=True, **{cache_kwarg(model): cache}).logits
        runs.append((tokens, logits, int(cache.get_seq_length()), after))
    (tokens, logits, length, after), (a_tokens, a_logits, a_length, a_after) = runs
    assert tokens.shape[1] < NEW_TOKENS and late_stops[-1].undone == 1
    assert torch.equal(a_tokens, tokens) and torch.equal(a_logits, logits) and a_length == length
    assert torch.equal(a_after, after)


def test_decode_ahead_samples_as_generate(monkeypatch, late_stops):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_model("mistral-window5")
    model.set_attn_implementation("cp_attention")
    ids, mask = prompts()
    runs = []
    for ahead in (False, True):
        torch.manual_seed(3)
        runs.append(generate(model, ids, mask, cph.CPCache(model.config, max_cache_len=20), ahead=ahead,
                             do_sample=True, top_k=8))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]) and len(late_stops) == 1


def test_decode_ahead_refuses_other_modes_and_caches():
    model = tiny_model("llama")
    model.set_attn_implementation("cp_attention")
    ids, mask = prompts()
    with pytest.raises(ValueError, match="greedy search and sampling, not beam_search"):
        generate(model, ids, mask, cph.CPCache(model.config), mode="beam2", ahead=True)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="decodes on a CPCache"):
        generate(model, ids, mask, transformers.DynamicCache(config=model.config), ahead=True)


# ------------------------------------------------------------------------------------------------------
# The prefill's attention states against a float64 oracle


def _oracle(q, k, v, t0, first, window_left, scale, softcap=None):
    """float64 state of ``q [B, Hq, c, D]`` (global positions ``t0 + i``) over the whole cache ``k``/``v``."""
    b, c = q.shape[0], q.shape[2]
    t = t0 + torch.arange(c)
    lo = torch.zeros(b, c, dtype=torch.long) if first is None else first.long()[:, None].expand(b, c)
    if window_left is not None:
        lo = torch.maximum(lo, t - window_left)
    limits = torch.stack([lo, (t + 1).expand(b, c)], dim=-1)
    return attention(q.double().transpose(1, 2), k.double(), v.double(), sm_scale=scale, row_limits=limits,
                     logit_softcap=softcap)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("variant", ["causal", "padded-window-softcap"])
def test_prefill_states_merge_to_the_oracle(world, variant):
    """Every rank's state over its interleaved slots (FlashAttention per residue, or the masked chunks), merged
    with ⊕, is the float64 attention over the whole cache: o, and the natural-log LSE."""
    torch.manual_seed(0)
    b, hq, hkv, s, d, scale = 2, 4, 2, 13, 40, 0.3
    q = torch.randn(b, hq, s, d)
    k, v = torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    first = torch.tensor([0, 5]) if variant != "causal" else None
    window, cap = (4, 2.0) if variant != "causal" else (None, None)
    states = []
    for rank in range(world):
        k_loc, v_loc = k[:, :, rank::world], v[:, :, rank::world]
        if variant == "causal":
            st = cph._causal_residues(q, k_loc, v_loc, rank, world, scale)
        else:
            st = cph._masked_chunk(q, k_loc, v_loc, 0, first, window, rank, world, scale, cap)
        states.append(st)
    merged = cph.merge_states(torch.stack([st.o.float() for st in states]), torch.stack([st.lse for st in states]))
    ref = _oracle(q, k, v, 0, first, window, scale, cap)
    seen = torch.isfinite(ref.lse)
    torch.testing.assert_close(merged.o.double()[seen], ref.o[seen], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(merged.lse.double()[seen], ref.lse[seen], atol=2e-5, rtol=1e-5)
    assert (merged.o[~seen] == 0).all() and torch.isneginf(merged.lse[~seen]).all()


# ------------------------------------------------------------------------------------------------------
# W = 2 and W = 3: one torchrun launch each, every case in it

STEP_DIFFERS = "every rank must run the same decode step"
DIST_CASES = {
    2: (True, [{"id": a, "arch": a} for a in ARCHS] + [
        {"id": "mistral-static-paged3", "arch": "mistral-window5", "cache": {"max_cache_len": 20, "page_size": 3}},
        {"id": "llama-unpadded", "arch": "llama", "padded": False},
        {"id": "llama-rows3", "arch": "llama", "rows": 3},
        {"id": "gpt-oss-beam2-paged3", "arch": "gpt-oss-sinks-window5", "mode": "beam2", "cache": {"page_size": 3}},
        {"id": "gemma2-ahead-static", "arch": "gemma2-softcap-window5", "ahead": True, "cache": {"max_cache_len": 20}},
        {"id": "llama-sampled", "arch": "llama", "mode": "sample"},
        {"id": "llama-chunks3", "arch": "llama", "generate": {"prefill_chunk_size": 3}},
        {"id": "qwen3-sampled-ahead-static", "arch": "qwen3", "mode": "sample", "ahead": True,
         "cache": {"max_cache_len": 20}},
    ] + [  # rank 1 differs: every rank refuses the prefill (and the next case still runs on the group)
        {"id": f"differs-{what}", "arch": "mistral-window5", "rank_differs": what, "expect": expect}
        for what, expect in (("prompt", "layer 0's new keys differ"), ("padding", "layer 0's new keys differ"),
                             ("weights", "layer 0's new keys differ"), ("window", "same cache dtype and layer windows"),
                             ("dtype", "same cache dtype and layer windows"))] + [
        # the same ids and positions, the padding masked on rank 0 only: the keys agree, the masks do not
        {"id": "differs-mask", "arch": "llama", "rank_differs": "mask", "same_positions": True,
         "expect": "left padding differs between ranks"},
        {"id": "same-mask", "arch": "llama", "same_positions": True, "expect": "no error"},
        # in chunks of 3: the rows' padding grows alike until rank 1 masks prompt 1's first real token too
        {"id": "differs-mask-later", "arch": "llama", "rank_differs": "mask-later", "same_positions": True, "chunk": 3,
         "expect": "left padding on some rank, or differs between ranks"},
        {"id": "same-mask-chunks3", "arch": "llama", "same_positions": True, "chunk": 3, "expect": "no error"},
    ] + [
        # rank 1 samples with another seed: the tokens part, and the next decode step raises on every rank
        {"id": "differs-seed", "arch": "llama", "mode": "sample", "rank_differs": "seed", "expect": STEP_DIFFERS},
        {"id": "differs-seed-ahead-static", "arch": "llama", "mode": "sample", "ahead": True, "rank_differs": "seed",
         "cache": {"max_cache_len": 20}, "expect": STEP_DIFFERS},
        {"id": "differs-seed-ahead", "arch": "qwen3", "mode": "sample", "ahead": True, "rank_differs": "seed",
         "expect": STEP_DIFFERS},
        # a traced decode step: the same token passes, another token on rank 1 stops at the device assert
        {"id": "same-token-compiled", "arch": "mistral-window5", "compiled_step": True, "cache": {"max_cache_len": 20},
         "expect": "no error"},
        {"id": "differs-token-compiled", "arch": "mistral-window5", "compiled_step": True, "rank_differs": "token",
         "cache": {"max_cache_len": 20}, "expect": "step 1: CPCache: " + STEP_DIFFERS},
        # traced steps of 3 tokens a row (compiled verification steps): the same, gathered likewise
        {"id": "same-tokens-compiled-rows3", "arch": "llama", "compiled_step": True, "step_rows": 3,
         "cache": {"max_cache_len": 20}, "expect": "no error"},
        {"id": "differs-tokens-compiled-rows3", "arch": "llama", "compiled_step": True, "step_rows": 3,
         "rank_differs": "token", "cache": {"max_cache_len": 20}, "expect": "step 1: CPCache: " + STEP_DIFFERS},
    ]),
    3: (False, [{"id": a, "arch": a} for a in ARCHS] + [
        {"id": "llama-static-unpadded", "arch": "llama", "padded": False, "cache": {"max_cache_len": 17}},
        {"id": "gemma2-fp8-paged2", "arch": "gemma2-softcap-window5",
         "cache": {"dtype": "float8_e4m3fn", "page_size": 2}},
        {"id": "gpt-oss-rows3-unpadded", "arch": "gpt-oss-sinks-window5", "rows": 3, "padded": False},
        {"id": "llama-lookup3-static", "arch": "llama", "mode": "lookup3", "row": 1, "cache": {"max_cache_len": 24}},
        {"id": "qwen3-ahead-paged2", "arch": "qwen3", "ahead": True, "cache": {"page_size": 2}},
        {"id": "gpt-oss-chunks2-static", "arch": "gpt-oss-sinks-window5", "generate": {"prefill_chunk_size": 2},
         "cache": {"max_cache_len": 20}},
    ]),
}


def _run_worker(tmp, world, interpret, cases):
    (tmp / "cases.json").write_text(json.dumps(cases))
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(WORKER),
           str(tmp / "cases.json"), str(tmp)]
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:  # a session of its own: a timeout kills every rank
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    assert proc.returncode == 0, out[-3000:] + err[-6000:]
    return [torch.load(tmp / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory):
    done = {}

    def get(world):
        if world not in done:
            interpret, cases = DIST_CASES[world]
            done[world] = _run_worker(tmp_path_factory.mktemp(f"w{world}"), world, interpret, cases)
        return done[world]

    return get


@pytest.mark.parametrize("world, case", [
    pytest.param(w, c, id=f"{c['id']}-W{w}-{'interp' if DIST_CASES[w][0] else 'torch'}")
    for w in DIST_CASES for c in DIST_CASES[w][1] if "expect" not in c])
def test_context_parallel_generate_matches_eager(refs, dist_runs, world, case):
    results = [ranks[case["id"]] for ranks in dist_runs(world)]
    tokens, logits, length = results[0]
    for r, (t, lg, n) in enumerate(results[1:], 1):  # every rank computed the same bits
        assert torch.equal(lg, logits) and n == length and (t is None or torch.equal(t, tokens)), f"rank {r}"
    padded = case.get("padded", True)
    if case.get("rows"):
        torch.testing.assert_close(logits, refs(case["arch"], padded, case["rows"]), **LOGIT_TOL)
        return
    ref_tokens, ref_logits, _, ref_len = refs(case["arch"], padded, mode=case.get("mode"), row=case.get("row"))
    assert length == ref_len
    if "dtype" in case.get("cache", {}):
        tol = FP8_TOL[case["cache"]["dtype"]] * float(ref_logits.abs().max())
        torch.testing.assert_close(logits[0], ref_logits[0], atol=tol, rtol=0)
        return
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, **LOGIT_TOL)


@pytest.mark.parametrize("case", [c for c in DIST_CASES[2][1] if "expect" in c], ids=lambda c: c["id"])
def test_ranks_given_other_inputs_raise_on_every_rank(dist_runs, case):
    """Ranks whose prompts, padding, weights, windows or cache dtypes differ would give tokens that are wrong or
    differ between ranks: the prefill's agreement check raises on both, and the group goes on working. Ranks
    that sample with other seeds feed other tokens back: the next decode step raises on both (read a step late
    under decode_ahead; a traced step asserts on the device)."""
    messages = [ranks[case["id"]] for ranks in dist_runs(2)]
    assert all(case["expect"] in m for m in messages), messages


# ------------------------------------------------------------------------------------------------------
# torch.compile


def _decode_ready_cache(arch="mistral-window5", **cache_kwargs):
    """A model and a preallocated CPCache after a prefill, with the next step's inputs."""
    model = tiny_model(arch)
    model.set_attn_implementation("cp_attention")
    cache = cph.CPCache(model.config, max_cache_len=24, **cache_kwargs)
    ids, mask = prompts()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
    return model, cache, out.logits[:, -1].argmax(-1, keepdim=True), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)


@pytest.mark.parametrize("paged", [False, True])
def test_static_update_traces_fullgraph(paged):
    """A preallocated layer's update (owner and slot on the device, scratch writes) traces whole."""
    _, cache, _, _ = _decode_ready_cache(**({"page_size": 4} if paged else {}))
    layer = cache.layers[1]
    k_new = torch.randn(3, 2, 1, 32)
    before = (layer._k.clone(), layer._v.clone())
    cache._shared.begin(k_new)  # the step starts (layer 0 does it in a forward)
    compiled = torch.compile(layer.update, backend="eager", fullgraph=True)
    got = compiled(k_new, k_new + 1)
    assert got[0] is k_new or torch.equal(got[0], k_new)
    written = (layer._k != before[0]).any(dim=-1)
    assert written.any()  # the new token landed in this (only) rank's shard
    local = layer.local_kv(int(cache._shared.seq_lens[0]), torch.float32)[0]
    torch.testing.assert_close(local[:, :, -1], k_new[:, :, 0])


def test_compiled_generate_decode_step_fullgraph():
    """The decode step of a model on a preallocated CPCache traces whole (what transformers' compiled
    generation compiles), and equals the eager step."""
    model, cache, token, mask = _decode_ready_cache()
    positions = (mask.cumsum(-1) - 1)[:, -1:]
    masks = cph.cp_attention_mask(3, 1, mask.shape[1], attention_mask=mask.bool())
    step = torch.compile(model.forward, backend="eager", fullgraph=True)
    with torch.no_grad():
        got = step(input_ids=token, attention_mask=masks, position_ids=positions, use_cache=True,
                   **{cache_kwarg(model): cache}).logits
    _, cache2, _, _ = _decode_ready_cache()
    with torch.no_grad():
        ref = model(input_ids=token, attention_mask=mask, position_ids=positions, use_cache=True,
                    **{cache_kwarg(model): cache2}).logits
    torch.testing.assert_close(got, ref, **LOGIT_TOL)


def test_compiled_step_past_max_cache_len_stops():
    """A traced decode step on a full preallocated cache cannot raise on the host: its graph asserts on the
    device (on the CPU the assert raises at once)."""
    model, cache, token, mask = _decode_ready_cache()
    cache.set_seq_length(24)  # max_cache_len
    mask = torch.ones(3, 25, dtype=mask.dtype)
    masks = cph.cp_attention_mask(3, 1, mask.shape[1], attention_mask=mask.bool())
    step = torch.compile(model.forward, backend="eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="exceed max_cache_len"), torch.no_grad():
        step(input_ids=token, attention_mask=masks, position_ids=torch.full((3, 1), 24), use_cache=True,
             **{cache_kwarg(model): cache})


def _compiled_config():
    """transformers' own compiled generation, run on the CPU (it compiles on CUDA by default)."""
    config = transformers.CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True
    return config


@pytest.mark.parametrize("kwargs", [
    pytest.param({"prompt_lookup_num_tokens": 3}, id="lookup3"),
    pytest.param({"prefill_chunk_size": 4}, id="chunks4"),
    pytest.param({"prefill_chunk_size": 17}, id="chunks17"),
])
def test_compiled_forwards_of_several_tokens_match_eager(kwargs):
    """transformers' compiled generation also compiles the forwards of several tokens (prompt lookup's and
    assisted decoding's verification steps, the chunks of a chunked prefill): on a preallocated cache they
    attend with flash_decode, in groups of 16 query rows past 16, and give eager's tokens and logits."""
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 97, (1, 37), generator=gen)
    ids[0, 20:30] = ids[0, 5:15]  # something for prompt lookup to find
    mask = torch.ones_like(ids)
    model.set_attn_implementation("eager")
    want = generate(model, ids, mask, transformers.DynamicCache(config=model.config), **kwargs)
    model.set_attn_implementation("cp_attention")
    got = generate(model, ids, mask, cph.CPCache(model.config, max_cache_len=48), compile_config=_compiled_config(),
                   **kwargs)
    torch._dynamo.reset()
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], **LOGIT_TOL)


def test_compiled_forward_of_many_rows_on_a_filled_cache():
    """A traced forward of 21 tokens on a filled, left-padded, windowed preallocated cache (two groups of
    rows) equals the DynamicCache's."""
    model = tiny_model("mistral-window5")
    model.set_attn_implementation("cp_attention")
    ids, mask = prompts()
    cache = cph.CPCache(model.config, max_cache_len=40)
    more = torch.randint(1, VOCAB, (3, 21), generator=torch.Generator().manual_seed(2))
    full = torch.cat([mask, torch.ones_like(more)], dim=1)
    positions = (full.cumsum(-1) - 1).clamp(min=0)[:, -21:]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
        step = torch.compile(model.forward, backend="eager", fullgraph=True)
        masks = cph.cp_attention_mask(3, 21, 40, q_offset=11, attention_mask=full.bool())
        got = step(input_ids=more, attention_mask=masks, position_ids=positions, use_cache=True,
                   **{cache_kwarg(model): cache}).logits
    torch._dynamo.reset()
    ref = forward_rows(tiny_model("mistral-window5"), ids, mask, transformers.DynamicCache(config=model.config), 21)
    torch.testing.assert_close(got, ref, **LOGIT_TOL)


def test_compiled_first_forward_of_a_padded_batch_stops():
    """The padding is fixed by the first forward; a traced one cannot record it on the host, so a compiled
    first forward of a left-padded batch asserts on the device (on the CPU: at once)."""
    model = tiny_model("llama")
    model.set_attn_implementation("cp_attention")
    ids, mask = prompts()
    with pytest.raises(Exception, match="hides other positions"):
        generate(model, ids, mask, cph.CPCache(model.config, max_cache_len=24), compile_config=_compiled_config(),
                 prefill_chunk_size=4)
    torch._dynamo.reset()


@pytest.mark.parametrize("paged", [False, True])
def test_decode_step_graph_inputs_do_not_alias(paged):
    """The traced decode step takes each cache buffer once: no graph input is a view of another. (An aliased
    pair that the step writes makes AOTAutograd merge them into a synthetic base, which CUDA graphs then skip
    as a mutated non-static input.)"""
    model, cache, token, mask = _decode_ready_cache(**({"page_size": 4} if paged else {}))
    positions = (mask.cumsum(-1) - 1)[:, -1:]
    masks = cph.cp_attention_mask(3, 1, mask.shape[1], attention_mask=mask.bool())
    seen = []

    def backend(gm, example_inputs):
        seen.extend(t for t in example_inputs if isinstance(t, torch.Tensor))
        return gm

    step = torch.compile(model.forward, backend=backend, fullgraph=True)
    with torch.no_grad():
        step(input_ids=token, attention_mask=masks, position_ids=positions, use_cache=True,
             **{cache_kwarg(model): cache})
    torch._dynamo.reset()
    storages = [t.untyped_storage().data_ptr() for t in seen]
    assert len(storages) == len(set(storages)), "two graph inputs share a storage"


@pytest.mark.gpu
@pytest.mark.parametrize("ahead", [False, True], ids=["generate", "decode_ahead"])
def test_compiled_generate_matches_eager_cuda(ahead):
    """32 greedy steps of transformers' own compiled generation (a preallocated CPCache makes generate()
    compile the forward, CUDA graphs), with its own loop and through decode_ahead, choose eager
    transformers' tokens."""
    new = 32
    torch._dynamo.reset()  # compile for this test's shapes (docs/performance.md: one max_cache_len per compile)
    model = tiny_model("llama").cuda()
    ids, mask = (t.cuda() for t in prompts())
    ref_tokens = reference(model, ids, mask, new_tokens=new)[0]
    model.set_attn_implementation("cp_attention")
    cache = cph.CPCache(model.config, max_cache_len=ids.shape[1] + new)
    assert cache.is_compileable
    tokens, _ = generate(model, ids, mask, cache, new_tokens=new, ahead=ahead)
    assert torch.equal(tokens, ref_tokens)


@pytest.mark.gpu
def test_compiled_prompt_lookup_matches_eager_cuda():
    """transformers' compiled generation on CUDA (CUDA graphs) with prompt lookup: its verification forwards
    of several tokens are compiled too, and choose eager transformers' tokens."""
    torch._dynamo.reset()
    model = tiny_model("llama").cuda()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (1, 37), generator=gen)
    ids[0, 20:30] = ids[0, 5:15]
    ids, mask = ids.cuda(), torch.ones_like(ids).cuda()
    ref_tokens = reference(model, ids, mask, new_tokens=24, mode="lookup3")[0]
    model.set_attn_implementation("cp_attention")
    tokens, _ = generate(model, ids, mask, cph.CPCache(model.config, max_cache_len=64), new_tokens=24,
                         mode="lookup3")
    torch._dynamo.reset()
    assert torch.equal(tokens, ref_tokens)


@pytest.mark.gpu
def test_decode_ahead_steps_do_not_wait_for_the_gpu_cuda():
    """After the compiled step's warm-up (compile, CUDA graph recording), transformers' own loop waits for the
    GPU at every step (the control: the sync is seen) and decode_ahead's loop never does (its host reads the
    stop flag through an event of the step before; ``torch.cuda.set_sync_debug_mode``)."""
    model = tiny_model("llama").cuda()
    model.set_attn_implementation("cp_attention")
    ids, mask = (t.cuda() for t in prompts())

    class Watch:  # a logits processor: watches for syncs from its sixth step on
        calls = 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls == 6:
                torch.cuda.set_sync_debug_mode("warn")
            return scores

    seen = {}
    for ahead in (False, True):
        torch._dynamo.reset()
        cache = cph.CPCache(model.config, max_cache_len=ids.shape[1] + 16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                generate(model, ids, mask, cache, new_tokens=16, ahead=ahead,
                         logits_processor=transformers.LogitsProcessorList([Watch()]))
            finally:
                torch.cuda.set_sync_debug_mode(0)
        seen[ahead] = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert seen[False], "the control saw no sync: the detection does not work"
    assert not seen[True], seen[True]
