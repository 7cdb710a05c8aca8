"""Oracle of tests/test_bpe_train.c: the `tokenizers` library loads the tokenizer.json that
`tinymoe tokenize --bpe N` trained and encodes the text to exactly the ids that tinymoe wrote
(the token file: llm.c's header of 256 int32, then uint16 or uint32 ids, end-of-text last), and
decodes them back to the text.

    python3 tests/bpe_train_check.py TOKENIZER_JSON TEXT_FILE TOKEN_FILE
"""
import struct
import sys

from tokenizers import Tokenizer

tok = Tokenizer.from_file(sys.argv[1])
text = open(sys.argv[2], encoding="utf-8").read()
raw = open(sys.argv[3], "rb").read()
magic, version, n = struct.unpack("<3i", raw[:12])
width = 2 if version == 1 else 4
ids = list(struct.unpack(f"<{n}{'H' if width == 2 else 'I'}", raw[1024:1024 + n * width]))
eot = tok.token_to_id("<|endoftext|>")
want = tok.encode(text, add_special_tokens=False).ids + [eot]
errors = []
if ids != want:
    first = next(i for i in range(min(len(ids), len(want))) if ids[i] != want[i]) if ids[:len(want)] != want[:len(ids)] else min(len(ids), len(want))
    errors.append(f"ids differ from index {first}: tinymoe {ids[first:first + 8]}, tokenizers {want[first:first + 8]} "
                  f"({len(ids)} against {len(want)} ids)")
if tok.decode(want[:-1], skip_special_tokens=False) != text:
    errors.append("decoding the ids does not give the text back")
if errors:
    print("\n".join(errors))
    sys.exit(1)
print(f"ok: {len(ids)} ids identical (vocabulary {tok.get_vocab_size()}, end-of-text {eot}), text decoded back")
