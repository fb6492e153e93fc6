"""``launch/generate.py`` end to end: tiny random checkpoints written by ``transformers``, run with
``torchrun`` on W = 1, 2, 3 CPU processes (gloo), against ``LlamaForCausalLM.generate``-style greedy
decoding of each prompt alone (no padding).

Each case runs the script in a subprocess (``python -m torch.distributed.run --standalone``: its own
processes, a free port, a timeout), with the Triton kernels under the interpreter (``interp``) or the
library's torch path. The checkpoints use a large ``initializer_range`` so greedy choices are well separated
(the reference's top-2 logit gap is checked); float32 tokens must then match exactly. The transformers
backend (the transformers model through ``generate()`` with ``cp_attention.hf.CPCache``) must choose the
native backend's tokens, from text prompts tokenised with a word-level tokenizer saved beside the checkpoint.
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "generate.py"
TIMEOUT_S = 300
PROMPTS = [[(7 * i + 3 * n) % 256 for i in range(n)] for n in (13, 1, 29, 6)]  # ragged; 29 > the window
NEW_TOKENS = 8
MIN_MARGIN = 1e-3  # the reference's smallest top-1 minus top-2 logit over all steps


def _rope(theta, llama3=None) -> dict:
    """Rotary-embedding config kwargs for the installed transformers (v5 ``rope_parameters``, v4 ``rope_theta``
    + ``rope_scaling``)."""
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_type": "llama3" if llama3 else "default", "rope_theta": theta,
                                    **(llama3 or {})}}
    return {"rope_theta": theta, "rope_scaling": llama3 and {"rope_type": "llama3", **llama3}}


def _config(kind: str, **overrides):
    kw = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, initializer_range=0.5, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, tie_word_embeddings=kind.endswith("-tied"), **_rope(10000.0))
    if kind == "llama-untied":  # Llama 3.1 rope scaling, over a short original context so it changes frequencies
        kw.update(_rope(10000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 16}))
    cls = {"llama-untied": transformers.LlamaConfig, "llama-tied": transformers.LlamaConfig,
           "mistral-window5": transformers.MistralConfig, "qwen2-bias-tied": transformers.Qwen2Config,
           "gemma2-window5-softcap": transformers.Gemma2Config}[kind]
    if kind == "mistral-window5":
        kw["sliding_window"] = 5
    if kind == "gemma2-window5-softcap":
        # layer 0 slides (window 5), layer 1 does not; scores (std ~35 here) and logits soft-capped where
        # the cap bends them; a score scale other than head_dim ** -0.5
        kw.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=5,
                  attn_logit_softcapping=30.0, final_logit_softcapping=30.0)
    if kind.startswith("qwen2"):
        del kw["head_dim"]  # Qwen2 derives it: hidden_size // num_attention_heads = 32
    return cls(**{**kw, **overrides})


def write_checkpoint(path, kind: str, seed: int = 0, **overrides):
    """A tiny random ``kind`` checkpoint saved with ``save_pretrained`` (safetensors) into ``path``; returns
    the model (float32, eval)."""
    torch.manual_seed(seed)
    # Gemma 2's soft-capped scores need transformers' eager attention
    extra = {"attn_implementation": "eager"} if kind.startswith("gemma2") else {}
    model = transformers.AutoModelForCausalLM.from_config(_config(kind, **overrides), **extra).eval()
    model.save_pretrained(path)
    return model


def reference(model, prompts, new_tokens):
    """``generate(do_sample=False)`` of each prompt alone: (new tokens per prompt, first-step logits [B, V],
    the smallest top-2 logit gap over every step)."""
    tokens, first, margin = [], [], float("inf")
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(p):].tolist())
            first.append(out.logits[0][0].float())
            top2 = torch.cat(out.logits).float().topk(2, dim=-1).values
            margin = min(margin, float((top2[:, 0] - top2[:, 1]).min()))
    return tokens, torch.stack(first), margin


def run_generate(tmp_path, args, world, interpret=False, device="cpu", new_tokens=NEW_TOKENS):
    """``generate.py`` under torchrun with ``world`` processes; returns (CompletedProcess, JSON output or None)."""
    out = tmp_path / f"out-{os.urandom(4).hex()}.json"
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(SCRIPT),
           "--device", device, "--new-tokens", str(new_tokens), "--output", str(out), *map(str, args)]
    # A session of its own, so that a timeout kills torchrun and its workers together.
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    return done, json.loads(out.read_text()) if out.exists() else None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Checkpoint kind -> (directory, reference tokens, reference first-step logits), written on first use."""
    root = tmp_path_factory.mktemp("checkpoints")
    made = {}

    def get(kind):
        if kind not in made:
            model = write_checkpoint(root / kind, kind)
            tokens, logits, margin = reference(model, PROMPTS, NEW_TOKENS)
            assert margin > MIN_MARGIN, f"{kind}: greedy choices too close ({margin:.2e}) for an exact comparison"
            made[kind] = (root / kind, tokens, logits)
        return made[kind]

    return get


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """(kind, world, interpret) -> generate.py's JSON output, run on first use."""
    root = tmp_path_factory.mktemp("runs")
    prompts = root / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    done = {}

    def get(kind, world, interpret):
        key = (kind, world, interpret)
        if key not in done:
            proc, out = run_generate(root, ["--model", checkpoints(kind)[0], "--prompts", prompts, "--logits"], world,
                                     interpret)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
            done[key] = out
        return done[key]

    return get


CASES = [  # the kernels under the interpreter where a case adds a kernel variant (window, softcap); else torch
    pytest.param("llama-untied", 1, True, id="llama-untied-llama3rope-W1-interp"),
    pytest.param("llama-untied", 3, False, id="llama-untied-llama3rope-W3-torch"),
    pytest.param("llama-untied", 2, False, id="llama-untied-llama3rope-W2-torch"),
    pytest.param("llama-tied", 2, False, id="llama-tied-W2-torch"),
    pytest.param("mistral-window5", 2, True, id="mistral-window5-W2-interp"),
    pytest.param("mistral-window5", 3, False, id="mistral-window5-W3-torch"),
    pytest.param("qwen2-bias-tied", 3, False, id="qwen2-bias-tied-W3-torch"),
    pytest.param("gemma2-window5-softcap", 2, True, id="gemma2-window5-softcap-W2-interp"),
    pytest.param("gemma2-window5-softcap", 3, False, id="gemma2-window5-softcap-W3-torch"),
]


@pytest.mark.parametrize("kind, world, interpret", CASES)
def test_tokens_match_transformers(checkpoints, runs, kind, world, interpret):
    _, ref_tokens, ref_logits = checkpoints(kind)
    out = runs(kind, world, interpret)
    assert out["tokens"] == ref_tokens
    assert out["world_size"] == world and out["prompt_lens"] == [len(p) for p in PROMPTS]
    assert len(out["decode_step_s"]) == NEW_TOKENS - 1 and out["decode_tokens_per_s"] > 0
    assert out["environment"]["torch"] == torch.__version__  # where it ran, for the docs' tables
    # The context-parallel prefill's logits at every prompt's last position are transformers' to rounding: the
    # fused q/k/v and gate/up GEMMs and the kernels' float32 sums round in another order (logits up to ~20
    # here; 1.2e-4 apart on one CPU, within 1e-4 on another).
    torch.testing.assert_close(torch.tensor(out["prefill_logits"]), ref_logits, atol=5e-4, rtol=1e-5)


def test_prefill_across_ranks_equals_one_rank(runs):
    one, three = runs("llama-untied", 1, True), runs("llama-untied", 3, False)  # the kernels; the torch path
    torch.testing.assert_close(torch.tensor(three["prefill_logits"]), torch.tensor(one["prefill_logits"]),
                               atol=5e-4, rtol=1e-5)
    assert [t[0] for t in three["tokens"]] == [t[0] for t in one["tokens"]]


@pytest.mark.parametrize("defect, message", [
    ("missing-tensor", "lacks tensor(s) model.layers.1.mlp.up_proj.weight"),
    ("model-type", "unsupported model_type 'gpt2'"),
    ("head-dim-20", "head_dim 20 is not supported"),
    ("gemma2-relu", "unsupported hidden_activation 'relu'"),
    ("gemma2-softcap-0", "attn_logit_softcapping must be positive, got 0"),
])
def test_bad_checkpoint_fails_clearly(tmp_path, defect, message):
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, "gemma2-window5-softcap" if defect.startswith("gemma2") else "llama-tied",
                     **({"head_dim": 20} if defect == "head-dim-20" else {}))
    if defect == "missing-tensor":
        weights = load_file(ckpt / "model.safetensors")
        del weights["model.layers.1.mlp.up_proj.weight"]
        save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    elif defect != "head-dim-20":
        config = json.loads((ckpt / "config.json").read_text())
        key, value = {"model-type": ("model_type", "gpt2"), "gemma2-relu": ("hidden_activation", "relu"),
                      "gemma2-softcap-0": ("attn_logit_softcapping", 0)}[defect]
        config[key] = value
        (ckpt / "config.json").write_text(json.dumps(config))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    proc, out = run_generate(tmp_path, ["--model", ckpt, "--prompts", prompts], world=2)
    assert proc.returncode != 0 and out is None
    assert "generate.py: error:" in proc.stderr and message in proc.stderr


def test_random_config_fill_context(tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1], [5, 6]]))
    proc, out = run_generate(tmp_path, ["--random-config", "tiny", "--prompts", prompts, "--fill-context", 50,
                                        "--profile-steps", 2], world=2)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert out["synthetic_context"] == 50 and "timing only" in out["note"] and "prefill_s" not in out
    assert len(out["tokens"]) == 2 and all(len(t) == NEW_TOKENS for t in out["tokens"])
    assert len(out["decode_step_s"]) == NEW_TOKENS and out["profile"]["steps"] == 2
    assert out["profile"]["total_us_per_step"] > 0 and out["profile"]["top"]


def test_several_fill_contexts_run_in_one_launch(tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[3]]))
    proc, out = run_generate(tmp_path, ["--random-config", "tiny", "--prompts", prompts, "--fill-context", 9, 31],
                             world=2)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert [r["synthetic_context"] for r in out["runs"]] == [9, 31]
    assert all(len(r["tokens"][0]) == NEW_TOKENS and r["decode_tokens_per_s"] > 0 for r in out["runs"])


# ------------------------------------------------------------------------------------------------------
# The prefill's attention states (natural-log LSE) against a float64 oracle


def _generate_module():
    spec = importlib.util.spec_from_file_location("generate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _oracle(q, k, v, visible, scale):
    """float64 state of ``q [B, Hq, n, D]`` over ``k``/``v [B, Hkv, m, D]`` with ``visible [n, m]``."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    s = (q.double() @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ v, lse


def _check_state(st, ref_o, ref_lse, tol):
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(st.o.double().cpu(), ref_o.cpu(), atol=tol, rtol=tol)
    torch.testing.assert_close(st.lse.double().cpu()[finite.cpu()], ref_lse.cpu()[finite.cpu()], atol=tol, rtol=1e-4)
    assert torch.isneginf(st.lse.cpu()[~finite.cpu()]).all() and (st.o.cpu()[~finite.cpu()] == 0).all()


def _causal_cases(device, dtype, tol):
    gen = _generate_module()
    torch.manual_seed(0)
    n, scale = 37, 0.3
    q = torch.randn(2, 4, n, 32, device=device, dtype=dtype)
    k, v = (torch.randn(2, 2, n, 32, device=device, dtype=dtype) for _ in range(2))
    idx = torch.arange(n, device=device)
    for strict in (False, True):
        visible = idx[None, :] < idx[:, None] if strict else idx[None, :] <= idx[:, None]
        _check_state(gen.causal_state(q, k, v, scale, strict), *_oracle(q, k, v, visible, scale), tol)


def test_causal_state_is_flash_attention_with_natural_log_lse():
    _causal_cases("cpu", torch.float32, 2e-5)


@pytest.mark.parametrize("window_left", [None, 0, 7])
@pytest.mark.parametrize("k_first", [0, 2])
def test_masked_state_interleaved_positions(window_left, k_first):
    gen = _generate_module()
    torch.manual_seed(0)
    n, stride, q_first, scale = 37, 3, 1, 0.3
    q = torch.randn(2, 4, n, 32)
    k, v = (torch.randn(2, 2, n, 32) for _ in range(2))
    q_pos, k_pos = q_first + stride * torch.arange(n), k_first + stride * torch.arange(n)
    visible = k_pos[None, :] <= q_pos[:, None]
    if window_left is not None:
        visible &= k_pos[None, :] >= q_pos[:, None] - window_left
    st = gen.masked_state(q, k, v, q_first, k_first, stride, scale, window_left)
    _check_state(st, *_oracle(q, k, v, visible, scale), 2e-5)


# ------------------------------------------------------------------------------------------------------
# GPU (skipped without one): the CUDA FlashAttention states, and W = 1 vs W = 2 float32 tokens


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_causal_state_cuda(dtype):
    _causal_cases("cuda", dtype, 3e-2 if dtype == torch.bfloat16 else 4e-3)


@pytest.mark.gpu
def test_cuda_tokens_match_transformers(tmp_path):
    """64 greedy float32 steps with the decode step in a CUDA graph: W = 1 and W = 2 (when two GPUs are
    present) choose transformers' tokens."""
    new_tokens = 64
    model = write_checkpoint(tmp_path / "ckpt", "llama-tied")
    ref_tokens, _, margin = reference(model, PROMPTS, new_tokens)
    assert margin > MIN_MARGIN
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    for world in range(1, min(2, torch.cuda.device_count()) + 1):
        proc, out = run_generate(tmp_path, ["--model", tmp_path / "ckpt", "--prompts", prompts, "--dtype", "float32"],
                                 world, device="cuda", new_tokens=new_tokens)
        assert proc.returncode == 0, proc.stderr[-5000:]
        assert out["cuda_graph"] and out["tokens"] == ref_tokens, f"W={world}"


# ------------------------------------------------------------------------------------------------------
# The transformers backend (the unmodified transformers model, generate() and cp_attention.hf.CPCache)


def write_tokenizer(path, vocab_size: int = 256):
    """A word-level tokenizer saved into the checkpoint ``path``: word ``t<i>`` is token ``i``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0").save_pretrained(path)


TEXT_PROMPTS = [PROMPTS[0], PROMPTS[3]]  # 13 and 6 tokens: a left-padded batch for the transformers backend


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory):
    """A tiny Llama checkpoint with a tokenizer, its reference tokens of TEXT_PROMPTS and the prompts file."""
    root = tmp_path_factory.mktemp("text")
    model = write_checkpoint(root / "ckpt", "llama-tied")
    write_tokenizer(root / "ckpt")
    tokens, _, margin = reference(model, TEXT_PROMPTS, NEW_TOKENS)
    assert margin > MIN_MARGIN
    prompts = root / "prompts.json"
    prompts.write_text(json.dumps([" ".join(f"t{t}" for t in p) for p in TEXT_PROMPTS]))
    return root / "ckpt", tokens, prompts


@pytest.mark.parametrize("world", [1, 2])
def test_backends_agree_on_text_prompts(tmp_path, text_checkpoint, world):
    """Text prompts (a file of strings, or --prompt) tokenised with the checkpoint's tokenizer: the native and
    the transformers backend choose transformers' tokens and write the same decoded text."""
    ckpt, ref_tokens, prompts = text_checkpoint
    texts = json.loads(prompts.read_text())
    outs = {}
    for backend, source in (("native", ["--prompts", prompts]),
                            ("transformers", [arg for t in texts for arg in ("--prompt", t)])):
        proc, out = run_generate(tmp_path, ["--model", ckpt, *source, "--backend", backend, "--logits"], world,
                                 interpret=world == 1)
        assert proc.returncode == 0, proc.stderr[-5000:]
        assert out["backend"] == backend and out["tokens"] == ref_tokens, backend
        outs[backend] = out
    assert outs["native"]["text"] == outs["transformers"]["text"] == [" ".join(f"t{t}" for t in toks)
                                                                      for toks in ref_tokens]
    torch.testing.assert_close(torch.tensor(outs["transformers"]["prefill_logits"]),
                               torch.tensor(outs["native"]["prefill_logits"]), atol=5e-4, rtol=1e-5)


def test_transformers_backend_fill_context_equals_native(tmp_path):
    """--fill-context on the transformers backend fills every CPCache layer with the native backend's random
    K/V: with --random-config (the same random weights) both choose the same tokens, and report tokens/s."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1], [5, 6]]))
    outs = []
    for backend in ("native", "transformers", "transformers --decode-ahead"):
        proc, out = run_generate(tmp_path, ["--random-config", "tiny", "--prompts", prompts, "--fill-context", 37,
                                            "--backend", *backend.split()], world=2)
        assert proc.returncode == 0, proc.stderr[-5000:]
        assert out["synthetic_context"] == 37 and out["decode_tokens_per_s"] > 0
        assert len(out["decode_step_s"]) == NEW_TOKENS
        assert out.get("decode_ahead", False) == backend.endswith("ahead")
        outs.append(out)
    assert outs[0]["tokens"] == outs[1]["tokens"] == outs[2]["tokens"]


@pytest.mark.parametrize("args, message", [
    (["--random-config", "tiny", "--prompt", "t1 t2"], "text prompts (--prompt) need --model DIR with a tokenizer"),
    (["--random-config", "tiny", "--prompt", "t1", "--compile"], "--compile and --decode-ahead are the transformers"),
])
def test_bad_text_or_backend_arguments_fail_clearly(tmp_path, args, message):
    proc, out = run_generate(tmp_path, args, world=1)
    assert proc.returncode != 0 and out is None and message in proc.stderr
