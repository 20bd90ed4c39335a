#!/usr/bin/env python3
"""tree_ref.py: an independent Python reference of DDTree's tree builder (Algorithm 1),
written from ../shared/reference/ddtree_dflash.md section 1.2, and the generator of the
tree fixtures the specs compare the C builder against.

    python3 scripts/golden/tree_ref.py [--out spec/fixtures]

writes spec/fixtures/tree-logits.f32 (every case's [L, V] float32 input, concatenated)
and spec/fixtures/tree-cases.json (per case: L, V, budget, logprobs flag, the float
offset of its input in the .f32 file, and the expected tree: tokens, parents, depths
for nodes 1..n in pop order).

The rules, as the engine defines them (docs/ddtree.md):
  * log-probs per depth, fp32: logits mode lp = x - lse with lse = float32(m + log(sum
    exp(x - m))) (m = row max, the sum in float64 in id order); log-prob mode: x as is.
    -inf (probability 0) is clamped to -FLT_MAX so the float64 sums stay finite.
  * K = min(budget, V); the K best per depth ordered by (value desc, id asc): a stable
    sort of -lp, never torch.topk (which leaves the order of equal values undefined).
  * best-first with heapq exactly as the reference code: entries
    (-logw, ranks, parent, depth, rank, logw), so equal scores fall back to the rank
    tuple in ascending lexicographic order; scores updated incrementally in float64.
"""
import argparse
import heapq
import json
import math
import os

import numpy as np

FLT_MAX = float(np.finfo(np.float32).max)


def log_probs(row, is_logprobs):
    """one row of float32 scores -> float32 log-probs (the engine's rule)"""
    x = np.asarray(row, dtype=np.float32)
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError("scores must be finite or -inf")
    if is_logprobs:
        lp = x.copy()
    else:
        m = x.max()
        if np.isneginf(m):
            raise ValueError("a logits row with no finite value")
        s = np.cumsum(np.exp(x.astype(np.float64) - np.float64(m)))[-1]   # id order
        lse = np.float32(np.float64(m) + math.log(s))
        lp = (x - lse).astype(np.float32)
    lp[np.isneginf(lp)] = -FLT_MAX
    return lp


def topk_rows(scores, K, is_logprobs):
    """per depth the K best (value desc, id asc) as Python floats / ints"""
    vals, ids = [], []
    for row in scores:
        lp = log_probs(row, is_logprobs)
        order = np.argsort(-lp, kind="stable")[:K]       # stable: equal values keep id order
        vals.append([float(v) for v in lp[order]])
        ids.append([int(i) for i in order])
    return vals, ids


def build_tree(scores, budget, is_logprobs=False):
    """Algorithm 1. Returns (tokens, parents, depths, scores) for nodes 1..n in pop order
    (parents are node ids, 0 = the root)."""
    scores = np.asarray(scores, dtype=np.float32)
    L, V = scores.shape
    if budget < 0:
        raise ValueError("budget must be >= 0")
    K = min(budget, V)
    tokens, parents, depths, logws = [], [], [], []
    if K <= 0:
        return tokens, parents, depths, logws
    lp, ids = topk_rows(scores, K, is_logprobs)
    heap = [(-lp[0][0], (0,), 0, 1, 0, lp[0][0])]
    while heap and len(tokens) < budget:
        _, ranks, parent, d, r, logw = heapq.heappop(heap)
        i = len(tokens) + 1                                   # pop order, root = 0
        tokens.append(ids[d - 1][r])
        parents.append(parent)
        depths.append(d)
        logws.append(logw)
        if r + 1 < K:                                         # next sibling, same depth
            s = logw - lp[d - 1][r] + lp[d - 1][r + 1]
            heapq.heappush(heap, (-s, ranks[:-1] + (r + 1,), parent, d, r + 1, s))
        if d < L:                                             # first child, next depth
            s = logw + lp[d][0]
            heapq.heappush(heap, (-s, ranks + (0,), i, d + 1, 0, s))
    return tokens, parents, depths, logws


def score_ties(logws):
    """how many consecutive pops had exactly equal scores (ties the rank tuple broke)"""
    return sum(1 for a, b in zip(logws, logws[1:]) if a == b)


# ---------------------------------------------------------------- the fixture cases

def make_cases(rng):
    """(name, L, V, budget, is_logprobs, scores float32 [L, V])"""
    def normal(L, V, scale=3.0, spikes=0, spike=None):
        x = rng.standard_normal((L, V)) * scale
        for d in range(L):      # a few dominant tokens per depth make deep trees at large V
            x[d, rng.choice(V, size=spikes, replace=False)] += 4.0 * scale if spike is None else spike
        return x.astype(np.float32)

    cases = []
    add = lambda name, L, V, B, lpmode, x: cases.append((name, L, V, B, lpmode, np.asarray(x, np.float32)))
    # random logits over the (budget, L, V) grid: every budget 0..512, every L 1..15, V 32..163840
    add("v32_l1_b0", 1, 32, 0, False, normal(1, 32))
    add("v32_l3_b1", 3, 32, 1, False, normal(3, 32))
    add("v32_l15_b8", 15, 32, 8, False, normal(15, 32))
    add("v32_l2_b512", 2, 32, 512, False, normal(2, 32))
    add("v4_l3_b512_exhausted", 3, 4, 512, False, normal(3, 4))
    add("v100_l4_b64", 4, 100, 64, False, normal(4, 100))
    add("v1000_l7_b256", 7, 1000, 256, False, normal(7, 1000, 4.0, spikes=1))
    add("v1000_l5_b512", 5, 1000, 512, False, normal(5, 1000, 2.0, spikes=3))
    add("v4096_l6_b64", 6, 4096, 64, False, normal(6, 4096, 3.0, spikes=2))
    add("v32000_l3_b256", 3, 32000, 256, False, normal(3, 32000, 1.5, spikes=4, spike=12.0))
    add("v64_l8_b64", 8, 64, 64, False, normal(8, 64))
    add("v50_l9_b256", 9, 50, 256, False, normal(9, 50, 5.0))
    add("v40_l10_b8", 10, 40, 8, False, normal(10, 40))
    add("v32_l11_b64", 11, 32, 64, False, normal(11, 32, 6.0))
    add("v32_l12_b256", 12, 32, 256, False, normal(12, 32, 4.0))
    add("v33_l13_b512", 13, 33, 512, False, normal(13, 33, 6.0))
    add("v32_l14_b64", 14, 32, 64, False, normal(14, 32, 3.0))
    add("v48_l15_b256_logprobs", 15, 48, 256, True,
        np.stack([log_probs(r, False) for r in normal(15, 48, 4.0)]))

    # planted exact ties
    x = rng.integers(-3, 4, size=(4, 64)).astype(np.float32)            # many equal logits per row
    add("ties_equal_logits", 4, 64, 64, False, x)
    q = -rng.integers(0, 12, size=(5, 48)).astype(np.float32) / 4       # exact sums: path score ties
    add("ties_quarter_logprobs", 5, 48, 256, True, q)
    r = normal(1, 128, 2.0)
    r[0, 7] = r[0, 90] = r[0, 100] = r[0].max()                         # a 3-way tie at the top
    add("ties_repeated_rows", 6, 128, 256, False, np.repeat(r, 6, axis=0))   # a+b == b+a across depths
    oh = np.full((7, 32), -np.inf, np.float32)
    for d in range(7):
        oh[d, (5 * d + 3) % 32] = 0.0                                    # a one-hot drafter (prompt lookup)
    add("onehot_logprobs", 7, 32, 64, True, oh)
    ni = normal(3, 200)
    ni[rng.random((3, 200)) < 0.5] = -np.inf                             # masked logits
    add("neg_inf_logits", 3, 200, 256, False, ni)
    big = normal(2, 163840, 1.0, spikes=3, spike=16.0)
    top = big.max(axis=1)
    for d, cols in enumerate(([11, 50000, 163839], [0, 77, 81920])):
        big[d, cols] = top[d]                                            # tie at the top, both ends of V
    kth = np.sort(big[1])[::-1][400]
    big[1, 1000:1300] = kth                           # a 300-wide tie straddling the top-512 boundary
    bt = normal(2, 100, 1.0)
    for d in range(2):
        bt[d, [3, 20, 41, 60, 99]] = np.sort(bt[d])[::-1][6]          # ranks 6..10 tie across K = 8
    add("ties_topk_boundary", 2, 100, 8, False, bt)
    add("v163840_l2_b512_ties", 2, 163840, 512, False, big)
    return cases


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "spec", "fixtures"))
    ap.add_argument("--seed", type=int, default=20260427)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    blobs, out, offset = [], [], 0
    for name, L, V, B, lpmode, x in make_cases(rng):
        assert x.shape == (L, V) and x.dtype == np.float32
        tokens, parents, depths, logws = build_tree(x, B, lpmode)
        out.append({"name": name, "L": L, "V": V, "budget": B, "logprobs": lpmode, "offset": offset,
                    "n": len(tokens), "tokens": tokens, "parents": parents, "depths": depths,
                    "score_ties": score_ties(logws)})
        blobs.append(x.tobytes())
        offset += L * V
        print(f"{name:28s} L={L:2d} V={V:6d} B={B:3d} -> n={len(tokens):3d} "
              f"max depth {max(depths, default=0):2d}, equal-score pops {score_ties(logws)}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tree-logits.f32"), "wb") as f:
        f.write(b"".join(blobs))
    with open(os.path.join(args.out, "tree-cases.json"), "w") as f:
        json.dump({"generator": "scripts/golden/tree_ref.py", "seed": args.seed,
                   "input": "tree-logits.f32 (little-endian float32, case i at float offset)",
                   "cases": out}, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
