#!/usr/bin/env python3
"""tokenizer_golden.py: the shipped tiny model's tokenizer and the tokenizer goldens.

Kimi K2.6 tokenizes with tiktoken: `tiktoken.model` holds the BPE ranks (one
`base64(token bytes) rank` per line), tokenizer_config.json's added_tokens_decoder names
the special ids that follow them, and the pre-tokenizer is the pattern below
(../shared/reference/kimi_k2.md section 4). This script
 1. trains a small BPE vocabulary (tiktoken's educational trainer) so that the tiny model's
    1024 embedding rows are 766 base ranks + 258 special ids, as in K2.6 (163584 + 258 slots
    over 163840 rows: the top two slots have no row), and writes it next to the tiny model;
 2. encodes a set of strings as Kimi's tokenizer does, with tiktoken itself (its Rust core, the
    reference) behind Kimi's split of long runs (kimi_runs), and writes
    spec/fixtures/tokenizer/golden.json: the strings, their ids with and without special
    tokens parsed, and the vocabulary's special ids.
Needs: pip install tiktoken (brings `regex`). Run from the repository root:
    python3 scripts/golden/tokenizer_golden.py
"""
import base64
import json
import os
import random

import tiktoken
from tiktoken import _educational

# Kimi's pre-tokenizer, verbatim (fancy-regex class intersections, as tiktoken runs it)
KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# the same pattern for Python's `regex` module (the trainer), intersections as lookaheads
TRAIN_PAT = KIMI_PAT.replace(
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", r"(?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])").replace(
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", r"(?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])")

# K2.6's named special ids, as offsets from the first special id (163584)
SPECIAL_OFFSETS = {
    "[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4,
    "<|start_header_id|>": 6, "<|end_header_id|>": 7, "[EOT]": 9, "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11, "<|tool_calls_section_end|>": 12, "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14, "<|tool_call_end|>": 15, "<|im_middle|>": 17,
    "<|media_begin|>": 18, "<|media_content|>": 19, "<|media_end|>": 20, "<|media_pad|>": 21,
    "<think>": 22, "</think>": 23, "[UNK]": 254, "[PAD]": 255,
}
N_SPECIAL_SLOTS = 258
VOCAB_ROWS = 1024

SAMPLE = """The quick brown fox jumps over the lazy dog. It's a test: don't panic, we'll see!
Kimi K2.6 decodes with DDTree speculative decoding; the drafter proposes, the target verifies.
    def forward(self, x):  # four spaces, then code
        return x * 2 + 1\n\n\nNumbers 12345 and 3.14159, dates 2026-11-30, prices $42.
中文分词测试：你好，世界！机器学习和深度学习。 日本語のテキストも少し。 한국어 문장도 있습니다.
Ünïcödé àccents, Ελληνικά, русский текст, emoji 😀🚀 and tabs\tand\r\nwindows lines.
"""


def training_text():
    """the sample, and deterministic pseudo-words of mixed case, digits and punctuation: enough
    distinct pairs for every merge the vocabulary needs"""
    rng = random.Random(20261130)
    syllables = ["ka", "mi", "to", "re", "su", "no", "ha", "chi", "ge", "li", "ber", "ent", "ion", "th",
                 "qu", "ing", "ed", "ly", "'s", "ü", "é", "ж", "λ", "中", "文", "学"]
    words = []
    for _ in range(6000):
        w = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
        r = rng.random()
        words.append(w.capitalize() if r < 0.2 else w.upper() if r < 0.25 else str(rng.randint(0, 9999))
                     if r < 0.3 else w + rng.choice(".,;:!?") if r < 0.4 else w)
    return SAMPLE * 4 + " ".join(words)

STRINGS = [
    "", "Hello, world!", "hello world", " leading and trailing spaces  ", "It's, I'm, they're, we've, he'll, she'd",
    "DON'T SHOUT", "CamelCaseWords and snake_case_words", "12345678901234", "3.14159 2026-11-30 $42.00",
    "你好，世界！", "中文English混合text测试", "日本語のテキスト", "한국어 문장", "Ünïcödé àccents", "Ελληνικά",
    "русский текст", "emoji 😀🚀 done", "tabs\tand\r\nwindows\nlines\n\n\n", "   \n   x", "x\n  \n",
    "def f(x):\n    return x * 2\n", "a\u00a0b\u2003c", "!!!???...", "<|im_end|> is special",
    "<|im_system|>system<|im_middle|>hi<|im_end|><|im_user|>user<|im_middle|>2+2?<|im_end|>",
    "[BOS]text[EOS]", "<think>reasoning</think>answer", "no specials here <|not_a_token|>",
    "\u0301combining", "mixed\u3000ideographic space", "'s 's 'S 'LL", "ab" * 50, "9" * 10,
    # CJK punctuation is not Han by Script (only by Script_Extensions), and U+180E is not White_Space
    "「it's」", "中。's", "・'s", "中文。\n下一行", "  \u180ec", "\u180e's",
]


# Kimi's TikTokenTokenizer.encode cuts the text before tiktoken sees it (kimi_k2.md section 4):
# chunks of at most 400000 characters, each cut into runs of at most 25000 consecutive
# whitespace or non-whitespace characters (str.isspace); each run is encoded on its own
CHUNK_CHARS, RUN_CHARS = 400_000, 25_000


def kimi_runs(s):
    for c0 in range(0, len(s), CHUNK_CHARS):
        chunk = s[c0:c0 + CHUNK_CHARS]
        run_len, run_space, start = 0, chunk[0].isspace(), 0
        for i, ch in enumerate(chunk):
            space = ch.isspace()
            if space != run_space:
                run_len, run_space = 1, space
            else:
                run_len += 1
                if run_len > RUN_CHARS:
                    yield chunk[start:i]
                    start, run_len = i, 1
        yield chunk[start:]


def kimi_encode(enc, s, special):
    ids = []
    for run in kimi_runs(s):
        ids += enc.encode(run, allowed_special="all") if special else enc.encode(run, disallowed_special=())
    return ids


def random_strings(n):
    """seeded strings of mixed scripts, digits, punctuation, whitespace and special strings"""
    rng = random.Random(7)
    pieces = ["a", "Z", "the", "The", "THE", "'s", "'LL", "'t", " ", "  ", "\t", "\n", "\r\n", "\n\n", "\u00a0",
              "\u3000", "1", "42", "12345", "3.14", ",", ".", "!?", "...", "->", "(", ")", "{}", "$", "_", "中", "文字",
              "日本", "한", "é", "Ü", "ß", "λόγος", "мир", "😀", "🚀", "\u0301", "x\u0308", "<|im_end|>", "[BOS]",
              "<think>", "<|reserved_token_900|>", "<|", "|>", "[", "]", "。", "「", "」", "・", "\u180e"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(n)]


def main():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    n_base = VOCAB_ROWS - N_SPECIAL_SLOTS
    ranks = _educational.bpe_train(training_text(), n_base, TRAIN_PAT, visualise=None)
    assert len(ranks) == n_base and sorted(ranks.values()) == list(range(n_base))
    model_dir = os.path.join(root, "models", "tiny-k2.6")
    with open(os.path.join(model_dir, "tiktoken.model"), "w") as f:
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok).decode()} {rank}\n")
    decoder = {str(n_base + off): {"content": name, "special": True} for name, off in SPECIAL_OFFSETS.items()}
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]",
                   "tokenizer_class": "TikTokenTokenizer"}, f, indent=1)
        f.write("\n")
    named = {name: n_base + off for name, off in SPECIAL_OFFSETS.items()}
    special = dict(named)
    for i in range(n_base, n_base + N_SPECIAL_SLOTS):
        if i not in named.values():
            special[f"<|reserved_token_{i}|>"] = i
    enc = tiktoken.Encoding("kimi-tiny", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens=special)
    cases = []
    # runs past Kimi's 25000-character limit, written as (text, times) parts to keep the file small
    long = [[["berber", 4167]], [["chichi", 4000], ["ab", 1001]], [["x", 1], [" ", 25002], ["<|im_end|>", 1], ["y", 3]]]
    for s in STRINGS + random_strings(200) + long:
        text = s if isinstance(s, str) else "".join(piece * times for piece, times in s)
        plain = kimi_encode(enc, text, False)
        with_special = kimi_encode(enc, text, True)
        assert enc.decode(plain) == text
        cases.append({"text" if isinstance(s, str) else "parts": s, "ids": plain, "ids_special": with_special})
    with open(os.path.join(root, "spec", "fixtures", "tokenizer", "golden.json"), "w") as f:
        f.write("{\"n_base\": %d,\n \"special\": %s,\n \"cases\": [\n" % (n_base, json.dumps(named, ensure_ascii=False)))
        f.write(",\n".join(json.dumps(c, ensure_ascii=False, separators=(",", ":")) for c in cases))
        f.write("\n]}\n")   # one case a line
    print(f"{n_base} base ranks, {len(special)} special ids, {len(cases)} golden strings")


if __name__ == "__main__":
    main()
