"""Oracle of tests/test_bpe_train.c (export_autotokenizer_encodes_like_tinymoe): transformers'
AutoTokenizer loads the directory that `tinymoe export` wrote for a model trained with a
`tokenize --bpe` tokenizer (tokenizer.json, tokenizer_config.json, generation_config.json),
encodes each text to exactly the ids `tinymoe tokenize` wrote for it (llm.c's header of 256
int32, then uint16 or uint32 ids, end-of-text last), decodes them back to the text, and takes
tinymoe's end-of-text id as its eos token, as generation_config.json does.

    python3 tests/bpe_export_check.py EXPORT_DIR TEXT_FILE TOKEN_FILE [TEXT_FILE TOKEN_FILE ...]
"""
import json
import os
import struct
import sys

from transformers import AutoTokenizer

d = sys.argv[1]
at = AutoTokenizer.from_pretrained(d)
gen = json.load(open(os.path.join(d, "generation_config.json")))
errors, n_ids = [], 0
for text_path, bin_path in zip(sys.argv[2::2], sys.argv[3::2]):
    text = open(text_path, encoding="utf-8", newline="").read()  # "\r\n" stays
    raw = open(bin_path, "rb").read()
    magic, version, n = struct.unpack("<3i", raw[:12])
    width = 2 if version == 1 else 4
    ids = list(struct.unpack(f"<{n}{'H' if width == 2 else 'I'}", raw[1024:1024 + n * width]))
    body, eot = ids[:-1], ids[-1]
    if at.eos_token_id != eot or gen.get("eos_token_id") != eot:
        errors.append(f"{bin_path}: end-of-text {eot}, AutoTokenizer's eos {at.eos_token_id}, "
                      f"generation_config's {gen.get('eos_token_id')}")
    got = at(text, add_special_tokens=False)["input_ids"]
    if got != body:
        i = next((i for i, (a, b) in enumerate(zip(got, body)) if a != b), min(len(got), len(body)))
        errors.append(f"{text_path}: AutoTokenizer's ids differ from tinymoe's at {i}: {got[i:i + 8]} against "
                      f"{body[i:i + 8]} ({len(got)} against {len(body)} ids)")
    back = at.decode(body)
    if back != text:
        i = next((i for i, (a, b) in enumerate(zip(back, text)) if a != b), min(len(back), len(text)))
        errors.append(f"{text_path}: AutoTokenizer decodes tinymoe's ids to other text at character {i}: "
                      f"{back[i:i + 20]!r} against {text[i:i + 20]!r}")
    n_ids += len(ids)
if errors:
    print("\n".join(errors))
    sys.exit(1)
print(f"ok: AutoTokenizer ({type(at).__name__}, vocabulary {len(at)}) encodes {len(sys.argv[2:]) // 2} texts to "
      f"tinymoe's {n_ids} ids, decodes them back, eos {at.eos_token_id}")
