#!/usr/bin/env python3
"""tests/bpe_oracle.py — reference token ids for tests/test_bpe.c, from Hugging Face
`tokenizers` and OpenAI's `tiktoken` (scripts/install-pydeps.sh installs both into .pyenv/).

    python3 tests/bpe_oracle.py DIR [--repo ROOT] [--extra NAME=FILE ...]

Writes into DIR:
  corpus_NAME.txt       the texts (UTF-8): generated English-like text with contractions and
                        numbers, a multilingual / emoji / odd-whitespace sample, whitespace runs,
                        special tokens inside text, the repository's own source code (--repo),
                        and any --extra file (tinyshakespeare when the tests find it; encoded
                        with gpt2 and tiktoken only, to keep the test's time down)
  tok_KIND.json         byte-level BPE tokenizers trained here with tokenizers' BpeTrainer on
                        those texts: gpt2 (ByteLevel's own split), llama3 (Split + ByteLevel,
                        ignore_merges), cl100k (the same vocabulary, tiktoken's spelling of the
                        pattern), qwen2 (single digits), prefix (GPT-2 with add_prefix_space),
                        strmerges (GPT-2 with merges written "a b", the pre-0.20 form), and three
                        trained on pre-tokenizers of their own, which the C code must take from the
                        file rather than know: custom (a made-up pattern with lookbehind, empty
                        matches and Oniguruma's {,n}), lossy_behaviors (four Splits, one of each
                        other behavior, a String pattern, invert, then ByteLevel with its regex and
                        add_prefix_space) and lossy_removed (Removed drops the newlines); "lossy":
                        decoding does not give the text back
  ids_KIND_NAME.u32     tokenizers' ids (little-endian uint32) of encode(text,
                        add_special_tokens=False)
  ids_tiktoken_NAME.u32 tiktoken's ids with the cl100k pattern and tok_cl100k's ranks
  manifest.txt          one line per case: KIND NAME (KIND tiktoken is read with tok_cl100k.json)

Each tokenizer is also checked here to decode its ids back to the text. Exit status 0; 3 when
tokenizers or tiktoken cannot be imported; 1 otherwise.
"""
import json
import os
import random
import sys

try:
    import tokenizers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers import AddedToken
    import tiktoken
except ImportError as e:  # the C test reads this line
    print("bpe_oracle: missing Python package: %s" % e, file=sys.stderr)
    sys.exit(3)

GPT2_RE = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_RE = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
             r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
CL100K_RE = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|"""
             r"""\s*[\r\n]|\s+(?!\S)|\s+""")
QWEN2_RE = LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")
# Made up: a lookbehind/lookahead pair that matches empty (Oniguruma's find_iter then steps one
# character on, so an upper-case letter after a lower-case one lands in a gap), {,2} (Oniguruma's
# {0,2}, empty matches again), \s (PCRE2 would add U+180E).
CUSTOM_RE = r"(?<=\p{Ll})(?=\p{Lu})|\p{Lu}?\p{Ll}+|\p{Lu}+(?!\p{Ll})|\p{N}{,2}|[^\s\p{L}\p{N}]{1,3}|\s+"


def custom_pre_tokenizers():
    P = pre_tokenizers
    return {
        "custom": P.Sequence([P.Split(Regex(CUSTOM_RE), behavior="isolated"),
                              P.ByteLevel(add_prefix_space=False, use_regex=False)]),
        "lossy_behaviors": P.Sequence([P.Split(Regex(r"\s+"), behavior="merged_with_next"),
                                       P.Split("e", behavior="merged_with_previous"),
                                       P.Split(Regex(r"\p{P}+"), behavior="contiguous", invert=True),
                                       P.Split(Regex(r"\p{N}"), behavior="isolated"),
                                       P.ByteLevel(add_prefix_space=True, use_regex=True)]),
        "lossy_removed": P.Sequence([P.Split(Regex(r"[\r\n]+"), behavior="removed"),
                                     P.ByteLevel(add_prefix_space=False, use_regex=True)]),
    }

SPECIALS = ["<|endoftext|>", "<|fim middle|>"]  # the second has a space: decoded as UTF-8 text


def english(rng, n_words):
    words = ("the of and to in is was he for it with as his on be at by had are but from or have an they which "
             "one you were her all she there would their we him been has when who will more no if out so said what "
             "up its about into than them can only other new some could time these two may then do first any my now "
             "such like our over man me even most made after also did many before must through back years where much "
             "your way well down should because each just those people Mr how too little state good very make world "
             "still own see men work long get here between both life being under never day same another know while "
             "last might us great old year off come since against go came right used take three naïve café résumé "
             "Straße coöperate").split()
    # "'ſt" and "'Sx": Llama-3's (?i) contractions take 'ſ (long s folds to s) and 'S, then "t", "x"
    tails = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ll", "'ſ", "'ſt", "'Sx", "'Dre",
             "'llama", "'x", "''", "’s"]
    out = []
    for i in range(n_words):
        w = rng.choice(words)
        r = rng.random()
        if r < 0.08:
            w = w.capitalize()
        elif r < 0.11:
            w = w.upper()
        if rng.random() < 0.06:
            w += rng.choice(tails)
        if rng.random() < 0.05:
            w = str(rng.randrange(10 ** rng.randrange(1, 13)))
        if rng.random() < 0.02:
            w = "%d.%02d" % (rng.randrange(1000), rng.randrange(100))
        if rng.random() < 0.02:
            w = "%s%d" % (w, rng.randrange(100000))
        out.append(w)
        r = rng.random()
        if r < 0.06:
            out.append(rng.choice([".", ",", ";", ":", "!", "?", "...", " -", " (", ")", '"', " —", "!!", "?!"]))
        if r < 0.015:
            out.append(rng.choice(["\n", "\n\n", "\r\n", "\n\n\n"]))
        else:
            out.append(" ")
    return "".join(out)


MULTILINGUAL = [
    "Le cœur a ses raisons que la raison ne connaît point. Ça va? Où est l'hôtel «Élysée»?",
    "Größe, Übermaß und Äpfel: Fußgängerübergänge sind außergewöhnlich.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю. Москва — столица России.",
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Καλημέρα κόσμε!",
    "我能吞下玻璃而不伤身体。北京是中国的首都，人口约2189万。",
    "いろはにほへと ちりぬるを わかよたれそ つねならむ。東京タワーは333メートルです。",
    "다람쥐 헌 쳇바퀴에 타고파. 서울특별시 인구는 약 9,428,372명이다.",
    "العربية لغة جميلة، والأرقام ٠١٢٣٤٥٦٧٨٩ تكتب هكذا.",
    "हिन्दी एक सुंदर भाषा है। संख्याएँ: १२३४५६७८९०",
    "עברית: שלום עולם! ١٢٣ and ۴۵۶ and ߁߂߃",
    "Emoji: 😀😃😄 👩‍👩‍👧‍👦 👍🏽 🇫🇷🇯🇵 ❤️‍🔥 🏳️‍🌈 1️⃣ #️⃣ 🧑‍💻 ✈️",
    "Math: ∀x∈ℝ, x²≥0; ∑ᵢ aᵢ = ½ + ¼ + ⅛ … Ⅻ ⅻ ① ② ③ 10⁻³ H₂O",
    "Combining: e\u0301 a\u0308 n\u0303 Z\u0335\u0321a\u0336l\u0337g\u0338o\u0334",
    "Spaces:\u00a0nbsp\u3000ideographic\u2003em\u2009thin\u202fnnbsp\u205fmath\u1680ogham end",
    "Breaks:\u0085nel\u2028line\u2029para\x1cfs\x1dgs\x1ers\x1fus\x0bvt\x0cff",
    "Controls and zero-width: a\u200bb\u200cc\u200dd\ufeffe\u00adf\u2060g",
    "Mixed: abc123def ４５６ full-width ＡＢＣ ｱｲｳ 2023年12月31日 v1.2.3-rc4 0x1F 1e-9 3.14159",
    "Private use and rare: \ue000\U000f0000 \U0001d400\U0001d41a \U00020000\U0002a6d6 ꙮ ᚠᚢᚦ 𓀀𓂀",
]


def multilingual(rng):
    parts = []
    for _ in range(150):
        parts.append(rng.choice(MULTILINGUAL))
        parts.append(rng.choice([" ", "\n", "\n\n", "  ", "\t", " \n", "\r\n", ""]))
    return "".join(parts)


def whitespace(rng):
    # Runs of every White_Space character (and of 0x1C-0x1F, which Python's isspace takes and \s
    # does not), often enough that merges are learnt across them: a character put in the wrong
    # class then changes the ids, not only where pieces end.
    odd = ["\u0085", "\u00a0", "\u1680", "\u2000", "\u2007", "\u200a", "\u2028", "\u2029", "\u202f", "\u205f",
           "\u3000", "\x0b", "\x0c", "\x1c", "\x1f", "\u180e", "\u200b"]
    parts = []
    for _ in range(3000):
        r = rng.random()
        if r < 0.4:
            parts.append(rng.choice(["word", "x", "Hello", "42", "7", "!", "'s", "é", "中", "😀", "--", "a1"]))
        ws = "".join(rng.choice([" ", " ", " ", "\t", "\n", "\r"] + odd)
                     for _ in range(rng.randrange(0, 7)))
        parts.append(ws)
    return "   leading" + "".join(parts) + "trailing   \n\n  "


def specials(rng):
    bits = ["<|endoftext|>", "<|endoftext|><|endoftext|>", "<|endoftext", "|>", "<|", "<|fim middle|>",
            " <|endoftext|> ", "\n<|endoftext|>\n", "text<|endoftext|>text", "<<|endoftext|>>", "<|fim middle",
            "Hello world", "It's 2024", "  spaced  "]
    return "".join(rng.choice(bits) for _ in range(800))


def source(repo):
    out = []
    for d in ("train", "scripts", "tests"):
        p = os.path.join(repo, d)
        if not os.path.isdir(p):
            continue
        for name in sorted(os.listdir(p)):
            if name.endswith((".c", ".h", ".py", ".sh")):
                with open(os.path.join(p, name), encoding="utf-8", errors="replace") as f:
                    out.append(f.read())
    text = "".join(out)
    return text[:120000]


def train(texts, vocab_size, pre_tokenizer=None):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=tr)
    return json.loads(tok.to_str())


def variant(base, split_re=None, ignore_merges=None, prefix=None, str_merges=False):
    j = json.loads(json.dumps(base))
    if split_re is not None:
        j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split_re}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    if ignore_merges is not None:
        j["model"]["ignore_merges"] = ignore_merges
    if prefix is not None:
        j["pre_tokenizer"]["add_prefix_space"] = prefix
    if str_merges:
        j["model"]["merges"] = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
    return j


def write_ids(path, ids):
    with open(path, "wb") as f:
        for i in ids:
            f.write(int(i).to_bytes(4, "little"))


def tiktoken_encoding(j):
    """tiktoken's ranks are token ids: the vocabulary's bytes (GPT-2's byte-to-unicode undone)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    u2b = {chr(c): b for b, c in zip(bs, cs)}
    ranks = {bytes(u2b[ch] for ch in s): i for s, i in j["model"]["vocab"].items() if s not in SPECIALS}
    special = {t["content"]: t["id"] for t in j["added_tokens"]}
    return tiktoken.Encoding("bpe-oracle", pat_str=CL100K_RE, mergeable_ranks=ranks, special_tokens=special)


def main():
    args = sys.argv[1:]
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    out, repo, extra = args[0], None, []
    i = 1
    while i < len(args):
        if args[i] == "--repo":
            repo = args[i + 1]
            i += 2
        elif args[i] == "--extra":
            extra.append(args[i + 1].split("=", 1))
            i += 2
        else:
            print("bpe_oracle: unknown argument %r" % args[i], file=sys.stderr)
            return 2
    os.makedirs(out, exist_ok=True)
    rng = random.Random(20241127)
    corpora = {"english": english(rng, 15000), "unicode": multilingual(rng), "whitespace": whitespace(rng),
               "specials": specials(rng)}
    if repo:
        corpora["code"] = source(repo)
    for name, path in extra:
        with open(path, encoding="utf-8") as f:
            corpora[name] = f.read()
    for name, text in corpora.items():
        with open(os.path.join(out, "corpus_%s.txt" % name), "w", encoding="utf-8", newline="") as f:
            f.write(text)
    # --extra corpora (tinyshakespeare: 1.1 MB) take tokenizers 4 s each on one core: they are
    # neither trained on nor encoded with every variant, only with gpt2 and tiktoken.
    big = set(name for name, _ in extra)
    base = train([t for n, t in corpora.items() if n != "specials" and n not in big], 3000)
    kinds = {"gpt2": base, "llama3": variant(base, LLAMA3_RE, ignore_merges=True), "cl100k": variant(base, CL100K_RE),
             "qwen2": variant(base, QWEN2_RE), "prefix": variant(base, prefix=True),
             "strmerges": variant(base, str_merges=True)}
    texts = [t for n, t in corpora.items() if n != "specials" and n not in big]
    for kind, pt in custom_pre_tokenizers().items():
        kinds[kind] = train(texts, 2000, pt)
    manifest = []
    for kind, j in kinds.items():
        path = os.path.join(out, "tok_%s.json" % kind)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(j, f, ensure_ascii=False)
        tok = Tokenizer.from_file(path)
        for name, text in corpora.items():
            if name in big and kind != "gpt2":
                continue
            ids = tok.encode(text, add_special_tokens=False).ids
            back = tok.decode(ids, skip_special_tokens=False)
            want = (" " + text) if kind == "prefix" and not text.startswith(" ") else text
            if back != want and kind != "prefix" and not kind.startswith("lossy"):
                print("bpe_oracle: %s does not decode %s back to its text" % (kind, name), file=sys.stderr)
                return 1
            write_ids(os.path.join(out, "ids_%s_%s.u32" % (kind, name)), ids)
            manifest.append("%s %s" % (kind, name))
    enc = tiktoken_encoding(kinds["cl100k"])
    for name, text in corpora.items():
        write_ids(os.path.join(out, "ids_tiktoken_%s.u32" % name), enc.encode(text, allowed_special="all"))
        manifest.append("tiktoken %s" % name)
    with open(os.path.join(out, "manifest.txt"), "w") as f:
        f.write("\n".join(manifest) + "\n")
    print("bpe_oracle: tokenizers %s, tiktoken %s: %d cases in %s" % (tokenizers.__version__, tiktoken.__version__,
                                                                     len(manifest), out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
