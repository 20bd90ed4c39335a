#!/usr/bin/env python3
"""Stage 1: the corpus. The Python source files of this interpreter's installed packages (every site-packages
directory), deduplicated by content (sha256: the first file in sorted path order keeps it), split by PACKAGE (the
top-level name under site-packages) into train and held-out, with a manifest.

    python3 corpus.py OUTDIR [--max-file-kb 512] [--smoke]

Writes OUTDIR/corpus/{train,heldout}.jsonl (one {"pkg", "path", "text"} a line, files in sorted order) and
OUTDIR/manifest.json (per package: split, files, bytes, sha256 over its files' hashes; the totals; what was dropped).
Held-out = HELDOUT packages that are present; when they hold less than 1% of the bytes, packages are added in the
order of sha256(name) until they do (so the split is fixed for a given set of installed packages)."""
import argparse
import hashlib
import json
import os
import site
import sysconfig

from common import log, write_json

HELDOUT = ["networkx", "huggingface_hub", "jinja2", "safetensors", "tokenizers", "tiktoken", "requests", "yaml"]


def site_dirs():
    dirs = set(site.getsitepackages() + [site.getusersitepackages()])
    for k in ("purelib", "platlib"):
        dirs.add(sysconfig.get_paths()[k])
    return sorted(d for d in dirs if os.path.isdir(d))


def package_of(rel):
    top = rel.split(os.sep)[0]
    return top[:-3] if top.endswith(".py") else top


def collect(max_bytes):
    files, dropped = [], {"duplicate": 0, "not_utf8": 0, "too_large": 0, "empty": 0}
    seen = set()
    for d in site_dirs():
        for dirpath, dirnames, filenames in os.walk(d):
            dirnames.sort()
            for fn in sorted(filenames):
                if not fn.endswith(".py"):
                    continue
                path = os.path.join(dirpath, fn)
                rel = os.path.relpath(path, d)
                if rel.split(os.sep)[0].endswith((".dist-info", ".egg-info")) or "__pycache__" in rel:
                    continue
                try:
                    raw = open(path, "rb").read()
                except OSError:
                    continue
                if not raw.strip():
                    dropped["empty"] += 1
                    continue
                if len(raw) > max_bytes:
                    dropped["too_large"] += 1
                    continue
                h = hashlib.sha256(raw).hexdigest()
                if h in seen:
                    dropped["duplicate"] += 1
                    continue
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    dropped["not_utf8"] += 1
                    continue
                seen.add(h)
                files.append({"pkg": package_of(rel), "path": rel, "sha": h, "bytes": len(raw), "text": text})
    return files, dropped


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--max-file-kb", type=int, default=512, help="skip larger files (generated tables)")
    a = ap.parse_args()
    log("corpus", f"site-packages: {', '.join(site_dirs())}")
    files, dropped = collect(a.max_file_kb * 1024)
    pkgs = {}
    for f in files:
        p = pkgs.setdefault(f["pkg"], {"files": 0, "bytes": 0, "hashes": []})
        p["files"] += 1
        p["bytes"] += f["bytes"]
        p["hashes"].append(f["sha"])
    total = sum(p["bytes"] for p in pkgs.values())
    held = [p for p in HELDOUT if p in pkgs]
    for name in sorted(pkgs, key=lambda n: hashlib.sha256(n.encode()).hexdigest()):
        if sum(pkgs[p]["bytes"] for p in held) >= 0.01 * total or len(held) + 1 >= len(pkgs):
            break
        if name not in held:
            held.append(name)
    if not held or len(held) == len(pkgs):
        raise SystemExit(f"corpus: cannot split {len(pkgs)} packages into train and held-out")
    os.makedirs(os.path.join(a.outdir, "corpus"), exist_ok=True)
    outs = {s: open(os.path.join(a.outdir, "corpus", s + ".jsonl"), "w") for s in ("train", "heldout")}
    for f in files:
        split = "heldout" if f["pkg"] in held else "train"
        outs[split].write(json.dumps({"pkg": f["pkg"], "path": f["path"], "text": f["text"]}) + "\n")
    for o in outs.values():
        o.close()
    manifest = {"site_packages": site_dirs(), "heldout_packages": sorted(held), "dropped_files": dropped,
                "max_file_bytes": a.max_file_kb * 1024, "packages": {}}
    for s in ("train", "heldout"):
        names = [n for n in sorted(pkgs) if (n in held) == (s == "heldout")]
        manifest[s] = {"packages": len(names), "files": sum(pkgs[n]["files"] for n in names),
                       "bytes": sum(pkgs[n]["bytes"] for n in names)}
    for n in sorted(pkgs):
        p = pkgs[n]
        manifest["packages"][n] = {"split": "heldout" if n in held else "train", "files": p["files"],
                                   "bytes": p["bytes"],
                                   "sha256": hashlib.sha256("".join(sorted(p["hashes"])).encode()).hexdigest()}
    write_json(os.path.join(a.outdir, "manifest.json"), manifest)
    log("corpus", f"{len(files)} unique files in {len(pkgs)} packages, {total / 1e6:.1f} MB; train "
        f"{manifest['train']['bytes'] / 1e6:.1f} MB, held-out {manifest['heldout']['bytes'] / 1e6:.1f} MB "
        f"({', '.join(sorted(held))}); dropped {dropped}")


if __name__ == "__main__":
    main()
