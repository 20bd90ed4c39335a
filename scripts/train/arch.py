"""The recipe's sizes: the shipped mini-code pair (chosen to fit 16 MB on disk together), a larger pair for the GPU
(--size large: not shipped, about 18x the target's parameters, to see DDTree where the weights weigh more), and the
toy one of --smoke; their config dicts, model directories and stored sizes."""
import os
import copy

from common import MASK_OFFSET, N_SPECIAL_SLOTS, SPECIAL_OFFSETS
import make_tiny_drafter as mtd
import tinymodels as tm

SIZE_LIMIT = 16_000_000          # bytes on disk, target + drafter (issue 16), for the shipped size

TARGET = {"hidden": 256, "layers": 6, "heads": 4, "q_lora": 128, "kv_lora": 64, "nope": 32, "rope": 16, "v_dim": 32,
          "dense_inter": 768, "moe_inter": 128, "experts": 16, "topk": 4}
DRAFTER = {"block_size": 16, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 64, "inter": 512, "taps": [1, 3, 4]}
SMOKE_TARGET = {"hidden": 64, "layers": 4, "heads": 2, "q_lora": 32, "kv_lora": 32, "nope": 16, "rope": 8,
                "v_dim": 16, "dense_inter": 128, "moe_inter": 32, "experts": 8, "topk": 2}
SMOKE_DRAFTER = {"block_size": 8, "layers": 1, "heads": 2, "kv_heads": 1, "head_dim": 32, "inter": 128, "taps": [1, 2]}
LARGE_TARGET = {"hidden": 1024, "layers": 8, "heads": 8, "q_lora": 384, "kv_lora": 256, "nope": 64, "rope": 32,
                "v_dim": 64, "dense_inter": 2816, "moe_inter": 512, "experts": 16, "topk": 4}
LARGE_DRAFTER = {"block_size": 16, "layers": 2, "heads": 8, "kv_heads": 4, "head_dim": 128, "inter": 2816,
                 "taps": [1, 3, 5, 6]}
SIZES = {"mini": (TARGET, DRAFTER), "smoke": (SMOKE_TARGET, SMOKE_DRAFTER), "large": (LARGE_TARGET, LARGE_DRAFTER)}
TARGET_LR = {"mini": 3e-3, "smoke": 3e-3, "large": 1e-3}   # the large one's: a guess for its width, not tuned


def model_dirs(outdir, size):
    """(target dir, drafter dir) under OUTDIR/models: mini-code(-dflash), or large-code(-dflash) for the large size"""
    name = "large-code" if size == "large" else "mini-code"
    return os.path.join(outdir, "models", name), os.path.join(outdir, "models", name + "-dflash")


def size_limit(size):
    """the bytes the pair may take on disk, or None (the large pair is not shipped)"""
    return None if size == "large" else SIZE_LIMIT


def text_config(n_base, size="mini"):
    """K2.6's text config (tinymodels.K26_TEXT: YaRN, noaux_tc, n_group 1, one shared expert, first layer dense)
    at this recipe's dimensions and token ids"""
    d = SIZES[size][0]
    t = copy.deepcopy(tm.K26_TEXT)
    t.update(vocab_size=n_base + N_SPECIAL_SLOTS, hidden_size=d["hidden"], intermediate_size=d["dense_inter"],
             moe_intermediate_size=d["moe_inter"], num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
             num_key_value_heads=d["heads"], q_lora_rank=d["q_lora"], kv_lora_rank=d["kv_lora"],
             qk_nope_head_dim=d["nope"], qk_rope_head_dim=d["rope"], v_head_dim=d["v_dim"],
             n_routed_experts=d["experts"], num_experts_per_tok=d["topk"],
             bos_token_id=n_base + SPECIAL_OFFSETS["[BOS]"], eos_token_id=n_base + SPECIAL_OFFSETS["[EOS]"],
             pad_token_id=n_base + SPECIAL_OFFSETS["[PAD]"])
    return t


def drafter_config(text, size="mini"):
    """DFlashDraftModel config (make_tiny_drafter.drafter_config's fields: qwen3 layers, YaRN like K2.6's drafter)
    with this recipe's block size, taps, widths and the mask token [UNK] (163838 in K2.6)"""
    d = SIZES[size][1]
    if max(d["taps"]) >= text["num_hidden_layers"] - 1:
        raise ValueError(f"taps {d['taps']}: the last layer's output is not a tap (HF's last hidden state is normed)")
    c = mtd.drafter_config(text)
    c.update(block_size=d["block_size"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
             num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"], head_dim=d["head_dim"],
             layer_types=["full_attention"] * d["layers"])
    c["dflash_config"] = {"mask_token_id": text["vocab_size"] - N_SPECIAL_SLOTS + MASK_OFFSET,
                          "target_layer_ids": list(d["taps"])}
    return c


def target_bytes(t, group=32):
    """bytes of the stored tensors: bf16 dense, f32 router bias, INT4 experts (packed int32 + bf16 scale + shape)"""
    H, V, L = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    nh, dn, dr, dv = t["num_attention_heads"], t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
    rq, rkv, E, mI = t["q_lora_rank"], t["kv_lora_rank"], t["n_routed_experts"], t["moe_intermediate_size"]
    attn = H * rq + rq + rq * nh * (dn + dr) + H * (rkv + dr) + rkv + rkv * nh * (dn + dv) + nh * dv * H + 2 * H
    nd = t["first_k_dense_replace"]
    per_expert = 3 * H * mI
    moe_bf16 = E * H + 3 * H * mI * t["n_shared_experts"]
    n = 2 * (2 * V * H + H + L * attn + nd * 3 * H * t["intermediate_size"] + (L - nd) * moe_bf16)
    return n + (L - nd) * (4 * E + E * (per_expert // 2 + per_expert // group * 2 + 3 * 16))


def drafter_bytes(c):
    """bytes of the drafter's bf16 tensors (embedding and lm_head are the target's)"""
    H, I, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    nt = len(c["dflash_config"]["target_layer_ids"])
    per = 2 * H * nh * hd + 2 * H * nkv * hd + 3 * H * I + 2 * H + 2 * hd
    return 2 * (nt * H * H + 2 * H + L * per)
