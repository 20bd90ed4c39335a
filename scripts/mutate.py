#!/usr/bin/env python3
"""scripts/mutate.py: a mutation run over the core. Each mutation replaces one piece of code
(exactly one occurrence) in a source file, rebuilds the CPU library, and runs the specs of its
area; the suite kills it when a spec fails. A mutation its specs do not kill is run against the
whole CPU suite (`--exclude-tags=gpu,slow`) before it counts as a survivor. The file is always
restored. docs/testing.md lists the result and explains each survivor.

  python3 scripts/mutate.py                 # all mutations; a markdown table on stdout
  python3 scripts/mutate.py --only R1,P2    # some of them
  python3 scripts/mutate.py --area-only     # survivors of their area's specs are not run on the whole suite
  python3 scripts/mutate.py --list
Run from the repository root with nothing else building (it rebuilds build/libkdtree.so with
CUDA=0 and leaves it rebuilt from the unmutated sources).
"""
import os
import subprocess
import sys
import time

BUSTED = ["luajit", "/usr/bin/busted", "--exclude-tags=gpu,slow"]

TREE = ["spec/tree_spec.lua", "spec/ddtree_spec.lua", "spec/argmax_ties_spec.lua"]
ACCEPT = ["spec/ddtree_spec.lua", "spec/ddtree_round_spec.lua", "spec/policy_spec.lua", "spec/nonfinite_spec.lua", "spec/backend_failure_spec.lua"]
COMPACT = ["spec/forward_spec.lua", "spec/ddtree_spec.lua"]
SAMPLE = ["spec/sample_spec.lua", "spec/sample_golden_spec.lua", "spec/ddtree_spec.lua"]
ROPE = ["spec/golden_spec.lua", "spec/loader_spec.lua", "spec/dflash_spec.lua", "spec/cpu_ops_spec.lua"]
MOE = ["spec/golden_spec.lua", "spec/cpu_ops_spec.lua"]
ARGMAX = ["spec/cpu_ops_spec.lua", "spec/argmax_ties_spec.lua", "spec/nonfinite_spec.lua"]

# (id, area, file, old, new, specs)
MUTATIONS = [
    ("T1", "tree rule", "core/tree.c",
     "e.score - list_value(vals, row + r) + list_value(vals, row + r + 1)",
     "e.score + list_value(vals, row + r + 1)", TREE),
    ("T2", "tree rule", "core/tree.c", "        if (d < L)\n", "        if (d < L - 1)\n", TREE),
    ("T3", "tree rule", "core/tree.c", "        if (r + 1 < K)\n", "        if (r + 2 < K)\n", TREE),
    ("T4", "tree rule", "core/tree.c", "if (a->score != b->score) return a->score > b->score;",
     "if (a->score != b->score) return a->score < b->score;", TREE),
    ("T5", "tree rule", "core/tree.c", "    if (!(v >= -FLT_MAX)) v = -FLT_MAX;", "    if (!(v >= -FLT_MAX)) v = 0;", TREE),
    ("A1", "accept walk", "core/cpu/cpu_ddtree.c", "for (int j = cur + 1; j <= n; j++)", "for (int j = cur + 1; j < n; j++)",
     ACCEPT),
    ("A2", "accept walk", "core/cpu/cpu_ddtree.c", "if (c < 0 || tau >= N) { bonus = next; break; }",
     "if (c < 0 || tau >= N) { bonus = t->token[cur]; break; }", ACCEPT),
    ("A3", "accept walk", "core/cpu/cpu_ddtree.c", "hdr[KD_DTREE_R_POS] = t->pos[cur] + 1;",
     "hdr[KD_DTREE_R_POS] = t->pos[cur] + 2;", ACCEPT),
    ("A4", "accept walk (host round)", "core/ddtree.c", "int32_t pos = g->s->len + g->t->depth[node] + 1;",
     "int32_t pos = g->s->len + g->t->depth[node] + 3;", ACCEPT),
    ("A5", "accept walk", "core/ddtree.c", "if (v < 0 || v > n || (i == 0 ? v != 0 : v <= r[KD_DTREE_HDR + i - 1]))",
     "if (v < 0 || v > n)", ACCEPT),
    ("C1", "compaction", "core/seq.c", "if (st == KD_OK) st = move_slots(s, &p, start, d_idx, n, start + c0);",
     "if (st == KD_OK) st = move_slots(s, &p, start, d_idx, n, start + c0 + 1);", COMPACT),
    ("C2", "compaction", "core/seq.c", "if (i > 0 && keep[i] <= keep[i - 1])", "if (i > 0 && keep[i] < keep[i - 1])",
     COMPACT),
    ("C3", "compaction", "core/seq.c", "for (int c0 = 0; c0 < n_keep; c0 += s->out_cap) {",
     "for (int c0 = 0; c0 < n_keep; c0 += s->out_cap + 1) {", COMPACT),
    ("R1", "RNG", "core/sample_rule.h", "0xD1B54A32D192ED03ull", "0xD1B54A32D192ED05ull", SAMPLE),
    ("R2", "RNG", "core/sample_rule.h", "x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;",
     "x = (x ^ (x >> 31)) * 0xBF58476D1CE4E5B9ull;", SAMPLE),
    ("R3", "RNG", "core/sample_rule.h", "(uint64_t)position * 0xD1B54A32D192ED03ull) >> 11;",
     "(uint64_t)position * 0xD1B54A32D192ED03ull) >> 12;", SAMPLE),
    ("P1", "top-p", "core/sample_rule.h", "    g = kd_u128_add64(g, 0xffffffffull);\n", "", SAMPLE),
    ("P2", "top-p", "core/sample.c", "if (!kd_u128_lt(cum, goal)) break;", "if (kd_u128_lt(goal, cum)) break;", SAMPLE),
    ("P3", "top-p", "core/sample_rule.h", "uint64_t P = (uint64_t)KD_RULE_MUL((double)top_p, 0x1p32);",
     "uint64_t P = (uint64_t)KD_RULE_MUL((double)top_p, 0x1p32) + 1;", SAMPLE),
    ("P4", "top-p", "core/sample_rule.h", "    if (g.hi == 0 && g.lo == 0) g.lo = 1;\n", "", SAMPLE),
    ("P5", "top-k", "core/sample.c", "if (k > 0 && k < V) {", "if (k > 1 && k < V) {", SAMPLE),
    ("P6", "top-k", "core/sample.c", "return x[a] < x[b] || (x[a] == x[b] && a > b);",
     "return x[a] < x[b] || (x[a] == x[b] && a < b);", SAMPLE),
    ("O1", "RoPE", "core/cpu/cpu_elementwise.c", "p[ib] = b * c + a * s;", "p[ib] = b * c - a * s;", ROPE),
    ("O2", "RoPE", "core/cpu/cpu_elementwise.c", "int ia = r->interleaved ? 2 * i : i, ib = r->interleaved ? 2 * i + 1 : i + half;",
     "int ia = r->interleaved ? 2 * i : i, ib = r->interleaved ? i + half : i + half;", ROPE),
    ("O3", "RoPE", "core/config_read.c", "if (r->truncate) { low = floor(low); high = ceil(high); }",
     "if (r->truncate) { low = ceil(low); high = ceil(high); }", ROPE),
    ("O4", "RoPE", "core/config_read.c", "        if (low == high) high += 0.001;   /* HF: prevent a singular ramp */\n", "",
     ROPE),
    ("O5", "RoPE", "core/config_read.c", ": kd_yarn_mscale(r->factor, 1.0);", ": kd_yarn_mscale(r->factor, 0.5);", ROPE),
    ("O6", "RoPE", "core/cpu/cpu_elementwise.c", "float ang = (float)pos[t] * r->inv_freq[i];",
     "float ang = (float)(pos[t] + 1) * r->inv_freq[i];", ROPE),
    ("M1", "MoE routing", "core/cpu/cpu_moe.c", "gscore[g] = per >= 2 ? a + b : a;", "gscore[g] = a;", MOE),
    ("M2", "MoE routing", "core/cpu/cpu_moe.c", "        w[j] = scores[b];\n", "        w[j] = choice[b];\n", MOE),
    ("M3", "MoE routing", "core/cpu/cpu_moe.c", "if (c > a) { b = a; a = c; } else if (c > b) b = c;",
     "if (c > a) { a = c; } else if (c > b) b = c;", MOE),
    ("M4", "MoE routing", "core/cpu/cpu_moe.c", "if (best < 0 || v[i] > v[best]) best = i;",
     "if (best < 0 || v[i] >= v[best]) best = i;", MOE),
    ("M5", "MoE routing", "core/cpu/cpu_moe.c", "if (e->norm_topk_prob) w[j] /= sum + 1e-20f;", "w[j] /= sum + 1e-20f;",
     MOE),
    ("M6", "MoE routing", "core/cpu/cpu_moe.c", "for (int j = 0; j < e->topk_group && j < ng; j++)",
     "for (int j = 0; j <= e->topk_group && j < ng; j++)", MOE),
    ("G1", "argmax", "core/cpu/cpu_elementwise.c", "return va > vb || (va == vb && ia < ib);",
     "return va > vb || (va == vb && ia > ib);", ARGMAX),
    ("G2", "argmax", "core/cpu/cpu_elementwise.c", "            bad = kd_rule_logit_code(xr[c], c);\n", "", ARGMAX),
]


def run(cmd, timeout):
    try:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return "timeout"


def build():
    return run(["make", "CUDA=0", "-j2", "all"], 900) == 0


def specs_fail(specs):
    env_cmd = BUSTED + specs
    os.environ["KDTREE_LIB"] = "build/libkdtree_test.so"   # the library + the specs' test surface
    rc = run(env_cmd, 1800)
    return rc != 0


def main():
    if "--list" in sys.argv:
        for m in MUTATIONS:
            print("%s  %-24s %s: %r -> %r" % (m[0], m[1], m[2], m[3], m[4]))
        return
    only = None
    if "--only" in sys.argv:
        only = set(sys.argv[sys.argv.index("--only") + 1].split(","))
    rows = []
    try:
        for mid, area, path, old, new, specs in MUTATIONS:
            if only and mid not in only:
                continue
            src = open(path).read()
            if src.count(old) != 1:
                rows.append((mid, area, path, "not applied (%d matches)" % src.count(old), "", 0))
                continue
            t0 = time.time()
            try:
                with open(path, "w") as f:
                    f.write(src.replace(old, new))
                if not build():
                    result, by = "invalid (does not compile)", ""
                elif specs_fail(specs):
                    result, by = "killed", " ".join(os.path.basename(s) for s in specs)
                elif "--area-only" in sys.argv:
                    result, by = "SURVIVED its area's specs", ""
                elif specs_fail(["spec"]):
                    result, by = "killed", "the whole suite"
                else:
                    result, by = "SURVIVED", ""
            finally:
                with open(path, "w") as f:
                    f.write(src)
            rows.append((mid, area, path, result, by, time.time() - t0))
            print("%s %s: %s %s (%.0f s)" % (mid, area, result, by, time.time() - t0), file=sys.stderr, flush=True)
    finally:
        build()
    print("| id | area | file | mutation | result | killed by |")
    print("|---|---|---|---|---|---|")
    for mid, area, path, result, by, _ in rows:
        m = next(x for x in MUTATIONS if x[0] == mid)
        what = "`%s` -> `%s`" % (m[3].strip().replace("|", "\\|"), (m[4].strip() or "(removed)").replace("|", "\\|"))
        print("| %s | %s | %s | %s | %s | %s |" % (mid, area, path, what, result, by))


if __name__ == "__main__":
    main()
