"""dflash_ref.py: a float64 PyTorch reference of the DFlash drafter forward.

Written from ../../docs/dflash.md and the DDTree/DFlash notes (section 2 and 4), not from any
implementation. It computes, for one draft pass, the drafter's log-probs for block depths 1..bs-1:

    context  c_0..c_{n-1}: target tap features (outputs of the target decoder layers in
             target_layer_ids, concatenated in config order), at positions 0..n-1
    block    [bonus, MASK x (bs-1)] embedded with the TARGET's embedding, at positions n..n+bs-1
    fused    = hidden_norm(fc(c))                                  (no input_layernorm)
    per layer:
        h      = input_layernorm(x)
        q      = rope(q_norm(q_proj(h)))            per head, block positions
        k      = rope(k_norm(k_proj([fused; h])))   context positions then block positions
        v      = v_proj([fused; h])
        x     += o_proj(softmax(q k^T * head_dim^-0.5) v)   bidirectional, GQA
                 (sliding window on a layer: key visible when pos_q - pos_k < window)
        x     += down(silu(gate(post_attention_layernorm(x))) * up(...))
    logprobs = log_softmax(lm_head_target(norm(x)[1:]))

The context is computed here in one go from all its features; the engine builds it incrementally,
so agreement also checks the incremental drafter cache.

RoPE: rotate-half over the full head dim (Qwen3 style). Inverse frequencies and cos/sin amplitude
follow HF transformers (Qwen3RotaryEmbedding + _compute_yarn_parameters): for YaRN the amplitude is
`attention_factor` when given, else get_mscale(factor, mscale)/get_mscale(factor, mscale_all_dim)
when both mscale fields are set and non-zero, else 0.1*ln(factor)+1.
"""
import json
import math
import os

import torch
from safetensors.torch import load_file

DT = torch.float64


def load_config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def load_weights(path):
    """All drafter tensors as float64, with an optional leading 'model.' stripped."""
    files = [f for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
    w = {}
    for fn in files:
        for k, v in load_file(os.path.join(path, fn)).items():
            if k.startswith("model."):
                k = k[len("model."):]
            w[k] = v.to(DT)
    return w


def _mscale(scale, m=1.0):
    if scale <= 1:
        return 1.0
    return 0.1 * m * math.log(scale) + 1.0


def rope_tables(cfg):
    """(inv_freq [head_dim/2] float64, amplitude) following HF's default / linear / yarn rules."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = float(rs.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = rs.get("rope_type", rs.get("type", "default"))
    dim = head_dim
    idx = torch.arange(0, dim, 2, dtype=DT)
    pos_freqs = theta ** (idx / dim)
    inv_freq = 1.0 / pos_freqs
    amp = 1.0
    if kind in (None, "default"):
        pass
    elif kind == "linear":
        inv_freq = inv_freq / float(rs["factor"])
    elif kind in ("yarn", "deepseek_yarn"):
        orig = rs.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
        factor = rs.get("factor")
        if factor is None:
            factor = cfg["max_position_embeddings"] / orig
        factor = float(factor)
        af = rs.get("attention_factor")
        ms, msa = rs.get("mscale"), rs.get("mscale_all_dim")
        if af is None:
            if ms and msa:
                af = _mscale(factor, ms) / _mscale(factor, msa)
            else:
                af = _mscale(factor)
        amp = float(af)
        beta_fast = rs.get("beta_fast") or 32
        beta_slow = rs.get("beta_slow") or 1
        truncate = rs.get("truncate", True)

        def corr_dim(rot):
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=DT) - low) / (high - low)).clamp(0, 1)
        extrap = 1 - ramp  # weight of the unscaled frequency
        inv_freq = (inv_freq / factor) * (1 - extrap) + inv_freq * extrap
    else:
        raise ValueError(f"rope type {kind!r} not covered by the reference")
    return inv_freq, amp


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x, pos, inv_freq, amp):
    """x: [T, H, D]; pos: [T] absolute positions."""
    ang = pos.to(DT)[:, None] * inv_freq[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    cos = (emb.cos() * amp)[:, None, :]
    sin = (emb.sin() * amp)[:, None, :]
    return x * cos + rotate_half(x) * sin


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def layer_window(cfg, i):
    lt = cfg.get("layer_types")
    if lt and lt[i] == "sliding_attention":
        return int(cfg["sliding_window"])
    return 0


def draft_logprobs(cfg, w, embed, lm_head, ctx_feats, bonus):
    """ctx_feats: [n, n_taps*target_hidden] float64 (n may be 0); embed, lm_head: [V, H] float64.
    Returns [bs-1, V] float64 log-probs for block depths 1..bs-1."""
    H = cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    eps = cfg.get("rms_norm_eps", 1e-6)
    bs = cfg["block_size"]
    mask_id = cfg["dflash_config"]["mask_token_id"]
    inv_freq, amp = rope_tables(cfg)
    n = ctx_feats.shape[0]

    fused = rmsnorm(ctx_feats @ w["fc.weight"].T, w["hidden_norm.weight"], eps)   # [n, H]
    ids = torch.tensor([bonus] + [mask_id] * (bs - 1))
    x = embed[ids].clone()                                                       # [bs, H]
    pos_ctx = torch.arange(n)
    pos_blk = torch.arange(n, n + bs)
    pos_all = torch.cat([pos_ctx, pos_blk])
    scale = hd ** -0.5
    rep = nh // nkv
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rmsnorm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(bs, nh, hd)
        q = apply_rope(rmsnorm(q, w[p + "self_attn.q_norm.weight"], eps), pos_blk, inv_freq, amp)
        kv_in = torch.cat([fused, h], dim=0)                                     # [n+bs, H]
        k = (kv_in @ w[p + "self_attn.k_proj.weight"].T).view(n + bs, nkv, hd)
        k = apply_rope(rmsnorm(k, w[p + "self_attn.k_norm.weight"], eps), pos_all, inv_freq, amp)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(n + bs, nkv, hd)
        k = k.repeat_interleave(rep, dim=1)                                      # [S, nh, hd]
        v = v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) * scale                      # [nh, bs, S]
        win = layer_window(cfg, i)
        if win > 0:
            vis = (pos_blk[:, None] - pos_all[None, :]) < win
            scores = scores.masked_fill(~vis[None], float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        o = torch.einsum("hts,shd->thd", attn, v).reshape(bs, nh * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h2 = rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = h2 @ w[p + "mlp.gate_proj.weight"].T
        u = h2 @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
    y = rmsnorm(x, w["norm.weight"], eps)[1:]
    return torch.log_softmax(y @ lm_head.T, dim=-1)
