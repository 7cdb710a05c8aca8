#!/usr/bin/env python3
"""tests/bpe_nfc_oracle.py — reference ids of byte-level BPE tokenizers with an NFC normalizer
(Qwen2's `"normalizer": {"type": "NFC"}`), from Hugging Face `tokenizers`, for tests/test_bpe.c.

    python3 tests/bpe_nfc_oracle.py DIR

Writes into DIR:
  corpus_NAME.txt     texts (UTF-8) where NFC changes things: accents written precomposed and
                      decomposed (e + U+0301 and é), Vietnamese with two marks in either order,
                      conjoining Hangul jamo and syllables followed by jamo, runs of combining
                      marks out of canonical order, singletons (U+212B ANGSTROM SIGN, U+2126 OHM
                      SIGN, CJK compatibility ideographs), composition exclusions (U+0958), marks
                      after special tokens ("<|endoftext|>" + U+0338: > + U+0338 would compose to
                      U+226F if the token's text were normalized with it), a normalized added
                      token written decomposed; "long" repeats them past 64 KiB, with and without
                      ASCII between (train/bpe_norm.c works in chunks ended before ASCII)
  tok_KIND.json       tokenizers trained here with BpeTrainer: nfc (GPT-2's ByteLevel split,
                      normalizers.NFC), qwen2 (Qwen2's Split pattern, ByteLevel without its regex,
                      NFC: Qwen2's layout), seq (normalizers.Sequence([NFC, NFC]))
  ids_KIND_NAME.u32   tokenizers' ids (little-endian uint32) of encode(text, add_special_tokens=False)
  dec_KIND_NAME.txt   tokenizers' decode of those ids (the NFC of the text, the added tokens
                      that are not normalized as written)
  manifest.txt        one line per case: KIND NAME
Also checks that NFC changes every corpus (else the test could not fail without the normalizer),
and that the normalized added token decodes to its NFC: tokenizers 0.23.1 made decode give a
normalized added token's normalized content (PR #1995); 0.22.x gave it as written, which
train/bpe.c no longer matches.
Exit status 0; 3 when tokenizers cannot be imported; 1 otherwise.
"""
import json
import os
import random
import sys
import unicodedata

try:
    import tokenizers
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
except ImportError as e:  # the C test reads this line
    print("bpe_nfc_oracle: missing Python package: %s" % e, file=sys.stderr)
    sys.exit(3)

QWEN2_RE = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
            r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIALS = ["<|endoftext|>", "<|im_start|>"]
NORMALIZED = "cafe\u0301 bar"  # an added token with normalized: true, matched as its NFC "café bar"

PIECES = [
    # French / German / Spanish, both spellings
    "café", "cafe\u0301", "naïve", "nai\u0308ve", "résumé", "re\u0301sume\u0301", "Ångström", "A\u030angstro\u0308m",
    "\u212bngstr\u00f6m", "mañana", "man\u0303ana", "Über", "U\u0308ber", "façade", "fac\u0327ade",
    # Vietnamese: precomposed, decomposed, and the two marks of ệ / ộ in either order
    "Tiếng Việt", "Tie\u0302\u0301ng Vie\u0323\u0302t", "Tie\u0302\u0301ng Vie\u0302\u0323t", "người", "ngu\u031bo\u031b\u0300i",
    "Hà Nội", "Ha\u0300 No\u0323\u0302i", "Ha\u0300 No\u0302\u0323i", "phở", "pho\u031b\u0309",
    # Hangul: syllables, conjoining jamo (L V, L V T), a syllable + T jamo, a lone V
    "한국어", "\u1112\u1161\u11ab\u1100\u116e\u11a8\u110b\u1165", "\u1100\u1161", "\uac00\u11a8", "\u1161\u11a8",
    # combining marks out of canonical order (220 after 230, 202 after 230), stacked zalgo
    "a\u0301\u0316", "a\u0316\u0301", "o\u0301\u0327\u0316", "Z\u0335\u0321a\u0336l\u0337g\u0338o\u0334",
    "q\u0307\u0323", "x\u0300\u0301\u0302",
    # singletons and compatibility ideographs (NFC changes them), an Ohm sign, a composition exclusion
    "\u2126 \u03a9", "\uf900\uf901 \u8c48\u66f4", "\u0958 \u0915\u093c", "\u1e9b\u0323", "\u0344",
    # not touched by NFC (NFKC would): full width, ligature, superscript
    "\uff21\uff22 \ufb01 x\u00b2",
    # a mark at the very start, marks after spaces, digits, newlines
    "\u0301start", " \u0301", "1\u0301", "\n\u0308", "\t\u0327",
    "=\u0338", "<\u0338", ">\u0338",
]

AROUND_SPECIALS = ["<|endoftext|>\u0338", "<|endoftext|>\u0301", "x<|im_start|>\u0308y", "\u0338<|endoftext|>",
                   NORMALIZED, "cafe\u0301 bar", "caf\u00e9 bar", "cafe\u0301 ba", "<|endoftext|>cafe\u0301 bar"]


def corpus(rng, n, pieces, ascii_gaps=True):
    out = []
    for _ in range(n):
        out.append(rng.choice(pieces))
        if ascii_gaps:
            out.append(rng.choice([" ", " ", "\n", ", ", ". ", "  ", "\r\n", " 42 ", ""]))
        else:
            out.append(rng.choice(["\u3000", "\u00a0", "", "\u2028", "。"]))
    return "".join(out)


def train(texts, pre_tokenizer, normalizer):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=600, min_frequency=2, special_tokens=SPECIALS,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=tr)
    tok.add_tokens([AddedToken(NORMALIZED, normalized=True, special=False)])
    return tok


def write_ids(path, ids):
    with open(path, "wb") as f:
        for i in ids:
            f.write(int(i).to_bytes(4, "little"))


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rng = random.Random(20261127)
    corpora = {
        "accents": corpus(rng, 3000, PIECES),
        "specials": corpus(rng, 800, PIECES + AROUND_SPECIALS),
        # past 64 KiB: chunks end before ASCII, or (no ASCII at all) the whole text is one chunk
        "long": corpus(rng, 40000, PIECES),
        "long_no_ascii": corpus(rng, 30000, [p for p in PIECES if all(ord(c) > 127 for c in p)], ascii_gaps=False),
    }
    for name, text in corpora.items():
        if unicodedata.normalize("NFC", text) == text:
            print("bpe_nfc_oracle: NFC leaves corpus %s as it is: the test could not see the normalizer" % name,
                  file=sys.stderr)
            return 1
        with open(os.path.join(out, "corpus_%s.txt" % name), "w", encoding="utf-8", newline="") as f:
            f.write(text)
    P, N = pre_tokenizers, normalizers
    train_texts = [corpora["accents"], corpora["specials"]]
    kinds = {
        "nfc": train(train_texts, P.ByteLevel(add_prefix_space=False), N.NFC()),
        "qwen2": train(train_texts, P.Sequence([P.Split(Regex(QWEN2_RE), behavior="isolated", invert=False),
                                                P.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                            use_regex=False)]), N.NFC()),
        "seq": train(train_texts, P.ByteLevel(add_prefix_space=False), N.Sequence([N.NFC(), N.NFC()])),
    }
    manifest = []
    for kind, tok in kinds.items():
        path = os.path.join(out, "tok_%s.json" % kind)
        tok.save(path)
        j = json.load(open(path, encoding="utf-8"))
        want = {"nfc": {"type": "NFC"}, "qwen2": {"type": "NFC"},
                "seq": {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "NFC"}]}}[kind]
        if j["normalizer"] != want:
            print("bpe_nfc_oracle: %s's normalizer is written %r, not %r" % (kind, j["normalizer"], want),
                  file=sys.stderr)
            return 1
        tok = Tokenizer.from_file(path)
        nid = tok.token_to_id(NORMALIZED)
        got = tok.decode([nid], skip_special_tokens=False)
        if got != unicodedata.normalize("NFC", NORMALIZED):
            print("bpe_nfc_oracle: tokenizers %s decodes the normalized added token %s to %s, not to its NFC: "
                  "decode gives the normalized content from tokenizers 0.23.1 on (PR #1995), which train/bpe.c "
                  "follows; install scripts/requirements-test.txt's pins (scripts/install-pydeps.sh)"
                  % (tokenizers.__version__, ascii(NORMALIZED), ascii(got)), file=sys.stderr)
            return 1
        for name, text in corpora.items():
            ids = tok.encode(text, add_special_tokens=False).ids
            back = tok.decode(ids, skip_special_tokens=False)
            if name != "specials" and back != unicodedata.normalize("NFC", text):
                print("bpe_nfc_oracle: %s does not decode %s to its NFC" % (kind, name), file=sys.stderr)
                return 1
            write_ids(os.path.join(out, "ids_%s_%s.u32" % (kind, name)), ids)
            with open(os.path.join(out, "dec_%s_%s.txt" % (kind, name)), "w", encoding="utf-8", newline="") as f:
                f.write(back)
            manifest.append("%s %s" % (kind, name))
    with open(os.path.join(out, "manifest.txt"), "w") as f:
        f.write("\n".join(manifest) + "\n")
    print("bpe_nfc_oracle: tokenizers %s, Python's unicodedata %s: %d cases in %s" %
          (tokenizers.__version__, unicodedata.unidata_version, len(manifest), out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
