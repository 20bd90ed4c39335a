"""sample_rule_ref.py: the keyed sampling rule (core/sample.c's header, docs/ddtree.md "Sampling"),
written once from the documented rule in plain Python, shared by the two fixture generators
(sample_ref.py -> spec/fixtures/sample_golden.json, min_p_ref.py -> spec/fixtures/sample-cases.json).
Exact big integers where the C code emulates 128-bit arithmetic, exact rationals for the fused
multiply-adds of the documented exp. No dependencies beyond the standard library.

For logits x[0..V) (float32), a sampler {T, top_k, top_p, min_p, seed} (T, top_p, min_p float32)
and the absolute position P of the token drawn:
  1. m = max x; q_i = trunc(exp_rule(x_i / T - m / T) * 2^62) in double (x / 1 = x: no division
     at T = 1); exp_rule: Cody-Waite reduction by ln2 in two parts and a degree-13 Taylor
     polynomial by Horner with fused multiply-adds (the rule's constants), 0 below a = -708.
  2. order: logit descending, equal logits lower id first; top-k keeps the first top_k.
  3. min-p: Q = ceil(min_p * 2^62); a mass below Q becomes 0 (after top-k, before top-p; the
     two commute).
  4. top-p: S = the kept mass, G = max(1, ceil(S * trunc(top_p * 2^32) / 2^32)); keep the
     shortest prefix of the order (within top-k) whose mass reaches G.
  5. U = the top 53 bits of mix(mix(seed) + P * 0xD1B54A32D192ED03) (mix = SplitMix64's
     finalizer with its increment); target = floor(U * W / 2^53) for the kept mass W; the token
     is the first kept id (ascending) whose inclusive prefix mass exceeds target.
"""
import math
import random
import struct
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
    return (mix64((mix64(seed) + (position & M64) * 0xD1B54A32D192ED03) & M64)) >> 11


def fma(a, b, c):
    """a * b + c rounded once (exact rationals; int / int division rounds correctly)"""
    r = Fraction(a) * Fraction(b) + Fraction(c)
    return r.numerator / r.denominator


# the documented exp on (-inf, 0] (sample_rule.h kd_rule_exp_parts and kd_rule_mass: reduction by
# ln2 in two parts, degree-13 Taylor polynomial by Horner with fused multiply-adds, scaled by 2^k)
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


def check_exp():
    """the documented exp agrees with libm's to a few ulps (a sanity check of the transcription)"""
    rnd = random.Random(5)
    for _ in range(20000):
        a = -rnd.random() * 50
        e, ref = exp_rule(a), math.exp(a)
        assert abs(e - ref) <= 4 * math.ulp(ref), (a, e, ref)


def masses(x, T):
    """q_i = trunc(exp_rule(x_i / T - m / T) * 2^62); -inf tokens have mass 0"""
    m = max(x)
    assert m != -math.inf
    z = m / T
    return [int(exp_rule(v / T - z) * 2.0 ** 62) if v != -math.inf else 0 for v in x]


def sample(x, T, top_k, top_p, seed, position, min_p=0.0):
    """x: float32 logits (finite or -inf, not all -inf); T, top_p, min_p: float32 values.
    Returns the token id."""
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
