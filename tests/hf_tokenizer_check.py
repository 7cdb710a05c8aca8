"""Oracle of tests/test_hf_tokenizer.c: the `tokenizers` library (and transformers' AutoTokenizer
when transformers is installed) loads the tokenizer files that `tinymoe export` writes beside a
byte-level model, and encodes every text to its UTF-8 bytes, as `tinymoe tokenize` does
(ids 0..255), decodes them back, and knows end-of-text as id 256.

    python3 tests/hf_tokenizer_check.py EXPORT_DIR [TEXT_FILE]
Exit 0 with one "ok: ..." line, 1 with the differences.
"""
import json
import os
import sys

from tokenizers import Tokenizer

d = sys.argv[1]
texts = [
    "Hello, world!",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n",
    "  leading and   inner   whitespace\t\ttabs\r\nCRLF  ",
    "naïve café, Größe, Ελληνικά, русский, 日本語のテキスト, العربية",
    "emoji 😀🎉👩‍👩‍👧 and symbols ∑ ∫ → ≠ ©®",
    "numbers 0123456789 3.14159 1e-9 -42",
    "code: int main(void) { return a[i] << 2 | b ^ ~c; } // \"quoted\" 'single' \\back\\slash",
    "control \x01\x02\x1f\x7f bytes",
    "",
]
if len(sys.argv) > 2:
    texts.append(open(sys.argv[2], encoding="utf-8").read())

tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
errors = []
if tok.get_vocab_size(with_added_tokens=True) != 257:
    errors.append(f"vocabulary of {tok.get_vocab_size(with_added_tokens=True)}, expected 257")
if tok.token_to_id("<|endoftext|>") != 256:
    errors.append(f"<|endoftext|> is {tok.token_to_id('<|endoftext|>')}, expected 256")
n_bytes = 0
for t in texts:
    want = list(t.encode("utf-8"))
    got = tok.encode(t, add_special_tokens=False).ids
    if got != want:
        errors.append(f"encode({t[:40]!r}...): {got[:20]} != bytes {want[:20]}")
    back = tok.decode(want + [256], skip_special_tokens=True)
    if back != t:
        errors.append(f"decode of the bytes of {t[:40]!r}: {back[:40]!r}")
    n_bytes += len(want)
# every id is one token of its own (lone bytes >= 0x80 are no UTF-8 text to encode)
for b in range(257):
    t = tok.id_to_token(b)
    if t is None or tok.token_to_id(t) != b:
        errors.append(f"id {b}: token {t!r} maps back to {tok.token_to_id(t) if t else None}")
cfg = json.load(open(os.path.join(d, "generation_config.json")))
if cfg.get("eos_token_id") != 256:
    errors.append(f"generation_config.json eos_token_id {cfg.get('eos_token_id')}")
checked = "tokenizers"
try:
    from transformers import AutoTokenizer
except ImportError:
    AutoTokenizer = None
if AutoTokenizer is not None:
    at = AutoTokenizer.from_pretrained(d)
    if at.eos_token_id != 256:
        errors.append(f"AutoTokenizer eos_token_id {at.eos_token_id}")
    for t in texts:
        if at(t, add_special_tokens=False)["input_ids"] != list(t.encode("utf-8")):
            errors.append(f"AutoTokenizer encodes {t[:40]!r} differently")
    checked += " and transformers' AutoTokenizer"
if errors:
    print("\n".join(errors))
    sys.exit(1)
print(f"ok: {checked} encode {len(texts)} texts ({n_bytes} bytes) to their bytes and decode them back")
