"""Tiny random DeepSeek-V3-architecture checkpoints in the two real on-disk layouts.

  tiny-k2.6 : the Kimi K2.5/K2.6 layout (kimi_k25 wrapper, `language_model.` prefix, INT4 pack-quantized routed
              experts, vision_tower/mm_projector tensors to skip, 2 shards + index).
  tiny-dsv3 : the plain DeepSeek-V3 layout (no prefix, bf16 experts, q_proj instead of q_lora, 2 shared experts,
              group-limited routing n_group 4 / topk_group 2, one model.safetensors).

Every weight is drawn in float64, rounded to its stored dtype (bf16, INT4 codes * bf16 scale, f32 bias), written to
disk in that dtype, and the *same rounded values* are loaded into HF DeepseekV3ForCausalLM in float64.
"""
import json
import math
import os

import numpy as np
import torch
from safetensors.torch import save_file

from int4 import pack_int4

# ----------------------------------------------------------------------------------------------------------------
# configs (text backbone, as written to config.json)
# ----------------------------------------------------------------------------------------------------------------

K26_QUANT = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
            },
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
}

K26_TEXT = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
    "max_position_embeddings": 262144,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 1000,
    "eos_token_id": 1001,
    "pad_token_id": 1023,
    "initializer_range": 0.02,
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "ep_size": 1,
    "pretraining_tp": 1,
    "use_cache": True,
    "torch_dtype": "bfloat16",
    "quantization_config": K26_QUANT,
}

DSV3_TEXT = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 192,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 48,
    "qk_nope_head_dim": 24,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 2,
    "n_group": 4,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 4096,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": None,
    "initializer_range": 0.02,
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "ep_size": 1,
    "pretraining_tp": 1,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}

MODELS = {
    "tiny-k2.6": {"text": K26_TEXT, "layout": "k2.6", "eos": [1001, 1002], "bos": 1000, "pad": 1023},
    "tiny-dsv3": {"text": DSV3_TEXT, "layout": "dsv3", "eos": 1, "bos": 0, "pad": None},
}


# ----------------------------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------------------------

def bf16(x):
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64)).to(torch.bfloat16)


class Weights:
    """Per-tensor values in their stored form, keyed by the *unprefixed* HF name (model.layers.0...)."""

    def __init__(self):
        self.stored = {}     # name -> torch tensor in stored dtype (bf16 / f32 / int32 / int64)
        self.exact = {}      # name -> float64 torch tensor of the exact dense value (for non-packed tensors)
        self.int4 = {}       # prefix (...experts.E.gate_proj) -> (q int8 numpy [out,in], scale bf16 tensor)

    def dense(self, name, value, dtype=torch.bfloat16):
        t = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float64)).to(dtype)
        self.stored[name] = t
        self.exact[name] = t.to(torch.float64)

    def quant(self, prefix, q, scale):
        out, k = q.shape
        s = bf16(scale)
        if not torch.all(s.float() > 0):
            raise ValueError(f"{prefix}: non-positive scale after bf16 rounding")
        self.stored[prefix + ".weight_packed"] = torch.from_numpy(pack_int4(q))
        self.stored[prefix + ".weight_scale"] = s
        self.stored[prefix + ".weight_shape"] = torch.tensor([out, k], dtype=torch.int64)
        self.int4[prefix] = (q.astype(np.int8), s)

    def dense_value(self, name_no_suffix):
        """float64 weight of a linear, whether stored dense or INT4."""
        if name_no_suffix + ".weight" in self.exact:
            return self.exact[name_no_suffix + ".weight"]
        q, s = self.int4[name_no_suffix]
        group = q.shape[1] // s.shape[1]
        return torch.from_numpy(q.astype(np.float64)) * s.to(torch.float64).repeat_interleave(group, dim=1)


LATENT_GAIN = 0.1


def make_weights(text, seed, int4_experts, group=32, lm_head_gain=2.0):
    rng = np.random.default_rng(seed)
    W = Weights()
    H = text["hidden_size"]
    V = text["vocab_size"]
    nh = text["num_attention_heads"]
    dn, dr, dv = text["qk_nope_head_dim"], text["qk_rope_head_dim"], text["v_head_dim"]
    rkv = text["kv_lora_rank"]
    rq = text["q_lora_rank"]
    E = text["n_routed_experts"]
    mI = text["moe_intermediate_size"]
    ns = text["n_shared_experts"]

    def lin(name, out, inp, gain=1.0):
        W.dense(name + ".weight", rng.standard_normal((out, inp)) * gain / math.sqrt(inp))

    def norm(name, n):
        W.dense(name + ".weight", 1.0 + 0.1 * rng.standard_normal(n))

    def qlin(name, out, inp):
        if inp % group:
            raise ValueError(f"{name}: in={inp} not a multiple of group {group}")
        q = rng.integers(-7, 8, size=(out, inp))          # QAT codes use [-7, 7]
        code_std = math.sqrt((15 * 15 - 1) / 12.0)         # std of the uniform ints -7..7
        scale = np.exp(0.3 * rng.standard_normal((out, inp // group))) / (code_std * math.sqrt(inp))
        W.quant(name, q, scale)

    W.dense("model.embed_tokens.weight", rng.standard_normal((V, H)))
    for l in range(text["num_hidden_layers"]):
        p = f"model.layers.{l}."
        norm(p + "input_layernorm", H)
        norm(p + "post_attention_layernorm", H)
        a = p + "self_attn."
        # The q_a / c_kv latents are drawn small (rms ~ LATENT_GAIN) so that the eps of q_a_layernorm and
        # kv_a_layernorm matters: HF uses 1e-6 there, not rms_norm_eps (1e-5 for K2.6), and an engine that uses
        # rms_norm_eps moves the logits by ~1e-2 instead of ~1e-4. The norms rescale the latents, so the rest of
        # the model is unaffected. k_pe rows (not normalized) keep the ordinary scale.
        if rq is None:
            lin(a + "q_proj", nh * (dn + dr), H)
        else:
            lin(a + "q_a_proj", rq, H, gain=LATENT_GAIN)
            norm(a + "q_a_layernorm", rq)
            lin(a + "q_b_proj", nh * (dn + dr), rq)
        kva = rng.standard_normal((rkv + dr, H)) / math.sqrt(H)
        kva[:rkv] *= LATENT_GAIN
        W.dense(a + "kv_a_proj_with_mqa.weight", kva)
        norm(a + "kv_a_layernorm", rkv)
        lin(a + "kv_b_proj", nh * (dn + dv), rkv)
        lin(a + "o_proj", H, nh * dv)
        m = p + "mlp."
        if l < text["first_k_dense_replace"]:
            I = text["intermediate_size"]
            lin(m + "gate_proj", I, H)
            lin(m + "up_proj", I, H)
            lin(m + "down_proj", H, I)
            continue
        # router: bf16 weight, f32 bias (bias only affects selection; big enough to change it sometimes)
        lin(m + "gate", E, H, gain=1.5)
        W.dense(m + "gate.e_score_correction_bias", 0.1 * rng.standard_normal(E), dtype=torch.float32)
        for e in range(E):
            x = f"{m}experts.{e}."
            if int4_experts:
                qlin(x + "gate_proj", mI, H)
                qlin(x + "up_proj", mI, H)
                qlin(x + "down_proj", H, mI)
            else:
                lin(x + "gate_proj", mI, H)
                lin(x + "up_proj", mI, H)
                lin(x + "down_proj", H, mI)
        lin(m + "shared_experts.gate_proj", mI * ns, H)
        lin(m + "shared_experts.up_proj", mI * ns, H)
        lin(m + "shared_experts.down_proj", H, mI * ns)
    norm("model.norm", H)
    lin("lm_head", V, H, gain=lm_head_gain)
    return W


# ----------------------------------------------------------------------------------------------------------------
# HF model
# ----------------------------------------------------------------------------------------------------------------

def hf_config(text):
    from transformers import DeepseekV3Config
    cfg = DeepseekV3Config(**{k: v for k, v in text.items() if k not in ("architectures", "model_type",
                                                                          "quantization_config", "torch_dtype")})
    cfg._attn_implementation = "sdpa"       # float64 softmax (eager would round the softmax to float32)
    cfg._experts_implementation = "eager"   # the plain per-expert loop
    return cfg


def hf_model(text, W):
    """DeepseekV3ForCausalLM in float64 holding exactly the stored (rounded) weights."""
    from transformers import DeepseekV3ForCausalLM
    cfg = hf_config(text)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).to(torch.float64).eval()
    sd = {}
    for name, t in W.exact.items():
        sd[name] = t
    E = text["n_routed_experts"]
    for l in range(text["first_k_dense_replace"], text["num_hidden_layers"]):
        m = f"model.layers.{l}.mlp."
        # transformers 5.x fused experts: gate_up_proj [E, 2*I, H] = cat(gate, up) along dim 1 (chunk(2) -> gate, up);
        # down_proj [E, H, I]
        gate = [W.dense_value(f"{m}experts.{e}.gate_proj") for e in range(E)]
        up = [W.dense_value(f"{m}experts.{e}.up_proj") for e in range(E)]
        down = [W.dense_value(f"{m}experts.{e}.down_proj") for e in range(E)]
        sd[m + "experts.gate_up_proj"] = torch.stack([torch.cat([g, u], dim=0) for g, u in zip(gate, up)])
        sd[m + "experts.down_proj"] = torch.stack(down)
        for e in range(E):
            for k in ("gate_proj", "up_proj", "down_proj"):
                sd.pop(f"{m}experts.{e}.{k}.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # inv_freq / original_inv_freq are computed buffers, not weights
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing} unexpected {unexpected}")
    return model


# ----------------------------------------------------------------------------------------------------------------
# on-disk layouts
# ----------------------------------------------------------------------------------------------------------------

def _natural_key(name):
    return [int(t) if t.isdigit() else t for t in name.replace(".", " . ").split()]


def _nbytes(t):
    return t.numel() * t.element_size()


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def vision_dummies(rng):
    """A few small tensors of the other towers, as in a real K2.5/K2.6 checkpoint; the loader must skip them."""
    d = {}
    d["vision_tower.patch_embed.proj.weight"] = bf16(rng.standard_normal((32, 3, 4, 4)) * 0.1)
    d["vision_tower.patch_embed.proj.bias"] = bf16(rng.standard_normal(32) * 0.1)
    d["vision_tower.encoder.blocks.0.wqkv.weight"] = bf16(rng.standard_normal((96, 32)) * 0.1)
    d["vision_tower.encoder.blocks.0.norm0.weight"] = torch.ones(32, dtype=torch.float32)
    d["mm_projector.pre_norm.weight"] = bf16(np.ones(32))
    d["mm_projector.proj.0.weight"] = bf16(rng.standard_normal((32, 32)) * 0.05)
    d["mm_projector.proj.2.weight"] = bf16(rng.standard_normal((128, 32)) * 0.05)
    return d


K26_VISION_CONFIG = {
    "model_type": "kimi_k25_vision",
    "patch_size": 4,
    "init_pos_emb_height": 8,
    "init_pos_emb_width": 8,
    "init_pos_emb_time": 2,
    "pos_emb_type": "divided_fixed",
    "vt_num_attention_heads": 2,
    "vt_num_hidden_layers": 1,
    "vt_hidden_size": 32,
    "vt_intermediate_size": 64,
    "merge_kernel_size": [2, 2],
    "video_attn_type": "spatial_temporal",
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmerger",
    "mm_hidden_size": 32,
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
    "text_hidden_size": 128,
}


def write_k26(outdir, W, text, meta, seed):
    os.makedirs(outdir, exist_ok=True)
    for f in os.listdir(outdir):
        if f.endswith(".safetensors") or f.endswith(".json"):
            os.remove(os.path.join(outdir, f))
    tensors = {"language_model." + k: v for k, v in W.stored.items()}
    vis = vision_dummies(np.random.default_rng(seed + 7))
    names = sorted(tensors, key=_natural_key)
    total = sum(_nbytes(t) for t in tensors.values())
    # shard 1: vision tower + the first half of the language model (by bytes; a layer may straddle the cut,
    # as in real checkpoints); shard 2: the rest + the projector
    shard1, shard2, acc = {}, {}, 0
    for n in names:
        (shard1 if acc < total / 2 else shard2)[n] = tensors[n]
        acc += _nbytes(tensors[n])
    for n, t in vis.items():
        (shard1 if n.startswith("vision_tower") else shard2)[n] = t
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    for fname, shard in zip(files, (shard1, shard2)):
        save_file({k: v.contiguous() for k, v in shard.items()}, os.path.join(outdir, fname),
                  metadata={"format": "pt"})
        os.chmod(os.path.join(outdir, fname), 0o644)
        for k in shard:
            weight_map[k] = fname
    total_size = sum(_nbytes(t) for t in list(shard1.values()) + list(shard2.values()))
    write_json(os.path.join(outdir, "model.safetensors.index.json"),
               {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))})
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "bos_token_id": meta["bos"],
        "eos_token_id": meta["eos"][0],
        "pad_token_id": meta["pad"],
        "media_placeholder_token_id": 1019,
        "ignore_index": -100,
        "tie_word_embeddings": False,
        "use_unified_vision_chunk": True,
        "text_config": text,
        "vision_config": K26_VISION_CONFIG,
    }
    write_json(os.path.join(outdir, "config.json"), config)
    write_json(os.path.join(outdir, "generation_config.json"),
               {"bos_token_id": meta["bos"], "eos_token_id": meta["eos"], "pad_token_id": meta["pad"],
                "max_length": text["max_position_embeddings"]})


def write_dsv3(outdir, W, text, meta):
    os.makedirs(outdir, exist_ok=True)
    for f in os.listdir(outdir):
        if f.endswith(".safetensors") or f.endswith(".json"):
            os.remove(os.path.join(outdir, f))
    tensors = {k: W.stored[k].contiguous() for k in sorted(W.stored, key=_natural_key)}
    save_file(tensors, os.path.join(outdir, "model.safetensors"), metadata={"format": "pt"})
    os.chmod(os.path.join(outdir, "model.safetensors"), 0o644)
    write_json(os.path.join(outdir, "config.json"), text)
    write_json(os.path.join(outdir, "generation_config.json"),
               {"bos_token_id": meta["bos"], "eos_token_id": meta["eos"]})
