#!/usr/bin/env python3
"""Stage 2: the tokenizer, and the corpus as token ids.

    python3 tokenize_corpus.py OUTDIR [--vocab-rows 4096] [--sample-mb 24] [--max-train-mb 160]

1. A byte-level BPE with n_base = vocab_rows - 258 ranks, trained with HF `tokenizers` (BpeTrainer, all 256 bytes
   in the initial alphabet) on a seeded sample of the train split, pre-tokenized by Kimi's pattern (the lookahead
   form TRAIN_PAT of scripts/golden/tokenizer_golden.py, which Oniguruma reads). Rank r < 256: the single bytes in
   the trainer's alphabet order; rank 256 + i: the i-th merge's token. Written as OUTDIR/tokenizer/tiktoken.model
   (`base64(bytes) rank` lines) + tokenizer_config.json (K2.6's special tokens after the base ranks, as in
   models/tiny-k2.6).
2. tiktoken (Kimi's exact pattern KIMI_PAT, these ranks, the specials) is the encoder from then on: it checks that
   every rank is reachable (encoding a rank's bytes gives that rank back), encodes the train split (up to
   --max-train-mb of text, files in a seeded order) and the held-out split, with Kimi's run splitting, into
   OUTDIR/tokens/{train,heldout}.npy (uint16 ids; each file is followed by [EOS]), and writes
   OUTDIR/tokenizer_goldens.json (tokenizer_golden.py's strings and its random ones: ids with and without specials).
"""
import argparse
import base64
import json
import os
import random

import numpy as np

from common import KIMI_PAT, N_SPECIAL_SLOTS, TRAIN_PAT, kimi_encode, log, special_ids, write_json
import tokenizer_golden as tg

WHITESPACE = np.array([c for c in range(0x3001) if chr(c).isspace()], dtype=np.uint32)   # str.isspace, all < 0x3001


def needs_kimi_split(t):
    """whether Kimi's cuts (400000-character chunks, runs of at most 25000 whitespace / non-whitespace characters
    by str.isspace) change the text's pieces (vectorized over the code points)"""
    if len(t) > tg.CHUNK_CHARS:
        return True
    if len(t) <= tg.RUN_CHARS:
        return False
    space = np.isin(np.frombuffer(t.encode("utf-32-le"), dtype=np.uint32), WHITESPACE)
    bounds = np.concatenate(([0], np.flatnonzero(space[1:] != space[:-1]) + 1, [space.size]))
    return int(np.diff(bounds).max()) > tg.RUN_CHARS


def read_split(outdir, split):
    with open(os.path.join(outdir, "corpus", split + ".jsonl")) as f:
        return [json.loads(line) for line in f]


def train_bpe(texts, n_base):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(TRAIN_PAT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_base, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    # ByteLevel's byte <-> printable character map (GPT-2's bytes_to_unicode)
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    dec = {chr(c): b for b, c in zip(bs, cs)}

    def to_bytes(s):
        return bytes(dec[ch] for ch in s)

    vocab = model["vocab"]
    singles = sorted((i, t) for t, i in vocab.items() if len(t) == 1)
    if len(singles) != 256:
        raise SystemExit(f"tokenizer: the trained alphabet has {len(singles)} single bytes, expected 256")
    ranks = {to_bytes(t): r for r, (_, t) in enumerate(singles)}
    for m in model["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ")
        tb = to_bytes(a) + to_bytes(b)
        if tb not in ranks:
            ranks[tb] = len(ranks)
    return ranks


def encode_all(enc, texts, eos, threads):
    """tiktoken ids of each text (Kimi's run splitting where a text needs it), each followed by eos"""
    fast = [i for i, t in enumerate(texts) if not needs_kimi_split(t)]
    out = [None] * len(texts)
    for i, ids in zip(fast, enc.encode_ordinary_batch([texts[i] for i in fast], num_threads=threads)):
        out[i] = ids
    for i, t in enumerate(texts):
        if out[i] is None:
            out[i] = kimi_encode(enc, t, False)
    return np.concatenate([np.asarray(ids + [eos], dtype=np.uint16) for ids in out])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--vocab-rows", type=int, default=4096, help="embedding rows = base ranks + 258 special slots")
    ap.add_argument("--sample-mb", type=float, default=24, help="train-split text the BPE is trained on")
    ap.add_argument("--max-train-mb", type=float, default=160, help="train-split text that is tokenized")
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    import tiktoken
    n_base = a.vocab_rows - N_SPECIAL_SLOTS
    if n_base < 300 or a.vocab_rows > 65535:
        raise SystemExit(f"--vocab-rows {a.vocab_rows}: expected 558..65535 (uint16 ids)")
    train = read_split(a.outdir, "train")
    held = read_split(a.outdir, "heldout")
    rng = random.Random(a.seed)
    order = list(range(len(train)))
    rng.shuffle(order)
    sample, acc = [], 0
    for i in order:
        if acc >= a.sample_mb * 1e6:
            break
        sample.append(train[i]["text"])
        acc += len(train[i]["text"])
    log("tokenizer", f"training a {n_base}-rank BPE on {len(sample)} train files ({acc / 1e6:.1f} M chars)")
    ranks = train_bpe(sample, n_base)
    if len(ranks) != n_base:
        raise SystemExit(f"tokenizer: trained {len(ranks)} ranks, expected {n_base} (sample too small?)")
    tdir = os.path.join(a.outdir, "tokenizer")
    os.makedirs(tdir, exist_ok=True)
    with open(os.path.join(tdir, "tiktoken.model"), "w") as f:
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok).decode()} {rank}\n")
    named, allsp = special_ids(n_base)
    decoder = {str(i): {"content": name, "special": True} for name, i in named.items()}
    write_json(os.path.join(tdir, "tokenizer_config.json"),
               {"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]",
                "tokenizer_class": "TikTokenTokenizer"})
    enc = tiktoken.Encoding("mini-code", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens=allsp)
    wrong = [r for t, r in ranks.items() if enc.encode_single_token(t) != r]
    if wrong:
        raise SystemExit(f"tokenizer: ranks {wrong[:10]} do not map back to themselves")
    # goldens: tokenizer_golden.py's strings and seeded random ones, plus code from the held-out split
    cases = []
    code = [t["text"][:300] for t in held[:8]]
    for s in tg.STRINGS + tg.random_strings(40) + code:
        plain, with_special = kimi_encode(enc, s, False), kimi_encode(enc, s, True)
        if enc.decode(plain) != s:
            raise SystemExit(f"tokenizer: decode(encode({s!r})) differs")
        cases.append({"text": s, "ids": plain, "ids_special": with_special})
    with open(os.path.join(a.outdir, "tokenizer_goldens.json"), "w") as f:
        f.write("{\"n_base\": %d,\n \"special\": %s,\n \"reference\": \"tiktoken %s\",\n \"cases\": [\n"
                % (n_base, json.dumps(named, ensure_ascii=False), tiktoken.__version__))
        f.write(",\n".join(json.dumps(c, ensure_ascii=False, separators=(",", ":")) for c in cases))
        f.write("\n]}\n")
    eos = named["[EOS]"]
    os.makedirs(os.path.join(a.outdir, "tokens"), exist_ok=True)
    stats = {"n_base": n_base, "vocab_rows": a.vocab_rows, "bpe_sample_chars": acc}
    for split, docs in (("train", [train[i] for i in order]), ("heldout", held)):
        texts, acc = [], 0
        for d in docs:
            if split == "train" and acc >= a.max_train_mb * 1e6:
                break
            texts.append(d["text"])
            acc += len(d["text"])
        ids = encode_all(enc, texts, eos, a.threads)
        np.save(os.path.join(a.outdir, "tokens", split + ".npy"), ids)
        stats[split] = {"files": len(texts), "chars": acc, "tokens": int(ids.size),
                        "chars_per_token": acc / max(1, ids.size)}
        log("tokenizer", f"{split}: {len(texts)} files, {acc / 1e6:.1f} M chars -> {ids.size / 1e6:.2f} M tokens "
            f"({acc / max(1, ids.size):.2f} chars/token)")
    write_json(os.path.join(a.outdir, "tokenizer_stats.json"), stats)


if __name__ == "__main__":
    main()
