/*
 * side.c — collectives that ops started beside the work (comm.h, tm__coll_side_*) and that are
 * finished later: the MoE layer's chunked all-to-alls (layers/moe.c, overlap_chunks) in their
 * forward and backward (ops/comm.c, the all-to-all's side form). ZeRO-3 keeps its own lists
 * (fsdp.c); both follow the same two rules:
 *  - a tensor a side collective writes (`result`) is read by the work only after the work
 *    stream waited for the collective's event: whoever reads it first calls tm__side_wait
 *    (moe.c before a chunk's experts and before the unpermute; tm__op_run for any op's
 *    inputs; autograd.c for a node's upstream and input gradients before its backward);
 *  - memory a side collective reads or writes (`use`) is not given back before the work waited
 *    for it: the arena hands a block out again in the work stream's order only, so a block
 *    freed while the side stream still moves it would be overwritten under the transfer. The
 *    entry holds what the op would otherwise have freed (`own`: the upstream gradient taken off
 *    the tape, a scratch buffer taken out of the kernel's scope) and gives it back when done.
 * Safety net: tm__tensor_release and the kernel scope's close (arena.c) call tm__side_release
 * first, which finishes (waits for) the entries using the storage about to be given back, and
 * counts it in tm_comm_stats.beside_early: correct, but the overlap was lost there, so the
 * tests require 0. When an entry is finished, every storage it used must still hold the block
 * it held when the collective started (TM_ERR_INTERNAL otherwise: memory went back on a path
 * that does not pass through the net).
 * Entries that are done by now (event_query, no wait) are finished whenever a new one is
 * added, so the memory they hold goes back as early as the host sees they are done. On the CPU
 * (collectives block, the side stream's events have happened at once) the same entries are
 * made, waited for and checked at the same points, so the CPU ranks run this bookkeeping.
 */
#include "comm.h"

enum { SIDE_USE = 3, SIDE_OWN = 2 };

typedef struct side_job {
    void *ev;
    tm_device dev;
    tm_tensor *result;           /* written beside the work; NULL: none */
    tm_tensor *use[SIDE_USE];    /* memory it moves (result among them) */
    void *use_p[SIDE_USE];       /* their storages' blocks when it started */
    tm_tensor *own[SIDE_OWN];    /* given back once it is done */
} side_job;

struct tm__side {
    side_job *j;
    int n, cap;
};

static int uses(const side_job *j, const tm__storage *st) {
    for (int k = 0; k < SIDE_USE; k++)
        if (j->use[k] && j->use[k]->storage == st) return 1;
    return 0;
}

/* Entry i: the work stream waits for it, its lifetimes are checked, what it owns goes back. */
static tm_status finish(tm_ctx *ctx, int i) {
    struct tm__side *s = ctx->side;
    side_job j = s->j[i];
    s->j[i] = s->j[--s->n]; /* order does not matter: each entry is waited for by itself */
    tm_status st = tm__coll_event_wait(ctx, j.dev, j.ev);
    for (int k = 0; k < SIDE_USE && st == TM_OK; k++)
        if (j.use[k] && (!j.use[k]->storage || j.use[k]->storage->data != j.use_p[k]))
            st = tm__err(ctx, TM_ERR_INTERNAL,
                         "collective beside the work: buffer %d %s was given back before the collective was waited for "
                         "(its memory could have been handed out again under the transfer)",
                         k, tm__tdesc(ctx, j.use[k]));
    for (int k = 0; k < SIDE_OWN; k++)
        if (j.own[k]) tm__tensor_release(ctx, j.own[k]);
    return st;
}

/* Finish the entries that are done by now (a host poll: nothing waits). */
static tm_status poll(tm_ctx *ctx) {
    struct tm__side *s = ctx->side;
    tm_status r = TM_OK;
    for (int i = 0; s && i < s->n;) {
        if (tm__coll_event_done(ctx, s->j[i].dev, s->j[i].ev)) {
            tm_status f = finish(ctx, i);
            if (r == TM_OK) r = f;
        } else {
            i++;
        }
    }
    return r;
}

tm_status tm__side_add(tm_ctx *ctx, tm_device dev, void *ev, tm_tensor *result, tm_tensor *const *use, int n_use,
                       tm_tensor *const *own, int n_own) {
    if (n_use > SIDE_USE - 1 || n_own > SIDE_OWN) {
        (void)tm__coll_event_wait(ctx, dev, ev);
        return tm__err(ctx, TM_ERR_INTERNAL, "tm__side_add: %d buffers and %d owned (at most %d and %d)", n_use, n_own,
                       SIDE_USE - 1, SIDE_OWN);
    }
    if (!ctx->side) {
        ctx->side = tm__host_alloc(ctx, sizeof *ctx->side);
        if (!ctx->side) {
            (void)tm__coll_event_wait(ctx, dev, ev);
            return tm__err(ctx, TM_ERR_NOMEM, "collective beside the work: out of host memory");
        }
        memset(ctx->side, 0, sizeof *ctx->side);
    }
    struct tm__side *s = ctx->side;
    tm_status ps = poll(ctx);
    if (ps != TM_OK) { /* the contract: on failure the new event has been waited for */
        (void)tm__coll_event_wait(ctx, dev, ev);
        return ps;
    }
    if (s->n == s->cap) {
        int nc = s->cap ? 2 * s->cap : 16;
        side_job *nj = tm__host_alloc(ctx, sizeof *nj * (size_t)nc);
        if (!nj) {
            (void)tm__coll_event_wait(ctx, dev, ev);
            return tm__err(ctx, TM_ERR_NOMEM, "collective beside the work: out of host memory");
        }
        if (s->n) memcpy(nj, s->j, sizeof *nj * (size_t)s->n);
        tm__host_free(ctx, s->j);
        s->j = nj;
        s->cap = nc;
    }
    side_job *j = &s->j[s->n++];
    memset(j, 0, sizeof *j);
    j->ev = ev;
    j->dev = dev;
    j->result = result;
    int k = 0;
    if (result) j->use[k++] = result;
    for (int i = 0; i < n_use; i++) j->use[k++] = use[i];
    for (int i = 0; i < k; i++) j->use_p[i] = j->use[i]->storage ? j->use[i]->storage->data : NULL;
    for (int i = 0; i < n_own; i++) j->own[i] = own[i];
    return TM_OK;
}

tm_status tm__side_wait(tm_ctx *ctx, const tm_tensor *t) {
    struct tm__side *s = ctx->side;
    if (!s || !s->n || !t || !t->storage) return TM_OK;
    tm_status r = TM_OK;
    for (int i = 0; i < s->n;) {
        if (s->j[i].result && s->j[i].result->storage == t->storage) {
            tm_status f = finish(ctx, i);
            if (r == TM_OK) r = f;
        } else {
            i++;
        }
    }
    return r;
}

void tm__side_release(tm_ctx *ctx, const tm__storage *st) {
    struct tm__side *s = ctx->side;
    if (!s || !s->n || !st) return;
    for (int i = 0; i < s->n;) {
        if (!uses(&s->j[i], st)) {
            i++;
            continue;
        }
        if (ctx->comm) ctx->comm->stats.beside_early++;
        /* a failure here has no caller to report to: the next wait of the stream reports it */
        (void)finish(ctx, i);
    }
}

int tm__side_pending(const tm_ctx *ctx) { return ctx->side ? ctx->side->n : 0; }

tm_status tm__side_finish_all(tm_ctx *ctx) {
    struct tm__side *s = ctx->side;
    tm_status r = TM_OK;
    while (s && s->n) {
        tm_status f = finish(ctx, s->n - 1);
        if (r == TM_OK) r = f;
    }
    return r;
}

void tm__side_free(tm_ctx *ctx) {
    if (!ctx->side) return;
    (void)tm__side_finish_all(ctx);
    tm__host_free(ctx, ctx->side->j);
    tm__host_free(ctx, ctx->side);
    ctx->side = NULL;
}
