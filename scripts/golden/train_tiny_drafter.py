#!/usr/bin/env python3
"""train_tiny_drafter.py: train the shipped tiny DFlash drafter (models/tiny-k2.6-dflash) on the tiny target
(models/tiny-k2.6) by self-distillation, the DFlash way.

The shipped weights came from this command on one H200 (data 75 s, training 240 s = 13290 steps; see
docs/dflash.md "The shipped tiny drafter is trained"):

    python3 scripts/golden/train_tiny_drafter.py --device cuda --gen hf --greedy 16000 --sampled 4000 \
        --batch 64 --anchors 32 --steps 40000 --lr 2e-3 --kl 1 --max-minutes 4 --val 400 --out DIR
    # (these are the defaults; the run stopped on --max-minutes, so the cosine schedule followed wall time:
    #  --steps 13290 --max-minutes 0 gives about the same schedule: the time per step was near constant)

then, here (CPU): put DIR/model.safetensors into models/tiny-k2.6-dflash/ and
    KDTREE_LIB=build/libkdtree.so python3 scripts/golden/train_tiny_drafter.py --check --eval   # vs dflash_ref + tau
    python3 scripts/golden/make_tiny_drafter.py --no-weights                                  # the golden
    KDTREE_LIB=build/libkdtree.so python3 scripts/golden/train_tiny_drafter.py --eval-only     # tau table only

On a CPU the same recipe needs hours: about 1000 blocks/s on 2 idle cores, while the shipped run saw 27M blocks
(13290 x 64 x 32) and had the depth-1 skill by its first log (step 1000, 2M blocks). The 15-minute CPU runs tried
first (--batch 8-16 --anchors 16, 0.1-0.2M blocks, on a shared and heavily loaded box) learned only the unigram
(depth-1 accuracy 0.5%, chain tau 1.00).

Data (self-distillation). Random prompts: token ids uniform in [0, 1000) (the special ids 1000..1023 - bos, eos,
pad, mask - never appear in a prompt), length uniform in [4, 32]; each is continued by the target itself to a total
length of --seq-len tokens, greedily (--greedy sequences) or sampled at temperature 1 (--sampled sequences), with
eos ignored. The continuations come from HF DeepseekV3ForCausalLM in float32 (--gen hf: batched, no cache, argmax /
multinomial) or from the engine (--gen engine: `kd.open_model` through LuaJIT, fp32 CPU backend, faster on a CPU);
the two agree on greedy tokens (checked: 16/16 sequences; HF vs engine argmax 330237/330242 positions). The tap
features (outputs of target decoder layers 1 and 2 = HF hidden_states[l+1]) and the final-normed hidden of every
position come from HF in float32 built from the checkpoint (make_tiny_drafter.load_target, which reuses
tinymodels.hf_config), one causal forward over the whole sequence; its argmax must reproduce the greedy tokens.

Recipe (DFlash training, ddtree_dflash.md 2.4). Per sequence --anchors random anchor positions a in the generated
part (a >= prompt length, a + bs - 1 < seq len: the anchor plays the bonus token, the first token the target
produced after a context). Block = [token[a], MASK x (bs-1)] embedded with the frozen target embedding at positions
a .. a+bs-1; the drafter's context is hidden_norm(fc(taps)) of positions 0..a-1 (strictly before the anchor),
injected as K/V in every layer; block queries attend to that context and bidirectionally to their own block.
Labels: block row k (1..bs-1) predicts token[a+k]; loss = cross entropy through the frozen target lm_head after the
drafter's final norm, weighted w_k = exp(-(k-1)/4), normalised by sum w_k (the DFlash loss), PLUS --kl times the
same weighted cross entropy against the target's own distribution at that position (softmax of lm_head(final
hidden at a+k-1): soft labels, i.e. KL(target || drafter) + const; --kl 0 is pure DFlash). Frozen: target embedding
(MASK row included) and lm_head. Trained: fc, hidden_norm, the layers, norm (AdamW, betas 0.9/0.98, wd 0.01 on
matrices, warmup 100, cosine to 5%, grad clip 1). The forward below is dflash_ref.draft_logprobs batched over
(sequence, anchor) with a context mask; after training it is checked against dflash_ref itself in float64 on the
bf16-rounded weights (max |d log-prob| ~1e-14).

Output: model.safetensors (bf16, the same tensor names as make_tiny_drafter.py writes); config.json is rewritten
from make_tiny_drafter.drafter_config (unchanged). --eval / --eval-only measure tau with
`scripts/kdtree generate --stats -n 64` (greedy, eos stops) for ddtree B = 0, 4, 16, 64 and dflash on --eval-prompts
prompts drawn with --eval-seed, length 8..24 (checked disjoint from the training prompts when training).
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dflash_ref  # noqa: E402
import make_tiny_drafter as mtd  # noqa: E402

ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
MAX_PROMPT_ID = 1000          # ids 1000..1023 are bos / eos / pad / mask / reserved

# LuaJIT generator: one line per job on stdin "mode seed n id,id,..." -> "id id ..." (n generated ids) on stdout
GEN_LUA = r"""
package.path = ROOT .. "/lua/?.lua;" .. ROOT .. "/lua/?/init.lua;" .. package.path
local kd = require("kdtree")
local m = kd.open_model(MODEL)
for line in io.lines() do
  local mode, seed, n, ids = line:match("^(%a+) (%d+) (%d+) ([%d,]+)$")
  seed, n = tonumber(seed), tonumber(n)
  local p = {}
  for x in ids:gmatch("%d+") do p[#p + 1] = tonumber(x) end
  local s = m:new_seq(#p + n + 1)
  s:forward(p)
  local out = {}
  local sampler = mode == "sample" and { temperature = 1.0, seed = seed } or nil
  local rows = s:out_rows()
  for i = 1, n do
    local t
    if sampler then t = s:sample(sampler)[rows] else t = s:argmax()[rows] end
    out[i] = t
    if i < n then s:forward({ t }); rows = s:out_rows() end
  end
  io.write(table.concat(out, " "), "\n")
  io.flush()
  s:close()
end
m:close()
"""


def make_prompts(n, seed, lo=4, hi=32):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append(torch.randint(0, MAX_PROMPT_ID, (L,), generator=g).tolist())
    return out


def engine_generate(jobs, target, workers=2):
    """jobs: list of (mode, seed, n, prompt) -> list of generated id lists, via the engine's LuaJIT API."""
    lib = os.environ.get("KDTREE_LIB")
    if not lib:
        raise SystemExit("set KDTREE_LIB=path/to/libkdtree.so (the engine generates the continuations)")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(f"local ROOT, MODEL = {json.dumps(ROOT)}, {json.dumps(target)}\n" + GEN_LUA)
        script = f.name
    chunks = [list(range(i, len(jobs), workers)) for i in range(workers)]
    procs = []
    for ch in chunks:
        inp = "".join(f"{jobs[j][0]} {jobs[j][1]} {jobs[j][2]} {','.join(map(str, jobs[j][3]))}\n" for j in ch)
        p = subprocess.Popen(["luajit", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=dict(os.environ, KDTREE_LIB=lib))
        procs.append((p, inp))
    res = [None] * len(jobs)
    outs = [p.communicate(inp) for p, inp in procs]
    os.unlink(script)
    for (p, _), (so, se), ch in zip(procs, outs, chunks):
        if p.returncode != 0:
            raise SystemExit(f"engine generator failed: {se}")
        lines = so.strip("\n").split("\n")
        assert len(lines) == len(ch), (len(lines), len(ch))
        for j, ln in zip(ch, lines):
            res[j] = [int(x) for x in ln.split()]
    return res


def hf_generate(model, jobs, seq_len, device, chunk=2048):
    """The same continuations with HF DeepseekV3ForCausalLM (float32, no cache: one causal forward over the whole
    prefix per new token), batched over prompts of equal length. Greedy = argmax; sampled = a draw from
    softmax(logits) (T = 1) with a torch generator seeded per batch."""
    out = [None] * len(jobs)
    by_len = {}
    for j, (_, _, _, p) in enumerate(jobs):
        by_len.setdefault(len(p), []).append(j)
    with torch.no_grad():
        for L, js in sorted(by_len.items()):
            for c in range(0, len(js), chunk):
                jj = js[c:c + chunk]
                ids = torch.tensor([jobs[j][3] for j in jj], device=device)
                samp = torch.tensor([jobs[j][0] == "sample" for j in jj], device=device)
                g = torch.Generator(device=device).manual_seed(1000003 * L + c)
                for _ in range(L, seq_len):
                    lg = model(ids, use_cache=False, logits_to_keep=1).logits[:, -1].float()
                    nxt = lg.argmax(-1)
                    if bool(samp.any()):
                        drawn = torch.multinomial(torch.softmax(lg, -1), 1, generator=g)[:, 0]
                        nxt = torch.where(samp, drawn, nxt)
                    ids = torch.cat([ids, nxt[:, None]], 1)
                for r, j in enumerate(jj):
                    out[j] = ids[r, L:].tolist()
    return out


def make_data(a):
    t0 = time.time()
    prompts = make_prompts(a.greedy + a.sampled, a.data_seed)
    jobs = []
    for i, p in enumerate(prompts):
        mode = "greedy" if i < a.greedy else "sample"
        jobs.append((mode, 1000 + i, a.seq_len - len(p), p))
    if a.gen == "engine":
        gen = engine_generate(jobs, a.target)
        model = None
    else:
        _, _, model = mtd.load_target(a.target)
        model = model.float().to(a.device)
        gen = hf_generate(model, jobs, a.seq_len, a.device)
    print(f"generated {len(jobs)} continuations ({a.greedy} greedy, {a.sampled} T=1) with {a.gen} in "
          f"{time.time() - t0:.1f} s", flush=True)
    data = {"tokens": torch.tensor([p + g for p, g in zip(prompts, gen)], dtype=torch.long),
            "plen": torch.tensor([len(p) for p in prompts]), "n_greedy": a.greedy, "prompts": prompts}
    add_features(a, data, model)
    return data


def add_features(a, data, model=None):
    """HF float32: tap features (hidden_states[l+1], l in taps), the final-normed hidden (lm_head of it = the
    target's logits, the soft labels), the frozen embedding and lm_head."""
    t0 = time.time()
    if model is None:
        _, _, model = mtd.load_target(a.target)
        model = model.float().to(a.device)
    H = model.config.hidden_size
    taps = [1, 2]
    tokens, plen = data["tokens"], data["plen"]
    N, T = tokens.shape
    feats = torch.empty(N, T, len(taps) * H, dtype=torch.float32, device=a.device)
    final = torch.empty(N, T, H, dtype=torch.float32, device=a.device)
    agree = total = 0
    with torch.no_grad():
        for i in range(0, N, 128):
            out = model(tokens[i:i + 128].to(a.device), output_hidden_states=True, use_cache=False)
            feats[i:i + 128] = torch.cat([out.hidden_states[l + 1] for l in taps], dim=-1)
            # HF's last hidden_states entry is after the final norm: lm_head of it = the logits
            final[i:i + 128] = out.hidden_states[-1]
            assert torch.allclose(out.hidden_states[-1] @ model.lm_head.weight.T, out.logits, atol=1e-4)
            am = out.logits[:, :-1].argmax(-1).cpu()
            for r in range(am.shape[0]):
                if i + r < data["n_greedy"]:
                    L = int(plen[i + r])
                    agree += int((am[r, L - 1:] == tokens[i + r, L:]).sum())
                    total += T - L
    print(f"HF float32 tap features in {time.time() - t0:.1f} s; HF argmax = the generated greedy token at "
          f"{agree}/{total} positions", flush=True)
    data.update(feats=feats, final=final, embed=model.model.embed_tokens.weight.detach().clone(),
                lm_head=model.lm_head.weight.detach().clone())


# ---------------------------------------------------------------- the drafter, batched over (sequence, anchor)
def init_weights(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nt = len(cfg["dflash_config"]["target_layer_ids"])

    def lin(o, i, gain=1.0):
        return torch.randn(o, i, generator=g) * (gain / i ** 0.5)

    w = {"fc.weight": lin(H, nt * H), "hidden_norm.weight": torch.ones(H), "norm.weight": torch.ones(H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(H)
        w[p + "post_attention_layernorm.weight"] = torch.ones(H)
        w[p + "self_attn.q_proj.weight"] = lin(nh * hd, H)
        w[p + "self_attn.k_proj.weight"] = lin(nkv * hd, H)
        w[p + "self_attn.v_proj.weight"] = lin(nkv * hd, H)
        w[p + "self_attn.o_proj.weight"] = lin(H, nh * hd, 0.5)
        w[p + "self_attn.q_norm.weight"] = torch.ones(hd)
        w[p + "self_attn.k_norm.weight"] = torch.ones(hd)
        w[p + "mlp.gate_proj.weight"] = lin(I, H)
        w[p + "mlp.up_proj.weight"] = lin(I, H)
        w[p + "mlp.down_proj.weight"] = lin(H, I, 0.5)
    return w


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_cache(cfg, n, dtype):
    """cos, sin [n, head_dim] (amplitude included) for positions 0..n-1, from dflash_ref.rope_tables."""
    inv_freq, amp = dflash_ref.rope_tables(cfg)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return (emb.cos() * amp).to(dtype), (emb.sin() * amp).to(dtype)


def rope(x, cos, sin):
    """x [..., S, heads, hd]; cos/sin [..., S, hd] (dflash_ref.apply_rope)."""
    return x * cos[..., None, :] + dflash_ref.rotate_half(x) * sin[..., None, :]


def draft_hidden(cfg, w, embed, feats, blk_ids, anchors):
    """feats [B, T, n_taps*H]; blk_ids [B, A, bs]; anchors [B, A] (block positions anchor..anchor+bs-1, context =
    positions < anchor). Returns norm(x) [B, A, bs, H] - the same math as dflash_ref.draft_logprobs."""
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg.get("rms_norm_eps", 1e-6)
    bs = cfg["block_size"]
    B, T, _ = feats.shape
    A = anchors.shape[1]
    rep = nh // nkv
    dev = feats.device
    cos, sin = (t.to(dev) for t in rope_cache(cfg, T + bs, feats.dtype))
    pos_blk = anchors[..., None] + torch.arange(bs, device=dev)                        # [B, A, bs]
    cos_b, sin_b, cos_c, sin_c = cos[pos_blk], sin[pos_blk], cos[:T], sin[:T]
    fused = rmsnorm(feats @ w["fc.weight"].T, w["hidden_norm.weight"], eps)          # [B, T, H]
    x = embed[blk_ids]                                                                 # [B, A, bs, H]
    ctx_vis = torch.arange(T, device=dev)[None, None, :] < anchors[..., None]          # [B, A, T]
    ctx_bias = torch.zeros(B, A, 1, 1, 1, T, dtype=x.dtype, device=dev).masked_fill(~ctx_vis[:, :, None, None, None, :],
                                                                         float("-inf"))
    scale = hd ** -0.5
    for i in range(cfg["num_hidden_layers"]):
        assert dflash_ref.layer_window(cfg, i) == 0, "training covers full-attention layers only"
        p = f"layers.{i}."
        h = rmsnorm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(B, A, bs, nh, hd)
        q = rope(rmsnorm(q, w[p + "self_attn.q_norm.weight"], eps), cos_b, sin_b) * scale
        q = q.view(B, A, bs, nkv, rep, hd)                 # head j uses KV group j // rep (repeat_interleave)
        kc = (fused @ w[p + "self_attn.k_proj.weight"].T).view(B, T, nkv, hd)
        kc = rope(rmsnorm(kc, w[p + "self_attn.k_norm.weight"], eps), cos_c, sin_c)
        vc = (fused @ w[p + "self_attn.v_proj.weight"].T).view(B, T, nkv, hd)
        kb = (h @ w[p + "self_attn.k_proj.weight"].T).view(B, A, bs, nkv, hd)
        kb = rope(rmsnorm(kb, w[p + "self_attn.k_norm.weight"], eps), cos_b, sin_b)
        vb = (h @ w[p + "self_attn.v_proj.weight"].T).view(B, A, bs, nkv, hd)
        s_ctx = torch.einsum("baqgrd,bsgd->bagrqs", q, kc) + ctx_bias
        s_blk = torch.einsum("baqgrd,bakgd->bagrqk", q, kb)
        attn = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)
        o = (torch.einsum("bagrqs,bsgd->baqgrd", attn[..., :T], vc)
             + torch.einsum("bagrqk,bakgd->baqgrd", attn[..., T:], vb)).reshape(B, A, bs, nh * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h2 = rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps)
        x = x + (F.silu(h2 @ w[p + "mlp.gate_proj.weight"].T) * (h2 @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    return rmsnorm(x, w["norm.weight"], eps)


def sample_batch(data, idx, A, bs, g):
    tokens, plen = data["tokens"][idx], data["plen"][idx]
    T = tokens.shape[1]
    lo = plen.to(torch.float64)
    hi = float(T - bs)                                          # anchor + bs - 1 <= T - 1
    anchors = (lo[:, None] + torch.rand(len(idx), A, generator=g, dtype=torch.float64)
               * (hi - lo[:, None] + 1)).floor().long().clamp(max=T - bs)
    offs = anchors[..., None] + torch.arange(bs)
    blk = torch.gather(tokens[:, None, :].expand(-1, A, -1), 2, offs)        # [B, A, bs] = tokens at a..a+bs-1
    labels = blk[..., 1:].clone()
    blk_ids = blk.clone()
    blk_ids[..., 1:] = MASK_ID
    # the target's final-normed hidden at a+k-1: its logits are the distribution label a+k was drawn from
    dev = data["feats"].device
    idx, anchors, blk_ids, labels = idx.to(dev), anchors.to(dev), blk_ids.to(dev), labels.to(dev)
    teach = data["final"][idx[:, None, None], anchors[..., None] + torch.arange(bs - 1, device=dev)]
    return data["feats"][idx], blk_ids, anchors, labels, teach


MASK_ID = 1020


def loss_fn(cfg, w, data, feats, blk_ids, anchors, labels, teach, wk, kl=0.0):
    """sum_k w_k CE(token[a+k]) / sum_k w_k (the DFlash loss), plus kl * the same weighted cross entropy against the
    target's own distribution at that position (soft labels; kl = 0: pure DFlash). Both are one cross entropy with
    target weights w_k (onehot + kl p)."""
    y = draft_hidden(cfg, w, data["embed"], feats, blk_ids, anchors)[:, :, 1:]        # [B, A, bs-1, H]
    logits = (y @ data["lm_head"].T).reshape(-1, data["lm_head"].shape[0])
    nb = labels.shape[0] * labels.shape[1]
    wrow = wk.expand_as(labels).reshape(-1)
    with torch.no_grad():
        if kl > 0:
            tgt = torch.softmax(teach.reshape(-1, teach.shape[-1]) @ data["lm_head"].T, dim=-1) * kl
        else:
            tgt = torch.zeros_like(logits)
        tgt.scatter_add_(1, labels.reshape(-1, 1), torch.ones(labels.numel(), 1, dtype=tgt.dtype, device=tgt.device))
        tgt *= wrow[:, None]
    loss = F.cross_entropy(logits, tgt, reduction="sum") / (nb * float(wk.sum()))
    with torch.no_grad():
        ce = F.cross_entropy(logits, labels.reshape(-1), reduction="none").view(labels.shape)
        acc = (logits.argmax(-1).view(labels.shape) == labels).float()
    return loss, ce.mean((0, 1)), acc


def evaluate(cfg, w, data, idx, A, bs, wk, seed=123):
    """held-out: weighted CE, per-depth CE and top-1 accuracy, recall@16 of depth 1, and the chain tau of argmax
    drafting (1 + sum_k prod_{j<=k} hit_j, the expected accepted length of vanilla DFlash, bonus included)."""
    g = torch.Generator().manual_seed(seed)
    tot_l, tot_acc, tot_ce, tot_chain, tot_r16, n = 0.0, 0, 0, 0, 0, 0
    with torch.no_grad():
        for i in range(0, len(idx), 32):
            b = idx[i:i + 32]
            feats, blk_ids, anchors, labels, teach = sample_batch(data, b, A, bs, g)
            y = draft_hidden(cfg, w, data["embed"], feats, blk_ids, anchors)[:, :, 1:]
            lg = y @ data["lm_head"].T
            ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels.reshape(-1), reduction="none").view(labels.shape)
            acc = (lg.argmax(-1) == labels).float()
            rank = (lg[:, :, 0] > lg[:, :, 0].gather(-1, labels[:, :, :1])).sum(-1)
            tot_l += float((ce * wk).sum(-1).mean() / wk.sum()) * len(b)
            tot_ce = tot_ce + ce.mean((0, 1)) * len(b)
            tot_acc = tot_acc + acc.mean((0, 1)) * len(b)
            tot_chain += float((1 + acc.cumprod(-1).sum(-1)).mean()) * len(b)
            tot_r16 += float((rank < 16).float().mean()) * len(b)
            n += len(b)
    return tot_l / n, tot_ce / n, tot_acc / n, tot_chain / n, tot_r16 / n


def train(a, data, cfg):
    torch.manual_seed(a.seed)
    bs = cfg["block_size"]
    w = {k: v.to(a.device).requires_grad_(True) for k, v in init_weights(cfg, a.seed).items()}
    decay = [v for k, v in w.items() if v.dim() == 2]
    no_decay = [v for k, v in w.items() if v.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.98))
    wk = torch.exp(-torch.arange(bs - 1, dtype=torch.float32) / a.gamma).to(a.device)
    N = data["tokens"].shape[0]
    g = torch.Generator().manual_seed(a.seed)
    perm = torch.randperm(N, generator=g)
    n_val = a.val
    val_idx = perm[:n_val][torch.randperm(n_val, generator=g)]
    val_idx = val_idx[val_idx < data["n_greedy"]]                    # validate on greedy continuations
    tr_idx = perm[n_val:]
    print(f"train {len(tr_idx)} sequences, validation {len(val_idx)} greedy sequences; "
          f"{sum(v.numel() for v in w.values())} trainable parameters", flush=True)
    t0 = time.time()
    hist = []
    run = None
    for step in range(1, a.steps + 1):
        # cosine to 5% over the run; the run ends at --steps or --max-minutes, whichever comes first, and the
        # schedule follows whichever is further along
        prog = min(1.0, max(step / a.steps, (time.time() - t0) / (60 * a.max_minutes) if a.max_minutes else 0.0))
        lr = a.lr * min(1.0, step / a.warmup) * (0.5 * (1 + math.cos(math.pi * prog)) * 0.95 + 0.05)
        for gr in opt.param_groups:
            gr["lr"] = lr
        b = tr_idx[torch.randint(0, len(tr_idx), (a.batch,), generator=g)]
        loss, _, _ = loss_fn(cfg, w, data, *sample_batch(data, b, a.anchors, bs, g), wk, a.kl)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(w.values()), 1.0)
        opt.step()
        lv = loss.item()
        run = lv if run is None else 0.98 * run + 0.02 * lv
        last = step == a.steps or prog >= 1.0
        if step % a.log_every == 0 or last:
            vl, vce, vacc, vchain, vr16 = evaluate(cfg, w, data, val_idx, 16, bs, wk)
            hist.append({"step": step, "train_loss_ema": run, "val_loss": vl, "val_ce": vce.tolist(),
                         "val_acc": vacc.tolist(), "val_recall16_d1": vr16, "val_chain": vchain,
                         "time_s": time.time() - t0})
            print(f"step {step:5d}  lr {lr:.2e}  train {run:.3f}  val {vl:.3f}  ce/depth "
                  f"{' '.join(f'{x:.2f}' for x in vce.tolist())}  acc/depth "
                  f"{' '.join(f'{x:.3f}' for x in vacc.tolist())}  r@16 {vr16:.3f}  chain {vchain:.3f}  "
                  f"({time.time() - t0:.0f} s)", flush=True)
        if last:
            if step < a.steps:
                print(f"stopping at step {step}: --max-minutes {a.max_minutes} reached", flush=True)
            break
    return {k: v.detach().cpu() for k, v in w.items()}, hist, val_idx


def check_against_reference(cfg, w64, data, n_cases=4):
    """The batched training forward (float64, bf16-rounded weights) against dflash_ref.draft_logprobs."""
    bs = cfg["block_size"]
    embed, lm_head = data["embed"].cpu().double(), data["lm_head"].cpu().double()
    g = torch.Generator().manual_seed(7)
    worst = 0.0
    for i in range(n_cases):
        j = int(torch.randint(0, data["tokens"].shape[0], (1,), generator=g))
        feats, blk_ids, anchors, _, _ = sample_batch(data, torch.tensor([j]), 2, bs, g)
        feats, blk_ids, anchors = feats.cpu().double(), blk_ids.cpu(), anchors.cpu()
        y = draft_hidden(cfg, w64, embed, feats, blk_ids, anchors)
        lp = torch.log_softmax(y[:, :, 1:] @ lm_head.T, dim=-1)
        for r in range(2):
            a_ = int(anchors[0, r])
            ref = dflash_ref.draft_logprobs(cfg, w64, embed, lm_head, feats[0, :a_], int(blk_ids[0, r, 0]))
            worst = max(worst, float((lp[0, r] - ref).abs().max()))
    print(f"training forward vs dflash_ref (float64, stored weights): max |d log-prob| = {worst:.2e}")
    assert worst < 1e-9, worst


# ---------------------------------------------------------------- tau with the engine
def measure_tau(a, prompts, n=64):
    lib = os.environ.get("KDTREE_LIB")
    if not lib:
        raise SystemExit("set KDTREE_LIB for --eval")
    runs = [("ddtree", b) for b in (0, 4, 16, 64)] + [("dflash", None)]
    table = {}
    for pol, b in runs:
        taus, toks, rounds = [], 0, 0
        for p in prompts:
            cmd = ["luajit", os.path.join(ROOT, "scripts/kdtree"), "generate", "--model", a.target,
                   "--draft", a.out, "--policy", pol, "--prompt-ids", ",".join(map(str, p)), "-n", str(n),
                   "--stats"]
            if b is not None:
                cmd += ["--budget", str(b)]
            r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, KDTREE_LIB=lib))
            if r.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed: {r.stderr}")
            m = re.search(r"decode\s+(\d+) rounds.*mean tau ([\d.]+)", r.stdout)
            gen = re.search(r"^(\d+) tokens", r.stdout, re.M)
            taus.append(float(m.group(2)))
            rounds += int(m.group(1))
            toks += int(gen.group(1))
        key = f"{pol} B={b}" if b is not None else pol
        table[key] = {"mean_tau": sum(taus) / len(taus), "per_prompt": taus,
                      "tokens_per_round": (toks - len(prompts)) / max(rounds, 1)}
        print(f"  {key:12s} mean tau {table[key]['mean_tau']:.2f}  per prompt {' '.join(f'{t:.2f}' for t in taus)}",
              flush=True)
    return table


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=os.path.join(ROOT, "models/tiny-k2.6"))
    ap.add_argument("--out", default=os.path.join(ROOT, "models/tiny-k2.6-dflash"))
    ap.add_argument("--data", default="", help="cache file for the generated data (.pt): reused when present")
    ap.add_argument("--greedy", type=int, default=16000, help="greedy continuations")
    ap.add_argument("--sampled", type=int, default=4000, help="temperature-1 continuations")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--data-seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40000)
    ap.add_argument("--batch", type=int, default=64, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=32, help="anchors (blocks) per sequence")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--gamma", type=float, default=4.0, help="depth weight w_k = exp(-(k-1)/gamma)")
    ap.add_argument("--kl", type=float, default=1.0,
                    help="weight of the soft-label term KL(target || drafter) at each labelled position")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--val", type=int, default=400, help="held-out sequences (greedy ones validate)")
    ap.add_argument("--log-every", type=int, default=1000)
    ap.add_argument("--max-minutes", type=float, default=4.0,
                    help="wall-time limit of the training loop (0 = none); the LR schedule follows it")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="torch device for data features and training (default: cuda when available)")
    ap.add_argument("--gen", choices=["engine", "hf"], default=None,
                    help="who writes the continuations: the engine (LuaJIT, needs KDTREE_LIB) or HF float32 "
                         "(default: hf on cuda, engine on cpu)")
    ap.add_argument("--check", action="store_true",
                    help="no training: check the drafter in --out against dflash_ref on a few sequences, then --eval")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    ap.add_argument("--eval", action="store_true", help="measure tau with the engine after writing")
    ap.add_argument("--eval-only", action="store_true", help="only measure tau of the drafter in --out")
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--eval-seed", type=int, default=99)
    ap.add_argument("--log", default="", help="write the loss history and tau table as JSON here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    a.target, a.out = os.path.abspath(a.target), os.path.abspath(a.out)
    if a.gen is None:
        a.gen = "engine" if a.device == "cpu" else "hf"

    eval_prompts = make_prompts(a.eval_prompts, a.eval_seed, lo=8, hi=24)
    if a.eval_only:
        measure_tau(a, eval_prompts)
        return

    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False      # float32 data and training, as on the CPU
        torch.backends.cudnn.allow_tf32 = False
    with open(os.path.join(a.target, "config.json")) as f:
        full = json.load(f)
    cfg = mtd.drafter_config(full.get("text_config", full))
    global MASK_ID
    MASK_ID = cfg["dflash_config"]["mask_token_id"]
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 2]

    if a.check:
        # a few fresh sequences (engine continuations), their HF features, and the stored drafter vs dflash_ref
        a.greedy, a.sampled = 6, 2
        data = make_data(a)
        w = dflash_ref.load_weights(a.out)
        check_against_reference(dflash_ref.load_config(a.out), w, data)
        if a.eval:
            measure_tau(a, eval_prompts)
        return

    if a.data and os.path.exists(a.data):
        data = torch.load(a.data)
        print(f"loaded {a.data}: {tuple(data['tokens'].shape)} tokens")
        if "final" not in data:
            add_features(a, data)
            torch.save(data, a.data)
        for k in ("feats", "final", "embed", "lm_head"):
            data[k] = data[k].to(a.device)
    else:
        data = make_data(a)
        if a.data:
            torch.save(data, a.data)
    train_set = {tuple(p) for p in data["prompts"]}
    assert not any(tuple(p) in train_set for p in eval_prompts), "an eval prompt is in the training set"

    t0 = time.time()
    w, hist, _ = train(a, data, cfg)
    print(f"training: {time.time() - t0:.0f} s", flush=True)

    stored = {k: v.to(torch.bfloat16).contiguous() for k, v in w.items()}
    check_against_reference(cfg, {k: v.double() for k, v in stored.items()}, data)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    save_file(stored, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    print(f"wrote {a.out}/model.safetensors (bf16)")
    result = {"args": vars(a), "history": hist}
    if a.eval:
        print(f"tau on {len(eval_prompts)} prompts not in the training set (seed {a.eval_seed}), -n 64, greedy:")
        result["tau"] = measure_tau(a, eval_prompts)
    if a.log:
        with open(a.log, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
