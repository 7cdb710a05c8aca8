/*
 * test_hf_pipeline.c — transformers' text-generation pipeline on `tinymoe export` (issue 23:
 * "a text-generation pipeline works on the export"): greedy decoding there gives the text that
 * `tinymoe sample --temperature 0` prints from the same checkpoint and prompt, for a byte-level
 * model (export's own tokenizer files) and for a model trained through a tokenizer.json with
 * Qwen2's NFC normalizer, prompted with decomposed accents (AutoTokenizer must see the ids that
 * sample's tmd_prompt_tokens feeds the model: the NFC of the prompt).
 *
 * The continuation stays inside the model's window (seq_len 64): past it, sample keeps the last
 * half of the text (generate.h) and transformers goes on with longer positions, so the two would
 * part on purpose. tests/hf_pipeline_check.py runs the pipeline; it needs torch, transformers and
 * tokenizers. CI installs no torch (PyPI's Linux torch is the 7 GB CUDA build:
 * scripts/requirements-torch.txt), so torch is not under TM_REQUIRE_PYDEPS: without it the test
 * skips, saying how to run it, and fails only under TM_REQUIRE_TORCH=1, which the GPU machine's
 * run sets (tests/gpu/run.sh runs this test with its system python3, which has torch).
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bpe.h"
#include "child.h"
#include "common.h"
#include "tokenizer.h"

#define NEW_TOKENS 24

static void setup(void) { tt_tmpdir_make("tm_test_hfpipe_"); }
static void teardown(void) {
    tt_kill_children();
    tt_tmpdir_remove();
}
TestSuite(hf_pipeline, .init = setup, .fini = teardown);

/* Run argv (NULL-terminated); its exit code and output (stdout and stderr) in *out. */
static int run(char **out, const char *log, char *const *argv, int timeout) {
    int rc = tt_run((char **)argv, tt_path(log), timeout, NULL);
    long len;
    *out = (char *)tt_slurp(tt_path(log), &len);
    return rc;
}

static void write_file(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    cr_assert(f, "cannot write %s", path);
    cr_assert_eq(fwrite(p, 1, n, f), n);
    fclose(f);
}

/* tt_path of name + suffix */
static const char *at(const char *name, const char *suffix) {
    char n[256];
    snprintf(n, sizeof n, "%s%s", name, suffix);
    return tt_path(n);
}

/* One model: tokenize the corpus (through tok, or bytes), train, export; sample's greedy text
 * into *cont (what follows the prompt) and the prompt's ids into DIR/ids.u32. */
typedef struct model_case {
    const char *name, *tok, *prompt;
    char dir[4096], prompt_file[4096], ids_file[4096], out_file[4096];
    char *cont;
} model_case;

static void build_model(model_case *m, const char *corpus) {
    char bin[4096], val[4096], run_dir[4096], *out;
    snprintf(bin, sizeof bin, "%s", at(m->name, ".bin"));
    snprintf(val, sizeof val, "%s", at(m->name, "_val.bin"));
    snprintf(run_dir, sizeof run_dir, "%s", at(m->name, "_run"));
    snprintf(m->dir, sizeof m->dir, "%s", at(m->name, "_hf"));
    char *tk[] = {(char *)tt_tinymoe(), "tokenize", (char *)corpus, bin, "--val-fraction", "0.1",
                  m->tok ? "--tokenizer" : NULL, (char *)m->tok, NULL};
    cr_assert_eq(run(&out, "tok.log", tk, 60), 0, "%s", out);
    free(out);
    char *tr[] = {(char *)tt_tinymoe(), "train", "--preset", "tiny", "--data", bin, "--val_data", val, "--seq_len", "64",
                  "--steps", "60", "--lr", "0.02", "--threads", "2", "--eval_every", "0", "--progress", "lines",
                  "--out", run_dir, m->tok ? "--tokenizer" : NULL, (char *)m->tok, NULL};
    cr_assert_eq(run(&out, "train.log", tr, 120), 0, "%s", out);
    free(out);
    char *ex[] = {(char *)tt_tinymoe(), "export", "--ckpt", run_dir, "--out", m->dir, NULL};
    cr_assert_eq(run(&out, "export.log", ex, 60), 0, "%s", out);
    free(out);
    char ntok[16];
    snprintf(ntok, sizeof ntok, "%d", NEW_TOKENS);
    /* stdout alone (the summary line goes to stderr) */
    char *sa[] = {"/bin/sh", "-c", "f=$1; shift; exec \"$@\" 2>\"$f\"", "sh", (char *)tt_path("sample.err"),
                  (char *)tt_tinymoe(), "sample", "--ckpt", run_dir, "--prompt", (char *)m->prompt, "--tokens", ntok,
                  "--temperature", "0", NULL};
    int rc = tt_run(sa, tt_path("sample.out"), 60, NULL);
    long len;
    char *text = (char *)tt_slurp(tt_path("sample.out"), &len);
    char *err = (char *)tt_slurp(tt_path("sample.err"), &len);
    cr_assert_eq(rc, 0, "%s%s", text ? text : "", err ? err : "");
    /* stdout: the prompt as given, the continuation, a newline */
    size_t pl = strlen(m->prompt), tl = strlen(text);
    cr_assert(tl > pl && !memcmp(text, m->prompt, pl) && text[tl - 1] == '\n', "sample printed: %s", text);
    m->cont = strndup(text + pl, tl - pl - 1);
    cr_assert(strlen(m->cont) > 8, "%s: sample continued '%s' with only '%s'", m->name, m->prompt, m->cont);
    free(text);
    free(err);
    /* the ids sample fed the model, as tmd_prompt_tokens (sample.c) makes them */
    tmd_bpe *bpe = NULL;
    char e[2048];
    if (m->tok) cr_assert_eq(tmd_bpe_load(m->tok, &bpe, e, sizeof e), 0, "%s", e);
    int32_t *ids;
    int n;
    cr_assert_eq(tmd_prompt_tokens(bpe, m->prompt, bpe ? tmd_bpe_vocab_size(bpe) : 257, "prompt", &ids, &n, e, sizeof e),
                 0, "%s", e);
    unsigned char *le = malloc((size_t)n * 4 + 1);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < 4; k++) le[4 * i + k] = (unsigned char)((uint32_t)ids[i] >> (8 * k));
    snprintf(m->ids_file, sizeof m->ids_file, "%s", at(m->name, "_ids.u32"));
    write_file(m->ids_file, le, (size_t)n * 4);
    free(le);
    free(ids);
    tmd_bpe_free(bpe);
    snprintf(m->prompt_file, sizeof m->prompt_file, "%s", at(m->name, "_prompt.txt"));
    write_file(m->prompt_file, m->prompt, pl);
    snprintf(m->out_file, sizeof m->out_file, "%s", at(m->name, "_pipeline.txt"));
}

/* How to run the test where it skips (the message of a skip, and of a failure under
 * TM_REQUIRE_TORCH=1). */
#define HOW_TO_RUN                                                                           \
    "tests/gpu/run.sh runs it on the GPU machine; here: TM_TORCH=pypi scripts/install-pydeps.sh " \
    "(7 GB), or TM_PYTHON=a python3 that has them"

Test(hf_pipeline, greedy_generation_is_tinymoe_samples) {
    TT_WATCHDOG(600);
    const char *py = tt_python_with_req("torch, transformers, tokenizers", "TM_REQUIRE_TORCH", HOW_TO_RUN);
    if (!py)
        cr_skip_test("no Python with torch, transformers and tokenizers (torch is not under "
                     "TM_REQUIRE_PYDEPS: CI has none): " HOW_TO_RUN);
    /* ASCII for the byte-level model (a byte continuation cut inside a character would decode to
     * U+FFFD in transformers and to its bytes in sample); accents, precomposed, for the BPE one */
    char ascii[4096], accents[4096];
    snprintf(ascii, sizeof ascii, "%s", tt_path("ascii.txt"));
    snprintf(accents, sizeof accents, "%s", tt_path("accents.txt"));
    FILE *a = fopen(ascii, "w"), *b = fopen(accents, "w");
    for (int i = 0; i < 400; i++) {
        fputs("the cat sat on the mat. the dog ate the bone. ", a);
        fputs("le caf\xc3\xa9 est pr\xc3\xa8s de la gare. l'\xc3\xa9t\xc3\xa9 \xc3\xa0 Hu\xe1\xba\xbf, ", b);
    }
    fclose(a);
    fclose(b);
    char tok[4096], *out;
    snprintf(tok, sizeof tok, "%s", tt_path("nfc_tokenizer.json"));
    char *mk[] = {(char *)py, "tests/hf_pipeline_check.py", "tokenizer", accents, tok, NULL};
    cr_assert_eq(run(&out, "mk.log", mk, 120), 0, "%s", out);
    free(out);
    model_case m[2] = {
        {.name = "bytes", .tok = NULL, .prompt = "the cat"},
        /* "le cafe" + U+0301, "pre" + U+0300 "s": NFC makes them the trained "café", "près" */
        {.name = "nfc", .tok = tok, .prompt = "le cafe\xcc\x81 est pre\xcc\x80s"},
    };
    build_model(&m[0], ascii);
    build_model(&m[1], accents);
    char n[16];
    snprintf(n, sizeof n, "%d", NEW_TOKENS);
    char *gen[] = {(char *)py,         "tests/hf_pipeline_check.py", "generate",        n,
                   m[0].dir,           m[0].prompt_file,             m[0].ids_file,     m[0].out_file,
                   m[1].dir,           m[1].prompt_file,             m[1].ids_file,     m[1].out_file,
                   NULL};
    int rc = run(&out, "pipeline.log", gen, 500);
    cr_assert_eq(rc, 0, "tests/hf_pipeline_check.py (exit %d):\n%s", rc, out);
    cr_log_info("%s", out);
    free(out);
    for (int i = 0; i < 2; i++) {
        long len;
        char *p = (char *)tt_slurp(m[i].out_file, &len);
        cr_assert(p, "%s: no pipeline output", m[i].name);
        cr_assert(strlen(m[i].cont) == (size_t)len && !memcmp(p, m[i].cont, (size_t)len),
                  "%s: the pipeline continues '%s' with '%s', tinymoe sample with '%s'", m[i].name, m[i].prompt, p,
                  m[i].cont);
        free(p);
        free(m[i].cont);
    }
}
