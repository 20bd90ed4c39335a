#!/usr/bin/env python3
"""An independent float64 reference of the DeepSeek-V3 / Kimi K2 forward, written from
/work/shared/reference/kimi_k2.md (section 3) and reading the checkpoint *from disk* with its own safetensors
parser and INT4 unpacker. It shares no code with transformers, so agreeing with the HF goldens checks both the
on-disk layout (names, dtypes, INT4 packing, gate/up order, shard index, wrapper config) and the goldens.

    python3 scripts/golden/ref_numpy.py models/tiny-k2.6 spec/fixtures/golden-tiny-k2.6.json
    python3 scripts/golden/ref_numpy.py spec/fixtures/tiny-dsv3 spec/fixtures/golden-tiny-dsv3.json

Differences from HF, all below 1e-6: HF computes RoPE angles and cos/sin, the RMSNorm variance and the router in
float32 even for a float64 model; this reference does everything in float64, and uses the interleaved-pair RoPE of
DeepSeek's reference (HF de-interleaves; q.k is the same) and the absorbed-free naive MLA.
"""
import json
import math
import os
import re
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from int4 import dequant_int4  # noqa: E402

DTYPES = {"BF16": (np.uint16, 2), "F16": (np.float16, 2), "F32": (np.float32, 4), "F64": (np.float64, 8),
          "I32": (np.int32, 4), "I64": (np.int64, 8), "I8": (np.int8, 1), "U8": (np.uint8, 1)}


def read_safetensors(path):
    """Minimal safetensors reader: u64 header length, JSON header, raw little-endian data."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt, size = DTYPES[info["dtype"]]
        a, b = info["data_offsets"]
        arr = np.frombuffer(data[a:b], dtype=dt).reshape(info["shape"])
        if info["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr
    return out


def load_checkpoint(d):
    cfg = json.load(open(os.path.join(d, "config.json")))
    prefix = ""
    if "text_config" in cfg:       # kimi_k25 wrapper
        quant = cfg.get("quantization_config") or cfg["text_config"].get("quantization_config")
        cfg = cfg["text_config"]
        prefix = "language_model."
    else:
        quant = cfg.get("quantization_config")
    files = []
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        files = sorted(set(json.load(open(idx))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for f in files:
        for k, v in read_safetensors(os.path.join(d, f)).items():
            if k.startswith(prefix):
                tensors[k[len(prefix):]] = v
    return cfg, quant, tensors


class Model:
    def __init__(self, d):
        self.cfg, quant, self.t = load_checkpoint(d)
        self.group = None
        if quant:
            assert quant["quant_method"] == "compressed-tensors" and quant["format"] == "pack-quantized"
            self.group = quant["config_groups"]["group_0"]["weights"]["group_size"]

    def w(self, name):
        """float64 [out, in] weight of a linear (dense, or INT4 dequantized)."""
        if name + ".weight" in self.t:
            return self.t[name + ".weight"].astype(np.float64)
        return dequant_int4(self.t[name + ".weight_packed"], self.t[name + ".weight_scale"],
                            self.t[name + ".weight_shape"], self.group)

    def v(self, name):
        return self.t[name].astype(np.float64)

    def rmsnorm(self, x, name, eps):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * self.v(name + ".weight")

    def inv_freq(self):
        c = self.cfg
        dr = c["qk_rope_head_dim"]
        base = c["rope_theta"]
        inv = base ** (-np.arange(0, dr, 2, dtype=np.float64) / dr)
        rs = c.get("rope_scaling")
        if not rs:
            return inv, 1.0
        f, bf, bs = rs["factor"], rs.get("beta_fast", 32), rs.get("beta_slow", 1)
        omax = rs["original_max_position_embeddings"]

        def cd(r):
            return dr * math.log(omax / (r * 2 * math.pi)) / (2 * math.log(base))
        low, high = max(math.floor(cd(bf)), 0), min(math.ceil(cd(bs)), dr - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dr // 2) - low) / (high - low), 0, 1)
        smooth = 1 - ramp
        inv = inv / f * (1 - smooth) + inv * smooth

        def ms(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if rs.get("mscale") and rs.get("mscale_all_dim"):
            mscale = ms(f, rs["mscale"]) / ms(f, rs["mscale_all_dim"])   # cos/sin multiplier; 1.0 for Kimi
        else:
            mscale = ms(f)
        return inv, mscale

    def softmax_scale(self):
        c = self.cfg
        s = (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]) ** -0.5
        rs = c.get("rope_scaling")
        if rs and rs.get("mscale_all_dim"):
            m = 0.1 * rs["mscale_all_dim"] * math.log(rs["factor"]) + 1.0
            s *= m * m
        return s

    def rope(self, x, pos):
        """Interleaved pairs (x[2i], x[2i+1]) rotated by pos * inv_freq[i]  (x: [..., T, dr])."""
        inv, att = self.inv_freq()
        ang = np.asarray(pos, dtype=np.float64)[:, None] * inv[None, :]
        cos, sin = np.cos(ang) * att, np.sin(ang) * att
        x0, x1 = x[..., 0::2], x[..., 1::2]
        y = np.empty_like(x)
        y[..., 0::2] = x0 * cos - x1 * sin
        y[..., 1::2] = x0 * sin + x1 * cos
        return y

    def attention(self, l, x, pos):
        c = self.cfg
        a = f"model.layers.{l}.self_attn."
        T = x.shape[0]
        nh, dn, dr, dv, rkv = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                               c["v_head_dim"], c["kv_lora_rank"])
        if c.get("q_lora_rank"):
            # HF builds q_a_layernorm / kv_a_layernorm with its default eps 1e-6, not rms_norm_eps
            q = self.rmsnorm(x @ self.w(a + "q_a_proj").T, a + "q_a_layernorm", 1e-6) @ self.w(a + "q_b_proj").T
        else:
            q = x @ self.w(a + "q_proj").T
        q = q.reshape(T, nh, dn + dr).transpose(1, 0, 2)           # [nh, T, dn+dr]
        q_nope, q_pe = q[..., :dn], self.rope(q[..., dn:], pos)
        kva = x @ self.w(a + "kv_a_proj_with_mqa").T
        ckv = self.rmsnorm(kva[:, :rkv], a + "kv_a_layernorm", 1e-6)
        k_pe = self.rope(kva[:, rkv:], pos)                          # [T, dr], shared by all heads
        kv = (ckv @ self.w(a + "kv_b_proj").T).reshape(T, nh, dn + dv).transpose(1, 0, 2)
        k_nope, v = kv[..., :dn], kv[..., dn:]
        s = (q_nope @ k_nope.transpose(0, 2, 1) + q_pe @ k_pe.T[None]) * self.softmax_scale()
        s = s + np.triu(np.full((T, T), -np.inf), 1)[None]
        s = np.exp(s - s.max(-1, keepdims=True))
        p = s / s.sum(-1, keepdims=True)
        o = (p @ v).transpose(1, 0, 2).reshape(T, nh * dv)
        return o @ self.w(a + "o_proj").T

    def mlp(self, name, x):
        g = x @ self.w(name + ".gate_proj").T
        u = x @ self.w(name + ".up_proj").T
        return (g / (1 + np.exp(-g)) * u) @ self.w(name + ".down_proj").T

    def moe(self, l, x):
        c = self.cfg
        m = f"model.layers.{l}.mlp."
        E, k, ng, tg = c["n_routed_experts"], c["num_experts_per_tok"], c["n_group"], c["topk_group"]
        s = 1 / (1 + np.exp(-(x @ self.v(m + "gate.weight").T)))
        sel = s + self.v(m + "gate.e_score_correction_bias")
        y = np.zeros_like(x)
        for t in range(x.shape[0]):
            st = sel[t].copy()
            if ng > 1:
                gs = np.sort(st.reshape(ng, E // ng), axis=1)[:, -2:].sum(1)
                keep = np.argsort(-gs, kind="stable")[:tg]
                mask = np.full(E, -np.inf)
                for gi in keep:
                    mask[gi * (E // ng):(gi + 1) * (E // ng)] = 0
                st = st + mask
            idx = np.argsort(-st, kind="stable")[:k]
            wts = s[t, idx]
            if c.get("norm_topk_prob", True):
                wts = wts / (wts.sum() + 1e-20)
            wts = wts * c["routed_scaling_factor"]
            for e, wt in zip(idx, wts):
                y[t] += wt * self.mlp(f"{m}experts.{e}", x[t:t + 1])[0]
        return y + self.mlp(m + "shared_experts", x)

    def forward(self, ids):
        c = self.cfg
        eps = c["rms_norm_eps"]
        pos = np.arange(len(ids))
        h = self.v("model.embed_tokens.weight")[ids]
        outs = []
        for l in range(c["num_hidden_layers"]):
            h = h + self.attention(l, self.rmsnorm(h, f"model.layers.{l}.input_layernorm", eps), pos)
            x = self.rmsnorm(h, f"model.layers.{l}.post_attention_layernorm", eps)
            h = h + (self.mlp(f"model.layers.{l}.mlp", x) if l < c["first_k_dense_replace"] else self.moe(l, x))
            outs.append(h)
        logits = self.rmsnorm(h, "model.norm", eps) @ self.w("lm_head").T
        return logits, outs


def main():
    mdir, gpath = sys.argv[1], sys.argv[2]
    g = json.load(open(gpath))
    model = Model(mdir)
    prompt = g["prompt"]
    logits, outs = model.forward(prompt)
    gl = np.array(g["prompt_logits"])
    rel = np.abs(logits - gl).max() / np.abs(gl).max()
    print(f"prompt logits: max abs diff {np.abs(logits - gl).max():.3g} (max |logit| {np.abs(gl).max():.3g}, rel {rel:.3g})")
    for l, hs in zip(g["hidden_layers"], g["hidden_states"]):
        hs = np.array(hs)
        print(f"hidden layer {l}: max abs diff {np.abs(outs[l] - hs).max():.3g} (max |h| {np.abs(hs).max():.3g})")
    seq = prompt + g["greedy"][:-1]
    full, _ = model.forward(seq)
    chain = [int(i) for i in full[len(prompt) - 1:].argmax(-1)]
    last = np.abs(full[-1] - np.array(g["greedy_logits_last"])).max()
    print(f"greedy chain {'matches' if chain == g['greedy'] else 'DIFFERS'} ({len(chain)} tokens); "
          f"last-step logits max abs diff {last:.3g}")
    ok = rel < 1e-6 and chain == g["greedy"] and last < 1e-5
    print("OK" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
