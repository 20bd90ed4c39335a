#!/usr/bin/env python3
"""Stage 3: the target. Kimi K2.6's architecture (transformers' DeepseekV3ForCausalLM: MLA with q_lora, YaRN, the
noaux_tc sigmoid router with e_score_correction_bias, a shared expert, a dense first layer, n_group = topk_group = 1
as in models/tiny-k2.6) trained from scratch on OUTDIR/tokens/train.npy, then its routed experts quantized to INT4
group-32 (compressed-tensors pack-quantized, scripts/golden/int4.py) and written in the kimi_k25 layout
(scripts/golden/tinymodels.write_k26: `language_model.` prefix, experts one by one) to OUTDIR/models/mini-code
(OUTDIR/models/large-code with --size large).

    python3 target.py OUTDIR [--minutes 3.2] [--device cuda] [--size mini|large] [--smoke]

Training: fp32 master weights, bf16 autocast, AdamW (0.9, 0.95, wd 0.1 on matrices), warmup then cosine to 10%
over the wall-time budget, grad clip 1, random windows of --seq-len + 1 tokens (files joined by [EOS]). The MoE
layers run a dense all-experts forward (every expert on every token, weighted by the router's top-k weights and
zero elsewhere: the same function as HF's per-expert loop, checked against it at start) because it is one batched
matmul on a GPU; the router stays in fp32. Experts are balanced the noaux_tc way: after each step
e_score_correction_bias += --bias-rate * sign(mean load - load) per MoE layer (no auxiliary loss).
Report (OUTDIR/report.json "target"): held-out loss in nats/token of the trained fp32 weights, of the stored bf16
weights with bf16 experts, and of the shipped weights (INT4 experts), all computed in fp32 on the same windows."""
import argparse
import copy
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

import arch
from common import SPECIAL_OFFSETS, log, read_json, torch_setup, update_report
import tinymodels as tm

# ------------------------------------------------------------------------------------------- the MoE forward
def moe_forward(moe, cfg, x):
    """DeepseekV3MoE at training speed: the noaux_tc router in fp32, then every expert on every token, combined
    with the top-k weights (zero for unselected experts), plus the shared expert. Counts the selections per expert
    into moe.load (for the bias update)."""
    shape = x.shape
    h = x.reshape(-1, shape[-1])
    gate = moe.gate
    with torch.autocast(device_type=h.device.type, enabled=False):
        scores = F.linear(h.float(), gate.weight.float()).sigmoid()
    k, ng, tg = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
    E = scores.shape[-1]
    choice = scores + gate.e_score_correction_bias
    if ng > 1:
        gs = choice.view(-1, ng, E // ng).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(tg, dim=-1)[1], 1.0).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(E // ng, dim=1), float("-inf"))
    idx = choice.topk(k, dim=-1)[1]
    w = scores.gather(1, idx)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * cfg.routed_scaling_factor
    comb = torch.zeros_like(scores).scatter(1, idx, w)                      # [N, E] fp32
    if moe.training:
        moe.load += torch.bincount(idx.reshape(-1), minlength=E).float()
    ex = moe.experts
    gu = torch.einsum("nh,eih->eni", h, ex.gate_up_proj)                  # [E, N, 2I]
    g, u = gu.chunk(2, dim=-1)
    y = torch.einsum("eni,ehi->enh", F.silu(g) * u, ex.down_proj)          # [E, N, H]
    out = torch.einsum("enh,ne->nh", y, comb.to(y.dtype))
    return (out.to(x.dtype).reshape(shape) + moe.shared_experts(x))


def moe_layers(model):
    return [l.mlp for l in model.model.layers if hasattr(l.mlp, "experts")]


def install_dense_moe(model):
    for moe in moe_layers(model):
        moe.load = torch.zeros(moe.gate.weight.shape[0], device=moe.gate.weight.device)
        moe.forward = (lambda m: (lambda x: moe_forward(m, model.config, x)))(moe)


def check_dense_moe(model, device):
    """the dense all-experts forward against HF's own (eager per-expert loop) on random input"""
    model.eval()
    moe = moe_layers(model)[0]
    x = torch.randn(2, 16, model.config.hidden_size, device=device)
    with torch.no_grad():
        ref = type(moe).forward(moe, x)
        got = moe_forward(moe, model.config, x)
    err = float((ref - got).abs().max() / ref.abs().max())
    if not err < 1e-4:
        raise SystemExit(f"target: the dense MoE forward differs from HF's by {err:.2e} (relative)")
    return err


# ------------------------------------------------------------------------------------------- data
def windows(tokens, n, length, gen):
    """n random windows of `length` tokens from the 1-D token tensor (on its device)"""
    starts = torch.randint(0, tokens.numel() - length, (n,), generator=gen).to(tokens.device)
    return tokens[starts[:, None] + torch.arange(length, device=tokens.device)].long()


def heldout_loss(model, batches):
    """mean next-token cross entropy (nats/token) in fp32 over fixed held-out windows"""
    tot, n = 0.0, 0
    model.eval()
    with torch.no_grad():
        for ids in batches:
            lg = model(ids[:, :-1], use_cache=False).logits.float()
            tot += float(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"))
            n += ids[:, 1:].numel()
    return tot / n


# ------------------------------------------------------------------------------------------- export
def quantize_int4(w, group=32):
    """symmetric group-wise INT4 of a [out, in] weight: scale = absmax / 7 rounded to bf16, q = round(w / scale)
    in [-8, 7] -> (q int8 numpy, scale float64 numpy)"""
    out, k = w.shape
    g = w.double().reshape(out, k // group, group)
    scale = (g.abs().amax(-1) / 7).clamp(min=1e-10).to(torch.bfloat16).double()
    q = torch.round(g / scale[..., None]).clamp(-8, 7).reshape(out, k)
    return q.to(torch.int8).numpy(), scale.numpy()


def to_stored(model, text):
    """tinymodels.Weights holding the trained weights in their stored form (bf16, f32 bias, INT4 experts), with the
    tensor names and shapes tinymodels.make_weights uses for K2.6 (checked)"""
    W = tm.Weights()
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items() if not k.endswith("inv_freq")}
    mI = text["moe_intermediate_size"]
    for name, t in sd.items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            continue
        if name.endswith("e_score_correction_bias"):
            W.dense(name, t.double().numpy(), dtype=torch.float32)
        else:
            W.dense(name, t.double().numpy())
    for l in range(text["first_k_dense_replace"], text["num_hidden_layers"]):
        m = f"model.layers.{l}.mlp.experts."
        gu, dn = sd[m + "gate_up_proj"], sd[m + "down_proj"]
        for e in range(text["n_routed_experts"]):
            for proj, w in (("gate_proj", gu[e, :mI]), ("up_proj", gu[e, mI:]), ("down_proj", dn[e])):
                W.quant(f"{m}{e}.{proj}", *quantize_int4(w))
    ref = tm.make_weights(text, 0, int4_experts=True)
    want = {k: tuple(v.shape) for k, v in ref.stored.items()}
    got = {k: tuple(v.shape) for k, v in W.stored.items()}
    if want != got:
        raise SystemExit(f"target: exported tensors differ from tinymodels' K2.6 layout: missing "
                         f"{sorted(set(want) - set(got))[:5]}, extra {sorted(set(got) - set(want))[:5]}, shapes "
                         f"{[(k, want[k], got[k]) for k in want if k in got and want[k] != got[k]][:5]}")
    return W


def write_model(outdir, W, text, n_base, tokdir):
    """tinymodels.write_k26 (2 shards + index, vision/projector dummies), then this vocabulary's ids and files"""
    H = text["hidden_size"]
    orig = tm.vision_dummies

    def vision(rng):
        d = orig(rng)
        d["mm_projector.proj.2.weight"] = tm.bf16(rng.standard_normal((H, 32)) * 0.05)   # projector -> hidden
        return d
    tm.vision_dummies = vision
    try:
        meta = {"bos": text["bos_token_id"], "pad": text["pad_token_id"],
                "eos": [n_base + SPECIAL_OFFSETS["[EOS]"], n_base + SPECIAL_OFFSETS["<|im_end|>"],
                        n_base + SPECIAL_OFFSETS["[EOT]"]]}
        tm.write_k26(outdir, W, text, meta, seed=16)
    finally:
        tm.vision_dummies = orig
    cfg = read_json(os.path.join(outdir, "config.json"))
    cfg["media_placeholder_token_id"] = n_base + SPECIAL_OFFSETS["<|media_pad|>"]
    cfg["vision_config"]["text_hidden_size"] = H
    tm.write_json(os.path.join(outdir, "config.json"), cfg)
    for f in ("tiktoken.model", "tokenizer_config.json"):
        with open(os.path.join(tokdir, f), "rb") as src, open(os.path.join(outdir, f), "wb") as dst:
            dst.write(src.read())


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--minutes", type=float, default=3.2, help="wall time of the training loop")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: arch.TARGET_LR of the size)")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--max-steps", type=int, default=10 ** 9)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--eval-windows", type=int, default=256)
    ap.add_argument("--size", choices=["mini", "large"], default="mini", help="arch.py's dimensions (large: not shipped)")
    ap.add_argument("--smoke", action="store_true", help="arch.py's toy dimensions (a CPU test of the recipe)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    size = "smoke" if a.smoke else a.size
    if a.lr is None:
        a.lr = arch.TARGET_LR[size]
    dev = a.device
    torch_setup(a.seed, dev)
    stats = read_json(os.path.join(a.outdir, "tokenizer_stats.json"))
    n_base = stats["n_base"]
    text = arch.text_config(n_base, size)
    est, dest = arch.target_bytes(text), arch.drafter_bytes(arch.drafter_config(text, size))
    limit = arch.size_limit(size)
    log("target", f"estimated size: target {est / 1e6:.2f} MB + drafter {dest / 1e6:.2f} MB "
        f"(limit {f'{limit / 1e6:.0f} MB' if limit else 'none'})")
    if limit and est + dest > 0.98 * limit:
        raise SystemExit(f"target: {est + dest} bytes estimated, over 98% of {limit}: shrink arch.py's dims")

    from transformers import DeepseekV3ForCausalLM
    cfg = tm.hf_config(text)
    model = DeepseekV3ForCausalLM(cfg).to(dev)
    for moe in moe_layers(model):
        moe.gate.e_score_correction_bias.zero_()
        torch.nn.init.normal_(moe.gate.weight, std=cfg.initializer_range)
    err = check_dense_moe(model, dev)
    install_dense_moe(model)
    n_par = sum(p.numel() for p in model.parameters())
    log("target", f"DeepseekV3ForCausalLM: {n_par / 1e6:.2f} M parameters; dense MoE forward = HF's to {err:.1e}")

    train = torch.from_numpy(np.load(os.path.join(a.outdir, "tokens", "train.npy")).astype(np.int32)).to(dev)
    held = torch.from_numpy(np.load(os.path.join(a.outdir, "tokens", "heldout.npy")).astype(np.int32)).to(dev)
    g = torch.Generator().manual_seed(a.seed)
    ev_len = min(a.seq_len + 1, held.numel() // 2)
    eval_batches = list(windows(held, a.eval_windows, ev_len, torch.Generator().manual_seed(1)).split(32))

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "gate.weight" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "gate.weight" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), fused=dev.startswith("cuda"))
    budget = 60 * a.minutes
    t0 = time.time()
    hist, ema, step, tokens_seen = [], None, 0, 0
    amp = dev.startswith("cuda")
    while True:
        step += 1
        prog = min(1.0, max((time.time() - t0) / budget, step / a.max_steps))
        lr = a.lr * min(1.0, step / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))
        for gr in opt.param_groups:
            gr["lr"] = lr
        ids = windows(train, a.batch, a.seq_len + 1, g)
        model.train()
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=amp):
            hs = model.model(input_ids=ids[:, :-1], use_cache=False).last_hidden_state
            lg = model.lm_head(hs).float()
        loss = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for moe in moe_layers(model):
                moe.gate.e_score_correction_bias += a.bias_rate * torch.sign(moe.load.mean() - moe.load)
                moe.load.zero_()
        tokens_seen += ids[:, 1:].numel()
        done = prog >= 1.0
        if step % 100 == 0 or done or step == 1:
            lv = loss.item()
            ema = lv if ema is None else 0.9 * ema + 0.1 * lv
            el = time.time() - t0
            hist.append({"step": step, "loss": lv, "lr": lr, "tokens": tokens_seen, "time_s": el})
            log("target", f"step {step:5d}  loss {lv:.3f} (ema {ema:.3f})  lr {lr:.2e}  "
                f"{tokens_seen / 1e6:.1f} M tokens  {tokens_seen / max(el, 1e-9) / 1e3:.0f} k tok/s")
        if done:
            break
    train_s = time.time() - t0
    model.eval()
    for moe in moe_layers(model):
        loads = moe_usage(moe, model, eval_batches[0])
        log("target", f"expert load (held-out batch) min/max {loads.min():.3f}/{loads.max():.3f} of the mean")
        break
    if dev.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
    loss_trained = heldout_loss(model, eval_batches)
    W = to_stored(model, text)
    mdir = arch.model_dirs(a.outdir, size)[0]
    write_model(mdir, W, text, n_base, os.path.join(a.outdir, "tokenizer"))
    stored = tm.hf_model(text, W).float().to(dev)
    install_dense_moe(stored)
    loss_int4 = heldout_loss(stored, eval_batches)
    bf16 = copy.deepcopy(model)
    with torch.no_grad():
        for p in bf16.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    install_dense_moe(bf16)
    loss_bf16 = heldout_loss(bf16, eval_batches)
    size = dir_bytes(mdir)
    rep = {"config": {k: text[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                           "v_head_dim", "intermediate_size", "moe_intermediate_size",
                                           "n_routed_experts", "num_experts_per_tok", "n_shared_experts")},
           "parameters": n_par, "steps": step, "train_tokens_seen": tokens_seen, "train_seconds": train_s,
           "seq_len": a.seq_len, "batch": a.batch, "lr": a.lr, "train_tokens_available": int(train.numel()),
           "heldout_eval_tokens": sum(b[:, 1:].numel() for b in eval_batches),
           "heldout_loss_nats_per_token": {"trained_fp32": loss_trained, "stored_bf16_experts_bf16": loss_bf16,
                                           "shipped_int4_experts": loss_int4},
           "bytes_on_disk": size, "history": hist}
    update_report(a.outdir, "target", rep)
    log("target", f"held-out loss (nats/token): trained {loss_trained:.4f}, bf16 {loss_bf16:.4f}, INT4 experts "
        f"{loss_int4:.4f}; wrote {mdir} ({size / 1e6:.2f} MB)")


def moe_usage(moe, model, batch):
    """fraction of selections per expert on one batch, relative to the mean (1 = balanced)"""
    moe.train()
    moe.load.zero_()
    with torch.no_grad():
        model(batch[:, :-1], use_cache=False)
    moe.eval()
    load = moe.load / moe.load.mean()
    moe.load.zero_()
    return load


if __name__ == "__main__":
    main()
