#!/usr/bin/env python3
"""tests/hf_pipeline_check.py — transformers' text-generation pipeline on `tinymoe export`
directories, for tests/test_hf_pipeline.c (needs torch and transformers: the GPU machine's
python3, or TM_TORCH=pypi scripts/install-pydeps.sh).

    python3 tests/hf_pipeline_check.py tokenizer CORPUS OUT.json
        trains a byte-level BPE tokenizer with an NFC normalizer (Qwen2's layout: normalizers.NFC,
        ByteLevel) on CORPUS with tokenizers' BpeTrainer (400 tokens, <|endoftext|>)
    python3 tests/hf_pipeline_check.py generate N DIR PROMPT IDS OUT [DIR PROMPT IDS OUT ...]
        for each export DIR: AutoTokenizer's ids of the text in file PROMPT must be the ones in
        IDS (little-endian uint32: what `tinymoe sample` feeds the model, written by the C test);
        then pipeline("text-generation", model=DIR) continues it greedily (do_sample=False,
        max_new_tokens=N, return_full_text=False) and the text goes to OUT (UTF-8)

Exit status 0; 3 when torch, transformers or tokenizers cannot be imported; 1 otherwise.
"""
import os
import sys


def make_tokenizer(corpus, out):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([corpus], trainer=tr)
    tok.save(out)
    return 0


def generate(n, cases):
    import torch  # noqa: F401  (the pipeline's backend; imported here so a missing one exits 3)
    import transformers
    from transformers import AutoTokenizer, pipeline
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    failed = 0
    for d, prompt_path, ids_path, out_path in cases:
        with open(prompt_path, encoding="utf-8", newline="") as f:
            prompt = f.read()
        with open(ids_path, "rb") as f:
            b = f.read()
        want = [int.from_bytes(b[i:i + 4], "little") for i in range(0, len(b), 4)]
        tok = AutoTokenizer.from_pretrained(d)
        got = tok(prompt)["input_ids"]
        if got != want:
            print("hf_pipeline_check: %s: AutoTokenizer encodes the prompt %r to %s, tinymoe sample to %s" %
                  (d, prompt, got, want), file=sys.stderr)
            failed += 1
            continue
        gen = pipeline("text-generation", model=d, tokenizer=tok, device="cpu")
        text = gen(prompt, do_sample=False, max_new_tokens=n, return_full_text=False)[0]["generated_text"]
        with open(out_path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        print("hf_pipeline_check: %s: %d prompt ids, continuation %r" % (os.path.basename(d), len(got), text))
    print("hf_pipeline_check: torch %s, transformers %s" % (sys.modules["torch"].__version__, transformers.__version__))
    return 1 if failed else 0


def main():
    a = sys.argv[1:]
    try:
        if a[:1] == ["tokenizer"] and len(a) == 3:
            import tokenizers  # noqa: F401
        elif a[:1] == ["generate"] and len(a) >= 6 and (len(a) - 2) % 4 == 0:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except ImportError as e:  # the C test reads this line
        print("hf_pipeline_check: missing Python package: %s" % e, file=sys.stderr)
        return 3
    if a[0] == "tokenizer":
        return make_tokenizer(a[1], a[2])
    return generate(int(a[1]), [a[i:i + 4] for i in range(2, len(a), 4)])


if __name__ == "__main__":
    sys.exit(main())
