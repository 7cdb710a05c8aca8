/* test_side.c — the bookkeeping of collectives started beside the work (framework/side.c), on
 * the CPU backend, whose side stream's events have happened at once: what it checks is where
 * the work waits and that memory a side collective uses is never given back before that. A
 * world of one rank (no mpirun): the context has a communicator with overlap on, so
 * tm__coll_side_on holds for host memory, as on CPU ranks. The chunked MoE layer's use of it
 * (every all-to-all beside the work, none waited for early, values bit for bit those of overlap
 * off) is checked on 2 and 4 ranks by tests/dist/dist_helper.c (check_chunked_layer). */
#include <string.h>

#include "common.h"
#include "comm.h"

static tm_ctx *side_ctx(int overlap) {
    tm_ctx *ctx = NULL;
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    cr_assert_eq(tm_ctx_new(&ctx, &o), TM_OK);
    tm_comm_options co = tm_comm_options_default();
    co.overlap = overlap;
    cr_assert_eq(tm_comm_init(ctx, &co), TM_OK, "%s", tm_ctx_errmsg(ctx));
    return ctx;
}

static tm_tensor *vec(tm_ctx *ctx) {
    int64_t n = 16;
    tm_tensor *t;
    cr_assert_eq(tm__tensor_new(ctx, TM_F32, 1, &n, tm_cpu(), &t), TM_OK);
    return t;
}

/* An entry as an op makes it: side_begin, (the collective), side_end's event. */
static void add(tm_ctx *ctx, tm_tensor *result, tm_tensor *use, tm_tensor *own) {
    void *ev = NULL;
    cr_assert_eq(tm__coll_side_begin(ctx, tm_cpu()), TM_OK);
    cr_assert_eq(tm__coll_side_end(ctx, tm_cpu(), &ev), TM_OK);
    cr_assert_not_null(ev, "CPU ranks with overlap on: the side stream's event is a real one");
    cr_assert_eq(tm__side_add(ctx, tm_cpu(), ev, result, &use, use ? 1 : 0, &own, own ? 1 : 0), TM_OK, "%s",
                 tm_ctx_errmsg(ctx));
}

static int64_t early(tm_ctx *ctx) {
    tm_comm_stats s;
    cr_assert_eq(tm_comm_get_stats(ctx, &s), TM_OK);
    return s.beside_early;
}

/* The planned order: the reader waits (tm__side_wait), then the memory goes back; no early wait. */
Test(side, reader_waits_then_memory_goes_back) {
    tm_ctx *ctx = side_ctx(1);
    cr_assert(tm__coll_side_on(ctx, tm_cpu()));
    tm_tensor *a = vec(ctx), *b = vec(ctx), *own = vec(ctx);
    add(ctx, b, a, own);
    cr_assert_eq(tm__side_pending(ctx), 1);
    cr_assert_eq(tm__side_wait(ctx, a), TM_OK); /* a is read, not written, by it: nothing to wait */
    cr_assert_eq(tm__side_pending(ctx), 1);
    cr_assert_eq(tm__side_wait(ctx, b), TM_OK);
    cr_assert_eq(tm__side_pending(ctx), 0);
    cr_assert_null(own->storage->data, "what the entry owned went back once it was waited for");
    tm__tensor_release(ctx, a);
    tm__tensor_release(ctx, b);
    cr_assert_eq(early(ctx), 0);
    tm_ctx_free(ctx);
}

/* Memory given back while a side collective still uses it (tm__tensor_release, or the close of
 * the kernel scope that took it: ZeRO-3's bug on 2 H100s) is waited for first and counted, and
 * an op reading its result waits first too. */
Test(side, early_release_waits_first_and_is_counted) {
    tm_ctx *ctx = side_ctx(1);
    tm_tensor *a = vec(ctx), *b = vec(ctx);
    add(ctx, b, a, NULL);
    tm__tensor_release(ctx, a);
    cr_assert_eq(tm__side_pending(ctx), 0);
    cr_assert_eq(early(ctx), 1);

    /* scratch of a kernel scope */
    int mark = tm__scope_open(ctx);
    tm_tensor *t = vec(ctx);
    add(ctx, NULL, t, NULL);
    tm__scope_close(ctx, mark, NULL, 0);
    cr_assert_eq(tm__side_pending(ctx), 0);
    cr_assert_eq(early(ctx), 2);

    /* the same scratch taken out of the scope: it outlives the close, the entry gives it back */
    mark = tm__scope_open(ctx);
    t = vec(ctx);
    add(ctx, NULL, t, t);
    tm__scope_forget(ctx, t);
    tm__scope_close(ctx, mark, NULL, 0);
    cr_assert_eq(tm__side_pending(ctx), 1);
    cr_assert_not_null(t->storage->data);
    cr_assert_eq(tm__side_finish_all(ctx), TM_OK);
    cr_assert_null(t->storage->data);
    cr_assert_eq(early(ctx), 2);

    /* an op reading a result waits for it */
    tm_tensor *c = vec(ctx), *d;
    add(ctx, c, b, NULL);
    cr_assert_eq(tm_scale(ctx, c, 2.0, &d), TM_OK);
    cr_assert_eq(tm__side_pending(ctx), 0);
    cr_assert_eq(early(ctx), 2);
    tm_ctx_free(ctx);
}

/* Memory that went back on a path that does not pass through the net: the entry's finish says
 * so (TM_ERR_INTERNAL) instead of letting the transfer write a block handed out again. */
Test(side, memory_lost_behind_its_back_is_an_error) {
    tm_ctx *ctx = side_ctx(1);
    tm_tensor *a = vec(ctx), *b = vec(ctx);
    add(ctx, b, a, NULL);
    a->storage->data = NULL; /* as a free that skipped tm__tensor_release */
    tm_status s = tm__side_finish_all(ctx);
    cr_assert_eq(s, TM_ERR_INTERNAL);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "given back before the collective was waited for"), "%s", tm_ctx_errmsg(ctx));
    tm_ctx_free(ctx);
}

/* Overlap off: nothing is beside the work (the collectives run in place). */
Test(side, overlap_off_has_no_side_stream) {
    tm_ctx *ctx = side_ctx(0);
    cr_assert_not(tm__coll_side_on(ctx, tm_cpu()));
    void *ev = (void *)1;
    cr_assert_eq(tm__coll_side_begin(ctx, tm_cpu()), TM_OK);
    cr_assert_eq(tm__coll_side_end(ctx, tm_cpu(), &ev), TM_OK);
    cr_assert_null(ev);
    tm_ctx_free(ctx);
}
