#!/usr/bin/env python3
"""sample_ref.py: an independent reference of kdtree's keyed sampling rule (core/sample.c's
header, docs/ddtree.md), written from the documented rule in plain Python: exact big
integers where the C code emulates 128-bit arithmetic, exact rationals for the fused
multiply-adds of the documented exp. It writes spec/fixtures/sample_golden.json, which
spec/sample_golden_spec.lua checks on the CPU (kd_sample_logits and the sample_rows op) and on
CUDA (#gpu, the same op through the same Lua API).

The rule, for logits x[0..V) (float32), a sampler {T, top_k, top_p, seed} (T, top_p float32)
and the absolute position P of the token drawn:
  q_i = trunc(exp_rule(x_i / T - m / T) * 2^62) in double, m = max x (-inf -> 0);
  order: logit descending, equal logits lower id first; top-k keeps the first top_k;
  top-p: S = kept mass, G = max(1, ceil(S * trunc(top_p * 2^32) / 2^32)), keep the shortest
  prefix of the order whose mass reaches G;
  U = the top 53 bits of mix(mix(seed) + P * 0xD1B54A32D192ED03) (mix = SplitMix64's
  finalizer with its increment), target = floor(U * W / 2^53) for the kept mass W; the token
  is the first kept id (ascending) whose inclusive prefix mass exceeds target.

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
from fractions import Fraction

M64 = (1 << 64) - 1


def f32(v):
    """round a Python float to the nearest float32 (as a Python float)"""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def mix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def u53(seed, position):
    return (mix64((mix64(seed) + (position * 0xD1B54A32D192ED03)) & M64)) >> 11


def fma(a, b, c):
    """a * b + c rounded once (exact rationals; int / int division rounds correctly)"""
    r = Fraction(a) * Fraction(b) + Fraction(c)
    return r.numerator / r.denominator


# the documented exp on (-inf, 0] (sample_rule.h kd_rule_exp: reduction by ln2 in two parts,
# degree-13 Taylor polynomial by Horner with fused multiply-adds, scaled by 2^k)
INV_LN2 = float.fromhex("0x1.71547652b82fep+0")
LN2_HI = float.fromhex("0x1.62e42fee00000p-1")
LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
TAYLOR = [float.fromhex(h) for h in (
    "0x1.6124613a86d09p-33", "0x1.1eed8eff8d898p-29", "0x1.ae64567f544e4p-26", "0x1.27e4fb7789f5cp-22",
    "0x1.71de3a556c734p-19", "0x1.a01a01a01a01ap-16", "0x1.a01a01a01a01ap-13", "0x1.6c16c16c16c17p-10",
    "0x1.1111111111111p-7", "0x1.5555555555555p-5", "0x1.5555555555555p-3")] + [0.5, 1.0, 1.0]


def exp_rule(a):
    if not (a >= -708.0):
        return 0.0
    k = round(a * INV_LN2)            # rint: ties to even, as Python's round
    r = fma(-k, LN2_HI, a)
    r = fma(-k, LN2_LO, r)
    p = TAYLOR[0]
    for c in TAYLOR[1:]:
        p = fma(p, r, c)
    return math.ldexp(p, int(k))


def sample(x, T, top_k, top_p, seed, position):
    """x: float32 logits; T, top_p: float32 values. Returns the token id."""
    V = len(x)
    m = max(x)
    assert m != -math.inf
    z = m / T
    q = [int(exp_rule(v / T - z) * 2.0 ** 62) if v != -math.inf else 0 for v in x]
    order = sorted(range(V), key=lambda i: (-x[i], i))
    kept = order[:top_k] if 0 < top_k < V else order
    if 0 < top_p < 1:
        S = sum(q[i] for i in kept)
        P = int(top_p * 2.0 ** 32)
        G = max(1, -((-S * P) >> 32))    # ceil(S * P / 2^32)
        cum = 0
        for j, i in enumerate(kept):
            cum += q[i]
            if cum >= G:
                kept = kept[:j + 1]
                break
    W = sum(q[i] for i in kept)
    target = (u53(seed, position) * W) >> 53
    cum = 0
    for i in sorted(kept):
        cum += q[i]
        if cum > target:
            return i
    raise AssertionError("target beyond the kept mass")


def check_exp():
    """the documented exp agrees with libm's to a few ulps (a sanity check of the transcription)"""
    rnd = random.Random(5)
    for _ in range(20000):
        a = -rnd.random() * 50
        e, ref = exp_rule(a), math.exp(a)
        assert abs(e - ref) <= 4 * math.ulp(ref), (a, e, ref)


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
