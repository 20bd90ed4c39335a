#!/usr/bin/env python3
"""sample_ref.py: writes spec/fixtures/sample_golden.json from the independent reference of kdtree's
keyed sampling rule in sample_rule_ref.py (plain Python from the documented rule: exact big
integers, exact rationals for the documented exp's fused multiply-adds), which
spec/sample_golden_spec.lua checks on the CPU (kd_sample_logits and the sample_rows op) and on
CUDA (#gpu, the same op through the same Lua API).

Cases: (1) u53 known answers through the public API: 2^20 equal logits, so the drawn id is the
top 20 bits of U; (2) rows of random logits under many settings and seeds; (3) boundaries with
exact masses (equal logits: mass 2^62 each): top-p goals that land exactly on a prefix's mass
(reached counts as kept), top_p one float32 step above it, top-k cuts inside a run of equal
logits (the lower ids are kept), -inf tokens.

  python3 scripts/golden/sample_ref.py            # writes spec/fixtures/sample_golden.json
  python3 scripts/golden/sample_ref.py --check    # compares with the committed file
No dependencies beyond the standard library.
"""
import json
import math
import random
import struct
import sys

from sample_rule_ref import check_exp, f32, sample, u53


def seed_fields(seed):
    return {"seed_hi": seed >> 32, "seed_lo": seed & 0xFFFFFFFF}


def cases():
    rnd = random.Random(20261203)
    out = {"u53": [], "rows": [], "boundaries": []}
    # (1) u53: 2^20 equal logits, no truncation: id = U >> 33 (the top 20 of its 53 bits)
    for seed, pos in [(0, 0), (1, 1), (7, 17), (31337, 4096), (0xFFFFFFFFFFFFFFFF, 262143),
                      (0x0123456789ABCDEF, 5), (2 ** 63, 123456), (42, 2 ** 31 - 1)]:
        out["u53"].append(dict(seed_fields(seed), position=pos, u53=[u53(seed, pos) >> 32, u53(seed, pos) & 0xFFFFFFFF],
                               token=u53(seed, pos) >> 33))
    # (2) random rows
    settings = [(1.0, 0, 1.0), (0.7, 0, 1.0), (2.5, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9), (0.8, 40, 0.95),
                (1.3, 3, 0.5), (0.05, 0, 1.0), (1.0, 0, 0.1), (0.9, 1, 1.0)]
    for r in range(24):
        V = rnd.choice([7, 50, 300, 1024])
        scale = rnd.choice([0.5, 2.0, 6.0])
        x = [f32(rnd.gauss(0, scale)) for _ in range(V)]
        if r % 4 == 0:                        # equal logits in the row, and a masked token
            for i in rnd.sample(range(V), min(V, 5)):
                x[i] = x[0]
            x[rnd.randrange(V)] = -math.inf
        T, k, p = settings[r % len(settings)]
        T, p = f32(T), f32(p)
        draws = []
        for _ in range(12):
            seed = rnd.getrandbits(64)
            pos = rnd.randrange(0, 1 << 20)
            draws.append(dict(seed_fields(seed), position=pos, token=sample(x, T, k, p, seed, pos)))
        out["rows"].append({"logits": x, "temperature": T, "top_k": k, "top_p": p, "draws": draws})
    # (3) boundaries with exact masses: n equal logits (2^62 each), the rest far below
    def equal_row(n, V, low=-1000.0):
        return [0.0] * n + [low] * (V - n)   # exp(-1000) is 0 in the rule: mass 0

    def add(name, x, T, k, p, seeds=48):
        draws = []
        for s in range(seeds):
            seed, pos = 1000 + s, 10 + 3 * s
            draws.append(dict(seed_fields(seed), position=pos, token=sample(x, f32(T), k, f32(p), seed, pos)))
        out["boundaries"].append({"name": name, "logits": x, "temperature": f32(T), "top_k": k, "top_p": f32(p),
                                  "draws": draws, "drawn": sorted({d["token"] for d in draws})})

    add("top-p 0.5 of 4 equal: the goal is exactly 2 tokens' mass, reached -> 2 kept", equal_row(4, 8), 1.0, 0, 0.5)
    add("top-p 0.75 of 4 equal: exactly 3 tokens' mass -> 3 kept", equal_row(4, 8), 1.0, 0, 0.75)
    add("top-p 0.25 of 4 equal: exactly 1 token's mass -> 1 kept", equal_row(4, 8), 1.0, 0, 0.25)
    add("top-p one float32 step above 0.5 of 4 equal -> 3 kept", equal_row(4, 8), 1.0, 0,
        struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", 0.5))[0] + 1))[0])
    add("top-p one float32 step below 0.5 of 4 equal -> 2 kept", equal_row(4, 8), 1.0, 0,
        struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", 0.5))[0] - 1))[0])
    add("top-p 0.2 (float32 0.2000000030) of 5 equal: the goal just above 1 token's mass -> 2 kept", equal_row(5, 9),
        1.0, 0, 0.2)
    tie = [1.0, 3.0, 3.0, 3.0, 0.0, 3.0, -math.inf, 3.0]
    add("top-k 2 inside a run of equal logits: the lower ids 1, 2 are kept", tie, 1.0, 2, 1.0)
    add("top-k 4 inside a run of equal logits: ids 1, 2, 3, 5", tie, 1.0, 4, 1.0)
    add("top-k 1 on ties: id 1 always", tie, 0.5, 1, 1.0)
    add("top-k 3 then top-p 0.5 of the 3 kept equal: 2 of them", tie, 1.0, 3, 0.5)
    add("a -inf token is never drawn; 8 tokens, 7 equal", [2.0] * 3 + [-math.inf] + [2.0] * 4, 1.0, 0, 1.0)
    return out


def render(data):
    return json.dumps(data, indent=1, sort_keys=True, allow_nan=True).replace("-Infinity", "\"-inf\"") + "\n"


def main():
    check_exp()
    path = "spec/fixtures/sample_golden.json"
    text = render(cases())
    if "--check" in sys.argv:
        with open(path) as f:
            same = f.read() == text
        print("sample_golden.json", "matches" if same else "DIFFERS from the reference")
        sys.exit(0 if same else 1)
    with open(path, "w") as f:
        f.write(text)
    print("wrote", path)


if __name__ == "__main__":
    main()
