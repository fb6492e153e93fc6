"""The model kernels of ``launch/model_kernels.py`` (RMSNorm with the residual add, in-place RoPE on a fused q/k/v
projection, the SwiGLU gate) against the plain-torch code they replace (the transformers operations), and the
fused projections of ``launch/llama.py`` against the unfused model. Odd sizes; NaN-poisoned outputs."""
import pytest
import torch

from launch import model_kernels as kernels
from launch.llama import CONFIGS, Transformer, random_model, rope_inv_freq

# float32: rsqrt/exp and fused multiply-adds may move the last bits; 16-bit: a rounding of the dtype may land on
# the neighbouring value (the interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest)
TOL = {torch.float32: 2e-6, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}


@pytest.fixture
def torch_path(monkeypatch):
    """Run ``fn`` with launch/model_kernels.py forced onto its torch code."""
    def run(fn, *args, **kw):
        with monkeypatch.context() as m:
            m.setattr(kernels, "use_triton", lambda t: False)
            return fn(*args, **kw)
    return run


def _close(got, ref, dtype):
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert not got.isnan().any()
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("delta, gemma", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("shape", [(1, 200), (3, 5, 72)])
def test_rmsnorm(device, torch_path, dtype, delta, gemma, shape):
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(shape, generator=g)).to(dtype).to(device)
    d = torch.randn(shape, generator=g).to(dtype).to(device) if delta else None
    w = torch.randn(shape[-1], generator=g).to(dtype).to(device)
    x0, x_ref = x.clone(), x.clone()
    ref = torch_path(kernels.rmsnorm, x_ref, w, 1e-5, d, gemma)
    got = kernels.rmsnorm(x, w, 1e-5, d, gemma)
    _close(got, ref, dtype)
    _close(x, x_ref, dtype)  # x + delta, in place
    _close(x, x0 + d if delta else x0, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead, cs_lead", [((3,), (3,)), ((2, 7), (7,))])  # decode [B] / prefill [B, n]
def test_rope_in_place(device, torch_path, dtype, lead, cs_lead):
    hq, hkv, d = 5, 3, 40
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(*lead, (hq + 2 * hkv) * d, generator=g).to(dtype).to(device)
    ang = 10 * torch.randn(*cs_lead, d, generator=g)
    cos, sin = ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)
    qkv0, ref = qkv.clone(), qkv.clone()
    torch_path(kernels.rope_, ref, cos, sin, hq + hkv, d)
    kernels.rope_(qkv, cos, sin, hq + hkv, d)
    _close(qkv, ref, dtype)
    n_rot = (hq + hkv) * d
    assert torch.equal(qkv[..., n_rot:], qkv0[..., n_rot:])  # v untouched
    assert (qkv[..., :n_rot] != qkv0[..., :n_rot]).float().mean() > 0.9  # q and k rotated


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (2, 3)])
def test_gated_act(device, torch_path, dtype, shape):
    n = kernels.ACT_BLOCK + 37  # two column blocks, the second partial
    g = torch.Generator().manual_seed(3)
    gu = (4 * torch.randn(*shape, 2 * n, generator=g)).to(dtype).to(device)
    _close(kernels.gated_act(gu), torch_path(kernels.gated_act, gu), dtype)


def test_bad_shapes_raise(device):
    x = torch.ones(2, 8, device=device)
    with pytest.raises(ValueError, match="delta"):
        kernels.rmsnorm(x, torch.ones(8, device=device), 1e-5, torch.ones(2, 7, device=device))
    with pytest.raises(ValueError, match="cos/sin"):
        kernels.rope_(torch.ones(3, 40, device=device), torch.ones(2, 8, device=device),
                      torch.ones(2, 8, device=device), 4, 8)


def test_fused_projections_equal_the_unfused_model(device):
    """One layer stack with fused q/k/v and gate/up equals the same weights run projection by projection."""
    args = CONFIGS["tiny"]
    model = random_model(args, device, torch.float32, seed=5, std=0.2)
    ref = Transformer(args).to(device)  # unfused: the checkpoint's modules
    for layer, fused in zip(ref.model.layers, model.model.layers):
        n_q, n_kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        w = fused.self_attn.qkv_proj.weight
        layer.self_attn.q_proj.weight.data, layer.self_attn.k_proj.weight.data, layer.self_attn.v_proj.weight.data = (
            w[:n_q], w[n_q: n_q + n_kv], w[n_q + n_kv:])
        w = fused.mlp.gate_up_proj.weight
        layer.mlp.gate_proj.weight.data, layer.mlp.up_proj.weight.data = w[: args.intermediate_size], w[args.intermediate_size:]
        layer.self_attn.o_proj.weight.data = fused.self_attn.o_proj.weight.data
        layer.mlp.down_proj.weight.data = fused.mlp.down_proj.weight.data
        for name in ("input_layernorm", "post_attention_layernorm"):
            getattr(layer, name).weight.data = getattr(fused, name).weight.data
    ref.model.embed_tokens.weight.data = model.model.embed_tokens.weight.data
    ref.model.norm.weight.data = model.model.norm.weight.data
    ref.inv_freq = rope_inv_freq(args).to(device)

    def plain_forward(x, positions):  # the layer stack written out with unfused projections, no kernels
        freqs = positions[..., None].float() * ref.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[..., None, :], emb.sin()[..., None, :]
        for layer in ref.model.layers:
            h = layer.input_layernorm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + args.norm_eps))
            att = layer.self_attn
            q = att.q_proj(h).unflatten(-1, (args.n_heads, -1))
            k = att.k_proj(h).unflatten(-1, (args.n_kv_heads, -1))
            q, k = (t * cos + kernels.rotate_half(t) * sin for t in (q, k))
            v = att.v_proj(h).unflatten(-1, (args.n_kv_heads, -1))
            x = x + att.o_proj(_attend(q, k, v, args).flatten(-2))
            h = layer.post_attention_layernorm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + args.norm_eps))
            x = x + layer.mlp.down_proj(torch.nn.functional.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h))
        return ref.model.norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + args.norm_eps))

    tokens = torch.tensor([[3, 200, 17, 9, 41]], device=device)
    positions = torch.arange(5, device=device)
    got = model(tokens, positions, lambda i, q, k, v: _attend(q, k, v, args))
    want = plain_forward(model.model.embed_tokens(tokens), positions)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert not hasattr(model.model.layers[0].self_attn, "q_proj")  # the originals are gone


def _attend(q, k, v, args):
    """Causal attention of ``q [B, n, Hq, D]`` over ``k``/``v [B, n, Hkv, D]`` in float64 -> q's dtype."""
    group = args.n_heads // args.n_kv_heads
    qh, kh, vh = (t.transpose(1, 2).double() for t in (q, k, v))
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    s = qh @ kh.transpose(-1, -2) * args.head_dim ** -0.5
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return (s.softmax(-1) @ vh).transpose(1, 2).to(q.dtype)
