#!/usr/bin/env python3
"""Stage 4 and the self-check: the DFlash drafter of OUTDIR/models/mini-code (large-code with --size large), then
the pair's quick checks.

    python3 drafter.py OUTDIR [--minutes 2] [--device cuda] [--size mini|large] [--smoke]

Data (ddtree_dflash.md 2.4, self-distillation): prompts are seeded windows of the TRAIN tokens (lengths
--prompt-lens), continued to --seq-len tokens by the frozen target as shipped (read back from
OUTDIR/models/mini-code: bf16 weights, INT4 experts dequantized; fp32, TF32 matmuls), greedily (--greedy
sequences) or sampled at T = 1 (--sampled), batched on the GPU (scripts/golden/train_tiny_drafter.hf_generate).
Features: the outputs of the tap layers and the final-normed hidden (soft labels) of one causal forward.
Training: scripts/golden/train_tiny_drafter.train (block [anchor, MASK x (bs-1)] with the target's embedding and
lm_head frozen; the DFlash depth-weighted cross entropy plus --kl times the soft-label term; AdamW, cosine over
--minutes). The stored bf16 drafter is checked against scripts/golden/dflash_ref.py (float64) and written to
OUTDIR/models/mini-code-dflash (large-code-dflash).

Self-check (OUTDIR/report.json "selfcheck"), on the HELD-OUT split: --heldout-prompts seeded windows of
--heldout-len tokens (written to OUTDIR/heldout_prompts.json for the specs); the target's greedy continuation of a
few of them (ids and text); the target's greedy continuations of all, and on them the drafter's per-depth top-1
agreement with the target and the chain tau of argmax drafting (a cheap tau proxy); the size check of the pair
(arch.size_limit: the shipped size's 16 MB): the stage fails when the two directories are larger."""
import argparse
import base64
import json
import os
import time
from types import SimpleNamespace

import numpy as np
import torch
from safetensors.torch import save_file

import arch
from common import log, read_json, torch_setup, update_report, write_json
import make_tiny_drafter as mtd
import train_tiny_drafter as ttd
from target import dir_bytes, install_dense_moe


def load_encoding(tokdir):
    """tiktoken's Encoding of the trained tokenizer, for decoding ids to text"""
    import tiktoken
    from common import KIMI_PAT, special_ids
    ranks = {}
    with open(os.path.join(tokdir, "tiktoken.model")) as f:
        for line in f:
            tok, r = line.split()
            ranks[base64.b64decode(tok)] = int(r)
    return tiktoken.Encoding("mini-code", pat_str=KIMI_PAT, mergeable_ranks=ranks,
                             special_tokens=special_ids(len(ranks))[1])


def features(model, tokens, taps, device, chunk=256):
    """tap-layer outputs [N, T, len(taps) * H] and final-normed hidden [N, T, H] (fp32, on device), and the argmax
    of every position [N, T]"""
    N, T = tokens.shape
    H = model.config.hidden_size
    feats = torch.empty(N, T, len(taps) * H, device=device)
    final = torch.empty(N, T, H, device=device)
    am = torch.empty(N, T, dtype=torch.long)
    with torch.no_grad():
        for i in range(0, N, chunk):
            out = model(tokens[i:i + chunk].to(device), output_hidden_states=True, use_cache=False)
            feats[i:i + chunk] = torch.cat([out.hidden_states[l + 1] for l in taps], dim=-1)
            final[i:i + chunk] = out.hidden_states[-1]
            am[i:i + chunk] = out.logits.argmax(-1).cpu()
    return feats, final, am


def make_data(model, prompts, n_greedy, seq_len, taps, device, tag, budget_s=0.0, chunk=1024):
    """the target's continuations of prompts[:n_greedy] (greedy) and of the rest (T = 1), generated in chunks of
    both kinds in proportion; with budget_s > 0 no new chunk starts once budget_s seconds have passed (the ones
    generated are kept: greedy first, then sampled)"""
    t0 = time.time()
    greedy, sampled = prompts[:n_greedy], prompts[n_greedy:]
    done_g, done_s, gen_g, gen_s = [], [], [], []
    ng = max(1, round(chunk * len(greedy) / max(1, len(prompts))))
    while len(done_g) < len(greedy) or len(done_s) < len(sampled):
        if budget_s and done_g and time.time() - t0 > budget_s:
            log("drafter", f"{tag}: data budget of {budget_s:.0f} s spent: {len(done_g) + len(done_s)} of "
                f"{len(prompts)} sequences")
            break
        pg = greedy[len(done_g):len(done_g) + ng]
        ps = sampled[len(done_s):len(done_s) + chunk - ng]
        jobs = [("greedy", 0, seq_len - len(p), p) for p in pg] + [("sample", 0, seq_len - len(p), p) for p in ps]
        out = ttd.hf_generate(model, jobs, seq_len, device)
        done_g, gen_g = done_g + pg, gen_g + out[:len(pg)]
        done_s, gen_s = done_s + ps, gen_s + out[len(pg):]
    prompts, gen, n_greedy = done_g + done_s, gen_g + gen_s, len(done_g)
    tokens = torch.tensor([p + g for p, g in zip(prompts, gen)], dtype=torch.long)
    plen = torch.tensor([len(p) for p in prompts])
    t1 = time.time()
    feats, final, am = features(model, tokens, taps, device)
    agree = total = 0
    for r in range(n_greedy):
        L = int(plen[r])
        agree += int((am[r, L - 1:-1] == tokens[r, L:]).sum())
        total += seq_len - L
    log("drafter", f"{tag}: {len(prompts)} continuations ({n_greedy} greedy) to {seq_len} tokens in {t1 - t0:.1f} s, "
        f"features in {time.time() - t1:.1f} s; one-pass argmax = the generated greedy token at {agree}/{total}")
    return {"tokens": tokens, "plen": plen, "n_greedy": n_greedy, "prompts": prompts, "feats": feats,
            "final": final, "embed": model.model.embed_tokens.weight.detach().clone(),
            "lm_head": model.lm_head.weight.detach().clone()}


def sample_prompts(tokens, n, lens, seed, eos=None):
    """n seeded windows of the token array, lengths cycling through lens (no eos inside when eos is given)"""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        L = lens[len(out) % len(lens)]
        s = int(rng.integers(0, tokens.size - L))
        w = [int(x) for x in tokens[s:s + L]]
        if eos is None or eos not in w:
            out.append(w)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--minutes", type=float, default=2.0, help="wall time of the training loop")
    ap.add_argument("--deadline", type=float, default=0,
                    help="unix time by which this stage must end: the training loop gets what is left after the "
                         "data, less --reserve seconds for the checks (overrides --minutes)")
    ap.add_argument("--reserve", type=float, default=30)
    ap.add_argument("--data-share", type=float, default=0.35,
                    help="with --deadline: the share of the time left that the training data may take")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--greedy", type=int, default=6144)
    ap.add_argument("--sampled", type=int, default=2048)
    ap.add_argument("--prompt-lens", default="16,24,32,48")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--kl", type=float, default=1.0)
    ap.add_argument("--gamma", type=float, default=7.0, help="depth weight exp(-(k-1)/gamma) (DFlash: 7 for bs 16)")
    ap.add_argument("--heldout-prompts", type=int, default=32)
    ap.add_argument("--heldout-len", type=int, default=64)
    ap.add_argument("--heldout-new", type=int, default=64, help="greedy tokens after each held-out prompt")
    ap.add_argument("--size", choices=["mini", "large"], default="mini", help="arch.py's dimensions (large: not shipped)")
    ap.add_argument("--smoke", action="store_true", help="arch.py's toy dimensions (a CPU test of the recipe)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    size = "smoke" if a.smoke else a.size
    dev = a.device
    torch_setup(a.seed, dev)
    mdir, ddir = arch.model_dirs(a.outdir, size)
    text = read_json(os.path.join(mdir, "config.json"))["text_config"]
    cfg = arch.drafter_config(text, size)
    taps, bs = cfg["dflash_config"]["target_layer_ids"], cfg["block_size"]
    ttd.MASK_ID = cfg["dflash_config"]["mask_token_id"]
    _, _, model = mtd.load_target(mdir)              # the shipped checkpoint read back (INT4 dequantized exactly)
    model = model.float().to(dev).eval()
    install_dense_moe(model)
    eos = text["eos_token_id"]
    train_tok = np.load(os.path.join(a.outdir, "tokens", "train.npy"))
    held_tok = np.load(os.path.join(a.outdir, "tokens", "heldout.npy"))
    lens = [int(x) for x in a.prompt_lens.split(",")]
    prompts = sample_prompts(train_tok, a.greedy + a.sampled, lens, a.seed + 1)
    if not 0 < a.data_share < 1:
        raise SystemExit(f"drafter: --data-share {a.data_share}: expected a share in (0, 1)")
    budget = a.data_share * (a.deadline - time.time() - a.reserve) if a.deadline else 0.0
    data = make_data(model, prompts, a.greedy, a.seq_len, taps, dev, "training data", budget_s=budget)
    prompts = data["prompts"]

    minutes = max(0.2, (a.deadline - time.time() - a.reserve) / 60) if a.deadline else a.minutes
    log("drafter", f"training for {minutes:.2f} min")
    targs = SimpleNamespace(device=dev, seed=a.seed, lr=a.lr, wd=0.01, gamma=a.gamma, val=min(400, len(prompts) // 4),
                            steps=10 ** 9, max_minutes=minutes, warmup=100, batch=a.batch, anchors=a.anchors,
                            kl=a.kl, log_every=500)
    t0 = time.time()
    w, hist, _ = ttd.train(targs, data, cfg)
    train_s = time.time() - t0
    stored = {k: v.to(torch.bfloat16).contiguous() for k, v in w.items()}
    data_cpu = dict(data, feats=data["feats"].cpu(), final=data["final"].cpu())
    ttd.check_against_reference(cfg, {k: v.double() for k, v in stored.items()}, data_cpu)
    os.makedirs(ddir, exist_ok=True)
    with open(os.path.join(ddir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    save_file(stored, os.path.join(ddir, "model.safetensors"), metadata={"format": "pt"})
    os.chmod(os.path.join(ddir, "model.safetensors"), 0o644)
    log("drafter", f"trained {hist[-1]['step'] if hist else 0} steps in {train_s:.0f} s; wrote {ddir}")
    update_report(a.outdir, "drafter", {"config": {k: cfg[k] for k in ("block_size", "num_hidden_layers",
                                                                     "intermediate_size", "head_dim")},
                                        "taps": taps, "mask_token_id": ttd.MASK_ID, "sequences": len(prompts),
                                        "greedy": data["n_greedy"], "sampled": len(prompts) - data["n_greedy"], "seq_len": a.seq_len,
                                        "train_seconds": train_s, "history": hist})

    # ---------------------------------------------------------------- self-check on the held-out split
    enc = load_encoding(os.path.join(a.outdir, "tokenizer"))
    hp = sample_prompts(held_tok, a.heldout_prompts, [a.heldout_len], 12345, eos=eos)
    write_json(os.path.join(a.outdir, "heldout_prompts.json"),
               {"split": "heldout", "seed": 12345, "length": a.heldout_len, "prompts": hp,
                "text": [enc.decode(p) for p in hp]}, indent=None)
    hdata = make_data(model, hp, len(hp), a.heldout_len + a.heldout_new, taps, dev, "held-out check")
    wdev = {k: v.float().to(dev) for k, v in stored.items()}
    wk = torch.exp(-torch.arange(bs - 1, dtype=torch.float32) / a.gamma).to(dev)
    vl, vce, vacc, vchain, vr16 = ttd.evaluate(cfg, wdev, hdata, torch.arange(len(hp)), 16, bs, wk)
    samples = []
    for i in range(min(4, len(hp))):
        ids = hdata["tokens"][i, a.heldout_len:].tolist()
        samples.append({"prompt_index": i, "prompt": enc.decode(hp[i]), "greedy": enc.decode(ids), "greedy_ids": ids})
    size_t, size_d = dir_bytes(mdir), dir_bytes(ddir)
    names = [os.path.basename(mdir), os.path.basename(ddir)]
    limit = arch.size_limit(size)
    check = {"heldout_prompts": len(hp), "drafter_top1_agreement_by_depth": [round(x, 4) for x in vacc.tolist()],
             "drafter_ce_by_depth": [round(x, 4) for x in vce.tolist()], "chain_tau_argmax": vchain,
             "depth1_recall_at_16": vr16, "greedy_samples": samples,
             "bytes": {names[0]: size_t, names[1]: size_d, "total": size_t + size_d, "limit": limit}}
    update_report(a.outdir, "selfcheck", check)
    log("selfcheck", f"held-out: drafter top-1 agreement by depth {' '.join(f'{x:.2f}' for x in vacc.tolist())}; "
        f"chain tau (argmax) {vchain:.2f}; recall@16 depth 1 {vr16:.2f}")
    for s in samples[:2]:
        log("selfcheck", f"prompt ...{s['prompt'][-120:]!r}\n    greedy -> {s['greedy'][:300]!r}")
    log("selfcheck", f"size: {names[0]} {size_t / 1e6:.2f} MB + {names[1]} {size_d / 1e6:.2f} MB = "
        f"{(size_t + size_d) / 1e6:.2f} MB (limit {f'{limit / 1e6:.0f} MB' if limit else 'none'})")
    if limit and size_t + size_d > limit:
        raise SystemExit(f"selfcheck: the pair is {size_t + size_d} bytes, over {limit}")


if __name__ == "__main__":
    main()
