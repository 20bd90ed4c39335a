#!/usr/bin/env python3
"""make_tiny_drafter.py: write the tiny DFlash drafter models/tiny-k2.6-dflash and its golden
spec/fixtures/golden-dflash.json.

    python3 scripts/golden/make_tiny_drafter.py [--target models/tiny-k2.6]
        [--out models/tiny-k2.6-dflash] [--golden spec/fixtures/golden-dflash.json]
        [--no-weights]   (keep the existing drafter checkpoint, recompute the golden only)

The drafter: DFlashDraftModel, hidden = the target's hidden, 2 layers, 4 heads, 2 KV heads, head_dim 32,
intermediate 256, block 8, mask 1020, taps [1, 2], YaRN RoPE shaped like K2.6's drafter (theta 50000,
factor 64, beta 32/1, mscale 1/1, original 4096), rotate-half over the full head. Without --no-weights the
weights are random (seeded), rounded to bf16 and stored as bf16. The SHIPPED weights are trained (bf16) by
scripts/golden/train_tiny_drafter.py: regenerate the golden for them with --no-weights (running without it
replaces them with random ones). The golden is computed from the stored values.

The golden: the target is HF DeepseekV3ForCausalLM in float64 built from the target checkpoint
(K2.6 layout: `language_model.` prefix, INT4 pack-quantized experts dequantized exactly); its tap
features (hidden_states[l+1] for l in target_layer_ids) feed scripts/golden/dflash_ref.py, which gives
the drafter's log-probs for depths 1..bs-1 in these cases:
  empty     no context (fresh sequence), bonus 5: the drafter alone (block at positions 0..7)
  prompt    context = the prompt's 12 tokens, bonus = the target's greedy next token
  accepted  context grew by the accepted path [bonus, g1, g2] (the target's greedy tokens), and the
            next bonus is the target's greedy token after it (a second DDTree round)
  other     the prompt context with an arbitrary bonus token (not the target's choice)
  window    the prompt case with layer 1 made a sliding-window layer (window 8): checks the window rule
  rope_no_mscale  the prompt case with YaRN lacking mscale/mscale_all_dim (amplitude 0.1 ln 64 + 1)
Variant cases list their config.json changes in "config_overrides"; the spec writes them to a
temporary drafter directory that links the same weights.
"""
import argparse
import json
import os
import sys
import zlib

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dflash_ref  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROMPT = [5, 77, 300, 1000, 12, 845, 3, 511, 260, 99, 1017, 42]


def drafter_config(tcfg):
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": 8,
        "num_target_layers": tcfg["num_hidden_layers"],
        "dflash_config": {"mask_token_id": 1020, "target_layer_ids": [1, 2]},
        "vocab_size": tcfg["vocab_size"],
        "hidden_size": tcfg["hidden_size"],
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096},
        "max_position_embeddings": 262144,
        "layer_types": ["full_attention", "full_attention"],
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def make_weights(cfg, seed=20260601):
    g = torch.Generator().manual_seed(seed)
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n_taps = len(cfg["dflash_config"]["target_layer_ids"])

    def lin(o, i, gain=1.0):
        return torch.randn(o, i, generator=g) * (gain / i ** 0.5)

    def norm(n, mean=1.0):
        return mean + 0.2 * torch.randn(n, generator=g)

    w = {"fc.weight": lin(H, n_taps * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        # sharp attention (q_norm/k_norm weights ~2: logits of std ~4) and a strong attention
        # output, so that the block's rows differ by position and context, not only by embedding
        w[p + "self_attn.q_proj.weight"] = lin(nh * hd, H)
        w[p + "self_attn.k_proj.weight"] = lin(nkv * hd, H)
        w[p + "self_attn.v_proj.weight"] = lin(nkv * hd, H, 1.5)
        w[p + "self_attn.o_proj.weight"] = lin(H, nh * hd, 3.0)
        w[p + "self_attn.q_norm.weight"] = norm(hd, 2.0)
        w[p + "self_attn.k_norm.weight"] = norm(hd, 2.0)
        w[p + "mlp.gate_proj.weight"] = lin(I, H)
        w[p + "mlp.up_proj.weight"] = lin(I, H)
        w[p + "mlp.down_proj.weight"] = lin(H, I)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in w.items()}


# ---------------------------------------------------------------- the target, in HF float64
def _target_tensors(tdir):
    idx = os.path.join(tdir, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    t = {}
    for fn in files:
        t.update(load_file(os.path.join(tdir, fn)))
    return t


def _unpack_int4(packed, scale, shape):
    """compressed-tensors pack-quantized: int32 [out, in/8], nibble = q + 8, low nibble first."""
    out, inn = int(shape[0]), int(shape[1])
    p = packed.to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([(p >> (4 * j)) & 0xF for j in range(8)], dim=-1).reshape(out, inn)
    q = (nib - 8).to(torch.float64)
    grp = inn // scale.shape[1]
    return q * scale.to(torch.float64).repeat_interleave(grp, dim=1)


def load_target(tdir):
    """HF DeepseekV3ForCausalLM in float64 from the checkpoint files on disk. The HF config (sdpa attention:
    float64 softmax; the eager per-expert loop) comes from the golden engineer's tinymodels.hf_config."""
    from transformers import DeepseekV3ForCausalLM
    import tinymodels
    with open(os.path.join(tdir, "config.json")) as f:
        full = json.load(f)
    tc = dict(full.get("text_config", full))
    prefix = "language_model." if "text_config" in full else ""
    cfg = tinymodels.hf_config(tc)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).to(torch.float64).eval()
    raw = _target_tensors(tdir)
    sd = {}
    experts = {}
    for name, v in raw.items():
        if not name.startswith(prefix):
            continue
        name = name[len(prefix):]
        if not name.startswith(("model.", "lm_head.")):
            continue
        if ".mlp.experts." in name:
            head, tail = name.split(".mlp.experts.")
            e, proj, kind = tail.split(".", 2)
            experts.setdefault((head, int(e), proj), {})[kind] = v
            continue
        sd[name] = v.to(torch.float64)
    per_layer = {}
    for (head, e, proj), parts in experts.items():
        if "weight_packed" in parts:
            wt = _unpack_int4(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"])
        else:
            wt = parts["weight"].to(torch.float64)
        per_layer.setdefault(head, {}).setdefault(e, {})[proj] = wt
    for head, es in per_layer.items():
        n = len(es)
        sd[head + ".mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([es[e]["gate_proj"], es[e]["up_proj"]], dim=0) for e in range(n)])
        sd[head + ".mlp.experts.down_proj"] = torch.stack([es[e]["down_proj"] for e in range(n)])
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise SystemExit(f"target load: missing {missing}, unexpected {unexpected}")
    return full, tc, model


def target_run(model, ids, taps):
    """(features [T, n_taps*H] float64 from hidden_states[l+1], logits [T, V] float64)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    feats = torch.cat([hs[l + 1][0] for l in taps], dim=-1)
    return feats, out.logits[0]


def check_taps_are_layer_outputs(model, ids, taps):
    """hidden_states[l+1] must be decoder layer l's output (pre final norm); verified with hooks."""
    got = {}
    hooks = [model.model.layers[l].register_forward_hook(
        lambda mod, inp, out, l=l: got.__setitem__(l, (out[0] if isinstance(out, tuple) else out)[0]))
        for l in taps]
    feats, _ = target_run(model, ids, taps)
    for h in hooks:
        h.remove()
    H = model.config.hidden_size
    for j, l in enumerate(taps):
        d = (feats[:, j * H:(j + 1) * H] - got[l]).abs().max().item()
        assert d == 0.0, f"tap {l}: hidden_states[{l + 1}] differs from layer {l} output by {d}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=os.path.join(ROOT, "models/tiny-k2.6"))
    ap.add_argument("--out", default=os.path.join(ROOT, "models/tiny-k2.6-dflash"))
    ap.add_argument("--golden", default=os.path.join(ROOT, "spec/fixtures/golden-dflash.json"))
    ap.add_argument("--no-weights", action="store_true")
    a = ap.parse_args()

    full, tc, target = load_target(a.target)
    cfg = drafter_config(tc)
    if not a.no_weights:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        save_file(make_weights(cfg), os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    cfg = dflash_ref.load_config(a.out)
    w = dflash_ref.load_weights(a.out)
    taps = cfg["dflash_config"]["target_layer_ids"]
    embed = target.model.embed_tokens.weight.detach()
    lm_head = target.lm_head.weight.detach()
    bs = cfg["block_size"]

    check_taps_are_layer_outputs(target, PROMPT, taps)
    feats, logits = target_run(target, PROMPT, taps)
    b0 = int(logits[-1].argmax())
    # the target's greedy continuation: the accepted path of a second round
    seq = list(PROMPT) + [b0]
    for _ in range(3):
        _, lg = target_run(target, seq, taps)
        seq.append(int(lg[-1].argmax()))
    path = seq[len(PROMPT):len(PROMPT) + 3]           # [b0, g1, g2] accepted, g3 is the next bonus
    bonus2 = seq[len(PROMPT) + 3]
    feats2, _ = target_run(target, list(PROMPT) + path, taps)

    def case(name, ctx_tokens, ctx_feats, bonus, overrides=None, note=""):
        c = dict(cfg, **(overrides or {}))
        lp = dflash_ref.draft_logprobs(c, w, embed, lm_head, ctx_feats, bonus)
        top2 = lp.topk(2, dim=-1)
        return {
            "name": name, "note": note,
            "config_overrides": overrides or {},
            "rope_attention_factor": dflash_ref.rope_tables(c)[1],
            "context_tokens": ctx_tokens, "bonus": bonus,
            "positions": [len(ctx_tokens) + i for i in range(bs)],
            "argmax": lp.argmax(-1).tolist(),
            "top2_margin": (top2.values[:, 0] - top2.values[:, 1]).tolist(),
            "logprobs": [[round(float(x), 7) for x in row] for row in lp],
        }

    empty = torch.zeros(0, feats.shape[1], dtype=torch.float64)
    window = {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}
    rope_plain = {"rope_scaling": {k: v for k, v in cfg["rope_scaling"].items()
                                   if k not in ("mscale", "mscale_all_dim")}}
    cases = [
        case("empty", [], empty, 5, note="no context: fresh sequence, block at positions 0..bs-1"),
        case("prompt", PROMPT, feats, b0, note="context = prompt; bonus = target greedy token"),
        case("accepted", PROMPT + path, feats2, bonus2,
             note="context grew by the accepted path (target greedy); bonus = next greedy token"),
        case("other", PROMPT, feats, 777, note="prompt context, an arbitrary bonus"),
        case("window", PROMPT, feats, b0, overrides=window,
             note="layer 1 sliding_attention with sliding_window 8 (key visible when pos_q-pos_k < 8)"),
        case("rope_no_mscale", PROMPT, feats, b0, overrides=rope_plain,
             note="YaRN without mscale/mscale_all_dim: HF amplitude 0.1*ln(64)+1"),
    ]
    gold = {
        "generator": "scripts/golden/make_tiny_drafter.py (reference: scripts/golden/dflash_ref.py, float64)",
        "target": os.path.relpath(a.target, ROOT), "drafter": os.path.relpath(a.out, ROOT),
        "block_size": bs, "vocab": int(lm_head.shape[0]), "taps": taps,
        "mask_token_id": cfg["dflash_config"]["mask_token_id"],
        "target_greedy": {"prompt": PROMPT, "continuation": seq[len(PROMPT):]},
        # which target checkpoint these numbers belong to (the spec refuses a stale golden)
        "target_adler32": {fn: zlib.adler32(open(os.path.join(a.target, fn), "rb").read())
                           for fn in sorted(os.listdir(a.target)) if fn.endswith(".safetensors")},
        "cases": cases,
    }
    os.makedirs(os.path.dirname(a.golden), exist_ok=True)
    with open(a.golden, "w") as f:
        json.dump(gold, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {a.out} and {a.golden}: bonus {b0}, path {path}, bonus2 {bonus2}")
    for c in cases:
        print(f"  {c['name']:9s} argmax {c['argmax']} min margin {min(c['top2_margin']):.4f}")


if __name__ == "__main__":
    main()
