#!/usr/bin/env python3
"""min_p_ref.py: an independent Python reference of the keyed sampling rule (docs/ddtree.md,
"Sampling"), min-p included, and the generator of the fixture spec/sample_spec.lua compares
kd_sample_logits against.

    python3 scripts/golden/min_p_ref.py [--out spec/fixtures]

writes spec/fixtures/sample-cases.json: the rows of float32 logits (null for -inf) and per
case its row, the sampler (float32 temperature / top_p / min_p as the C struct holds them,
top_k, seed), the position and the expected token. Pure Python (integers are exact; fma is computed exactly with fractions and
rounded once, as C's fma does), written from the rule's text:
  1. m = max logit; a_i = x_i / T - m / T in double (x / 1 = x: no division at T = 1);
     w_i = exp(a_i) by Cody-Waite reduction and a degree-13 Taylor polynomial (the
     constants of the rule), 0 below a = -708; q_i = trunc(w_i * 2^62).
  2. order: logit descending, then id ascending; top-k keeps the first k.
  3. min-p: Q = ceil(min_p * 2^62); a mass below Q becomes 0 (after top-k, before top-p;
     the two commute).
  4. top-p: S = the kept mass, P = trunc(top_p * 2^32), G = max(1, ceil(S * P / 2^32));
     keep the shortest prefix of the order (within top-k) whose mass reaches G.
  5. U = the top 53 bits of mix(mix(seed) + pos * 0xD1B54A32D192ED03) (SplitMix64's
     finalizer with its increment); target = floor(U * W / 2^53), W the kept mass; the
     token is the first kept id (ascending) whose inclusive prefix mass exceeds target.
"""
import argparse
import json
import math
import os
import struct
from fractions import Fraction

M64 = (1 << 64) - 1


def f32(v):
    """the float32 nearest v, as a Python float"""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def fma(a, b, c):
    return float(Fraction(a) * Fraction(b) + Fraction(c))


def rule_exp(a):
    if not a >= -708.0:
        return 0.0
    k = float(round(a * float.fromhex("0x1.71547652b82fep+0")))   # round half to even, as rint
    r = fma(-k, float.fromhex("0x1.62e42fee00000p-1"), a)
    r = fma(-k, float.fromhex("0x1.a39ef35793c76p-33"), r)
    coef = ["0x1.6124613a86d09p-33", "0x1.1eed8eff8d898p-29", "0x1.ae64567f544e4p-26", "0x1.27e4fb7789f5cp-22",
            "0x1.71de3a556c734p-19", "0x1.a01a01a01a01ap-16", "0x1.a01a01a01a01ap-13", "0x1.6c16c16c16c17p-10",
            "0x1.1111111111111p-7", "0x1.5555555555555p-5", "0x1.5555555555555p-3"]
    p = float.fromhex(coef[0])
    for cst in coef[1:]:
        p = fma(p, r, float.fromhex(cst))
    p = fma(p, r, 0.5)
    p = fma(p, r, 1.0)
    p = fma(p, r, 1.0)
    return math.ldexp(p, int(k))


def scaled(x, T):
    return x if T == 1.0 else x / T


def masses(x, T):
    m = max(x)
    z = scaled(m, T)
    return [int(rule_exp(scaled(v, T) - z) * 2.0 ** 62) if v != -math.inf else 0 for v in x]


def mix64(v):
    v = (v + 0x9E3779B97F4A7C15) & M64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & M64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & M64
    return v ^ (v >> 31)


def u53(seed, pos):
    return mix64((mix64(seed) + (pos & M64) * 0xD1B54A32D192ED03) & M64) >> 11


def sample(x, T, top_k, top_p, min_p, seed, pos):
    """x: float32 logits (finite or -inf, not all -inf); T, top_p, min_p: float32 values"""
    V = len(x)
    q = masses(x, T)
    order = sorted(range(V), key=lambda i: (-x[i], i))
    kept = order[:top_k] if 0 < top_k < V else order
    if min_p > 0:
        Q = math.ceil(min_p * 2.0 ** 62)
        q = [v if v >= Q else 0 for v in q]
    if 0 < top_p < 1:
        S = sum(q[i] for i in kept)
        P = int(top_p * 2.0 ** 32)
        G = max(1, -((-S * P) >> 32))
        c = 0
        for j, i in enumerate(kept):
            c += q[i]
            if c >= G:
                kept = kept[:j + 1]
                break
    keep = set(kept)
    W = sum(q[i] for i in keep)
    target = (u53(seed, pos) * W) >> 53
    c = 0
    for i in range(V):
        if i in keep and q[i]:
            c += q[i]
            if target < c:
                return i
    raise AssertionError("no token drawn")


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
                                    "seed": seed, "position": pos, "token": sample(x, t32, k, p32, mp32, seed, pos)})
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
