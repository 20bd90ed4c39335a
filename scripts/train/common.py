"""Shared pieces of the mini-code recipe: paths, the K2.6 special-token layout, timestamped logging, JSON output."""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
GOLDEN = os.path.join(ROOT, "scripts", "golden")
sys.path.insert(0, GOLDEN)

# K2.6's named special ids as offsets from the first special id (= the number of base ranks), and the number of
# special slots (scripts/golden/tokenizer_golden.py; ../shared/reference/kimi_k2.md section 4)
from tokenizer_golden import KIMI_PAT, N_SPECIAL_SLOTS, SPECIAL_OFFSETS, TRAIN_PAT, kimi_encode  # noqa: E402,F401

MASK_OFFSET = SPECIAL_OFFSETS["[UNK]"]     # K2.6's DFlash drafters use mask_token_id 163838 = [UNK]
_T0 = time.time()


def log(stage, msg):
    """one progress line: UTC wall clock, seconds since this process started, stage, message"""
    print(f"{time.strftime('%H:%M:%S', time.gmtime())} +{time.time() - _T0:6.1f}s [{stage}] {msg}", flush=True)


def special_ids(n_base):
    """name -> id for the named specials, and every reserved slot as <|reserved_token_ID|>"""
    named = {name: n_base + off for name, off in SPECIAL_OFFSETS.items()}
    allsp = dict(named)
    for i in range(n_base, n_base + N_SPECIAL_SLOTS):
        if i not in named.values():
            allsp[f"<|reserved_token_{i}|>"] = i
    return named, allsp


def torch_setup(seed, device):
    """the training stages' start: a fixed seed, and tf32 matmuls on CUDA"""
    import torch   # here, not at the top: the corpus and tokenizer stages run without torch
    torch.manual_seed(seed)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True


def write_json(path, obj, indent=1):
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent, ensure_ascii=False)
        f.write("\n")


def read_json(path):
    with open(path) as f:
        return json.load(f)


def update_report(outdir, key, value):
    """report.json in OUTDIR collects every stage's numbers under its own key"""
    path = os.path.join(outdir, "report.json")
    rep = read_json(path) if os.path.exists(path) else {}
    rep[key] = value
    write_json(path, rep)
