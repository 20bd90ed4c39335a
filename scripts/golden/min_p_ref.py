#!/usr/bin/env python3
"""min_p_ref.py: the generator of the fixture spec/sample_spec.lua compares kd_sample_logits
against, from the independent Python reference of the keyed sampling rule (docs/ddtree.md,
"Sampling"), min-p included, in sample_rule_ref.py.

    python3 scripts/golden/min_p_ref.py [--out spec/fixtures]

writes spec/fixtures/sample-cases.json: the rows of float32 logits (null for -inf) and per
case its row, the sampler (float32 temperature / top_p / min_p as the C struct holds them,
top_k, seed), the position and the expected token.
"""
import argparse
import json
import math
import os

from sample_rule_ref import M64, f32, sample


class Lcg:
    def __init__(self, s):
        self.s = s

    def __call__(self):
        self.s = (self.s * 6364136223846793005 + 1442695040888963407) & M64
        return (self.s >> 11) / float(1 << 53)


def cases():
    r = Lcg(2026)
    rows = []
    # smooth rows, quantized rows (ties at every boundary), rows with -inf, one dominant token
    for V in (7, 40, 300):
        rows.append([f32((r() - 0.5) * 8) for _ in range(V)])
        rows.append([f32(math.floor(r() * 6) * 0.5) for _ in range(V)])
        rows.append([-math.inf if r() < 0.3 else f32(r() * 3) for _ in range(V)])
        rows.append([f32(r() * 2 + (9 if i == V // 3 else 0)) for i in range(V)])
    out = []
    for ri, x in enumerate(rows):
        V = len(x)
        for T in (1.0, 0.7, 2.5):
            for k in (0, 1, 5, V - 1):
                for p in (0.0, 0.5, 0.95):
                    for mp in (0.0, 0.02, 0.3, 1.0):
                        seed = int(r() * 2 ** 40)
                        pos = int(r() * 100000)
                        t32, p32, mp32 = f32(T), f32(p), f32(mp)
                        out.append({"row": ri, "temperature": t32, "top_k": k, "top_p": p32, "min_p": mp32,
                                    "seed": seed, "position": pos, "token": sample(x, t32, k, p32, seed, pos, mp32)})
    return rows, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="spec/fixtures")
    a = ap.parse_args()
    rows, cs = cases()
    rows = [[None if v == -math.inf else v for v in x] for x in rows]   # JSON has no -inf: null stands for it
    path = os.path.join(a.out, "sample-cases.json")
    with open(path, "w") as f:
        json.dump({"generator": "scripts/golden/min_p_ref.py", "rows": rows, "cases": cs}, f, separators=(",", ":"))
    print("wrote %d cases to %s" % (len(cs), path))


if __name__ == "__main__":
    main()
