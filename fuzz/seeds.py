#!/usr/bin/env python3
"""fuzz/seeds.py OUT: the seed corpora of the fuzz harnesses, from the shipped fixtures.
One directory per harness under OUT; an input holds a harness's files joined by FUZZ_SEP
(fuzz/common.h). Safetensors seeds keep their full headers and a small data section (the
first tensors, offsets rewritten to fit) so that mutations start from valid files of a few KB."""
import json
import os
import struct
import sys

SEP = b"\n--8<--\n"
K26, DSV3, DRAFT = "models/tiny-k2.6", "spec/fixtures/tiny-dsv3", "models/tiny-k2.6-dflash"


def read(path):
    with open(path, "rb") as f:
        return f.read()


def header(path):
    b = read(path)
    n = struct.unpack("<Q", b[:8])[0]
    return json.loads(b[8:8 + n])


def st_bytes(h):
    t = json.dumps(h, separators=(",", ":")).encode()
    t += b" " * (-len(t) % 8)
    return struct.pack("<Q", len(t)) + t


def small_st(path, keep):
    """the first `keep` tensors of at most 4 KB of a file, with zero data, offsets compacted"""
    h, out, off = header(path), {}, 0
    names = [k for k in sorted(h) if k != "__metadata__"
             and h[k]["data_offsets"][1] - h[k]["data_offsets"][0] <= 4096][:keep]
    for k in names:
        t = dict(h[k])
        size = t["data_offsets"][1] - t["data_offsets"][0]
        t["data_offsets"] = [off, off + size]
        off += size
        out[k] = t
    return st_bytes(out) + bytes(off)


def headers_only(path):
    """the whole header, no data (the drafter's inspection reads headers only)"""
    return st_bytes(header(path))


def write(out, harness, name, *parts):
    d = os.path.join(out, harness)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(SEP.join(parts))


def main():
    out = sys.argv[1]
    shard1 = K26 + "/model-00001-of-00002.safetensors"
    index = read(K26 + "/model.safetensors.index.json")
    for i, (name, path) in enumerate([("k26-1", shard1), ("dsv3", DSV3 + "/model.safetensors"),
                                      ("dflash", DRAFT + "/model.safetensors")]):
        write(out, "safetensors", name + "-small", small_st(path, 6))
        write(out, "safetensors", name + "-index", small_st(path, 3), index)
    for name, d in [("k26", K26), ("dsv3", DSV3)]:
        write(out, "config", name, read(d + "/config.json"), read(d + "/generation_config.json"))
        write(out, "config", name + "-nogen", read(d + "/config.json"))
    write(out, "drafter", "dflash", read(DRAFT + "/config.json"), headers_only(DRAFT + "/model.safetensors"))
    write(out, "tokenizer", "k26", read(K26 + "/tiktoken.model"), read(K26 + "/tokenizer_config.json"))
    golden = json.loads(read("spec/fixtures/tokenizer/golden.json"))
    for i, c in enumerate(golden["cases"][:60]):
        if "text" in c:
            write(out, "encode", "golden-%03d" % i, c["text"].encode())


if __name__ == "__main__":
    main()
