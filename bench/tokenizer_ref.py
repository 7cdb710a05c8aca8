"""The reference side of bench/tokenizer.sh: the `tokenizers` package on the files that
build/bench/tokenizer (bench/tokenizer.c) times, and the generated corpora.

    python bench/tokenizer_ref.py corpus prose|mixed OUT BYTES
        a deterministic text of about BYTES bytes: `prose` is English-like (words of a Zipf-
        distributed vocabulary of 20,000 made-up words, sentences, speaker lines: the stand-in
        for tinyshakespeare); `mixed` adds accented Latin, Greek, Cyrillic, CJK, emoji, numbers,
        C-like source lines and runs of spaces.
    python bench/tokenizer_ref.py encode TOKENIZER.json TEXT REPS [IDS.u32]
        one thread, the best of REPS, each on a line "NAME SECONDS IDS SAME":
          encode    Tokenizer.encode(text, add_special_tokens=False) of the whole text;
          batch     Tokenizer.encode_batch of its lines (keepends): how tokenizers is mostly
                    fed; the ids where spaces meet a line end may differ (the split sees one line);
          tiktoken  (when importable) tiktoken.Encoding with GPT-2's pattern and the file's
                    vocabulary as ranks (id order), encode_ordinary of the whole text.
        SAME: whether the ids equal tinymoe's (IDS.u32), '-' without it.
    python bench/tokenizer_ref.py train TEXT N OUT.json REPS
        BpeTrainer(vocab_size=N, ByteLevel alphabet, <|endoftext|>) on a ByteLevel tokenizer
        (GPT-2's split), as `tinymoe tokenize --bpe N` trains: prints "seconds S merges K".
Run with TOKENIZERS_PARALLELISM=false for one thread (bench/tokenizer.sh does).
"""
import array
import random
import sys
import time


def made_up_words(r, n, syllables):
    words, seen = [], set()
    while len(words) < n:
        w = "".join(r.choice(syllables) for _ in range(r.choice((1, 1, 2, 2, 2, 3, 3, 4))))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def corpus(kind, out, nbytes):
    r = random.Random(23)
    syl = [c + v + e for c in ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "th", "w", "st", "br"]
           for v in ["a", "e", "i", "o", "u", "ou", "ea"] for e in ["", "", "n", "r", "s", "t", "ll", "ng"]]
    vocab = made_up_words(r, 20000, syl)
    cum, acc = [], 0.0
    for k in range(len(vocab)):
        acc += 1.0 / (k + 1) ** 1.1
        cum.append(acc)
    names = [w.upper() for w in vocab[200:260]]
    foreign = {
        "latin": ["naïve", "café", "déjà", "über", "façade", "Ångström", "señor", "straße", "coöperate", "résumé"],
        "greek": ["Ελληνικά", "λόγος", "ἀρχή", "θάλασσα", "καλημέρα"],
        "cyrillic": ["Привет", "мир", "слово", "язык", "книга"],
        "cjk": ["日本語", "中文字符", "한국어", "東京", "漢字かな交じり文", "你好世界"],
        "emoji": ["😀", "👩‍👩‍👧", "🚀🚀", "🇫🇷", "✨", "👍🏽", "🤖"],
    }
    code = ["for (int i = 0; i < n; i++) {", "    x[i] = y[i] * 2.5f + b;", "}", "return tm_fail(err, errlen, \"%s\", s);",
            "if (a->count > b->count || (a->count == b->count && a->key < b->key))",
            "def f(x):\n    return {k: v ** 2 for k, v in x.items()}", "#include <stdio.h>", "    /* why, not what */"]
    parts, size = [], 0
    while size < nbytes:
        if kind == "prose" and r.random() < 0.15:
            s = "\n" + r.choice(names) + ":\n"
        else:
            n = r.randint(4, 18)
            ws = r.choices(vocab, cum_weights=cum, k=n)
            ws[0] = ws[0].capitalize()
            if kind == "mixed":
                for j in range(n):
                    x = r.random()
                    if x < 0.06:
                        ws[j] = r.choice(foreign[r.choice(list(foreign))])
                    elif x < 0.09:
                        ws[j] = str(r.randint(0, 10 ** r.randint(1, 9)))
            s = " ".join(ws) + r.choice([".", ",", ";", "!", "?", ":", "'s", " --"]) + r.choice([" ", " ", "\n"])
            if kind == "mixed" and r.random() < 0.08:
                s += "\n" + r.choice(code) + "\n" + " " * r.randint(0, 12)
        parts.append(s)
        size += len(s.encode("utf-8"))
    with open(out, "w", encoding="utf-8") as f:
        f.write("".join(parts))


def bytes_to_unicode():
    """GPT-2's byte -> printable character map (tokenizers' ByteLevel)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def best_of(reps, f):
    best, res = 1e30, None
    for _ in range(reps):
        t0 = time.perf_counter()
        res = f()
        best = min(best, time.perf_counter() - t0)
    return best, res


def main():
    cmd = sys.argv[1]
    if cmd == "corpus":
        corpus(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if cmd == "encode":
        tok = Tokenizer.from_file(sys.argv[2])
        text = open(sys.argv[3], encoding="utf-8").read()
        reps = int(sys.argv[4])
        ours = None
        if len(sys.argv) > 5:
            ours = array.array("I")
            with open(sys.argv[5], "rb") as f:
                ours.frombytes(f.read())
            ours = list(ours)

        def same(ids):
            return "-" if ours is None else ("yes" if ids == ours else "no")

        sec, enc = best_of(reps, lambda: tok.encode(text, add_special_tokens=False))
        print(f"encode {sec:.6f} {len(enc.ids)} {same(enc.ids)}")
        lines = text.splitlines(keepends=True)
        sec, encs = best_of(reps, lambda: tok.encode_batch(lines, add_special_tokens=False))
        ids = [i for e in encs for i in e.ids]
        print(f"batch {sec:.6f} {len(ids)} {same(ids)}")
        try:
            import tiktoken
        except ImportError:
            return 0
        import json
        b2u = bytes_to_unicode()
        u2b = {u: b for b, u in b2u.items()}
        vocab = json.load(open(sys.argv[2], encoding="utf-8"))["model"]["vocab"]
        ranks = {bytes(u2b[c] for c in s): i for s, i in vocab.items()}
        pat = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
        enc = tiktoken.Encoding("bench", pat_str=pat, mergeable_ranks=ranks, special_tokens={})
        sec, ids = best_of(reps, lambda: enc.encode_ordinary(text))
        print(f"tiktoken {sec:.6f} {len(ids)} {same(ids)}")
        return 0
    if cmd == "train":
        def train():
            tok = Tokenizer(models.BPE())
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            tok.decoder = decoders.ByteLevel()
            tr = trainers.BpeTrainer(vocab_size=int(sys.argv[3]), show_progress=False,
                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                     special_tokens=["<|endoftext|>"])
            tok.train([sys.argv[2]], tr)
            return tok
        sec, tok = best_of(int(sys.argv[5]), train)
        tok.save(sys.argv[4])
        import json
        merges = len(json.load(open(sys.argv[4], encoding="utf-8"))["model"]["merges"])
        print(f"seconds {sec:.6f} merges {merges}")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
