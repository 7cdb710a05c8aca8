/*
 * mpi.c — the mpi engine (framework/comm.h): collectives on host memory through Open MPI (any
 * MPI-3 library), and the process-wide tm_mpi_init / _finalize / _abort.
 *
 * Groups are communicators split from the world: ep by world rank / P, expert_dp by world rank
 * % P, each ordered by world rank (so group rank r is the r-th member in world order). Every
 * communicator returns errors (MPI_ERRORS_RETURN) instead of aborting the process: the library
 * never exits.
 *
 * Every collective is the non-blocking MPI-3 call (MPI_Iallreduce, MPI_Iallgatherv,
 * MPI_Ireduce_scatter_block, MPI_Ialltoallv, MPI_Ibcast, MPI_Ibarrier) completed by polling
 * MPI_Test, so that a peer that died or stopped answering turns into TM_ERR_COMM after the
 * communicator's timeout instead of a hang. Polling yields the core after a short spin: ranks
 * are often oversubscribed (tests run 4 ranks on 2 cores) and MPI progresses only inside its
 * calls. The algorithm a collective uses depends only on the communicator and the message size,
 * so results repeat bit for bit.
 *
 * MPI has no bfloat16: bf16 moves as 16-bit integers, and bf16 sums are taken in f32 on host
 * copies and rounded once (as the CPU kernels treat bf16 everywhere).
 */
#include <mpi.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "comm.h"

typedef struct mpi_state {
    MPI_Comm comm[TM_COMM_NGROUPS];
} mpi_state;

/* Set by tm_mpi_init when it initialised MPI (so that tm_mpi_finalize finalises only then):
 * the process-wide state the header warns about. */
static int g_we_initialised;

static int launched_world_size(void) {
    const char *vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"};
    for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return atoi(v) > 0 ? atoi(v) : 1;
    }
    return getenv("PMIX_RANK") ? 2 : 0; /* launched, size unknown until MPI_Init */
}

tm_status tm_mpi_init(int *argc, char ***argv, int *world_size) {
    if (world_size) *world_size = 1;
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (fin) return TM_ERR_COMM;
    if (!init) {
        if (!launched_world_size()) return TM_OK;
        int provided = 0;
        if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) return TM_ERR_COMM;
        g_we_initialised = 1;
    }
    int n = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (world_size) *world_size = n;
    return TM_OK;
}

void tm_mpi_finalize(void) {
    int fin = 0;
    MPI_Finalized(&fin);
    if (g_we_initialised && !fin) MPI_Finalize();
    g_we_initialised = 0;
}

void tm_mpi_abort(int code) {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (init && !fin) MPI_Abort(MPI_COMM_WORLD, code);
}

static int mpi_live(void) {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    return init && !fin;
}

int tm_mpi_world_rank(void) {
    int r = 0;
    if (mpi_live()) MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
}

int tm_mpi_world_size(void) {
    int n = 1;
    if (mpi_live()) MPI_Comm_size(MPI_COMM_WORLD, &n);
    return n;
}

static tm_status mpi_fail(tm__comm *c, const char *what, int g, int rc) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) snprintf(msg, sizeof msg, "MPI error %d", rc);
    return tm__err(c->ctx, TM_ERR_COMM, "%s over %s failed: %s", what, tm__comm_gdesc(c, g), msg);
}

static void mpi_state_free(tm__comm *c) {
    mpi_state *m = c->mpi;
    if (!m) return;
    int fin = 0;
    MPI_Finalized(&fin);
    for (int g = 0; g < TM_COMM_NGROUPS && !fin; g++)
        if (m->comm[g] != MPI_COMM_NULL) MPI_Comm_free(&m->comm[g]);
    tm__host_free(c->ctx, m);
    c->mpi = NULL;
}

tm_status tm__mpi_comm_create(tm__comm *c, const void *world) {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (!init || fin) {
        if (world) return tm__err(c->ctx, TM_ERR_STATE, "tm_comm_init: mpi_comm given but MPI is not initialised");
        return TM_ERR_STATE;
    }
    mpi_state *m = tm__host_alloc(c->ctx, sizeof *m);
    if (!m) return tm__err(c->ctx, TM_ERR_NOMEM, "tm_comm_init: out of host memory");
    for (int g = 0; g < TM_COMM_NGROUPS; g++) m->comm[g] = MPI_COMM_NULL;
    c->mpi = m;
    MPI_Comm base = world ? *(const MPI_Comm *)world : MPI_COMM_WORLD;
    int rc = MPI_Comm_dup(base, &m->comm[TM_COMM_WORLD]);
    if (rc != MPI_SUCCESS) {
        mpi_state_free(c);
        return tm__err(c->ctx, TM_ERR_COMM, "tm_comm_init: MPI_Comm_dup failed (%d)", rc);
    }
    MPI_Comm w = m->comm[TM_COMM_WORLD];
    MPI_Comm_set_errhandler(w, MPI_ERRORS_RETURN);
    MPI_Comm_rank(w, &c->world_rank);
    MPI_Comm_size(w, &c->world_size);
    int P = c->opts.ep_size;
    if (P < 1 || c->world_size % P) return TM_OK; /* tm_comm_init reports it (after freeing) */
    rc = MPI_Comm_dup(w, &m->comm[TM_COMM_DP]);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_split(w, c->world_rank / P, c->world_rank, &m->comm[TM_COMM_EP]);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_split(w, c->world_rank % P, c->world_rank, &m->comm[TM_COMM_EXPERT_DP]);
    if (rc != MPI_SUCCESS) {
        mpi_state_free(c);
        return tm__err(c->ctx, TM_ERR_COMM, "tm_comm_init: splitting the groups failed (MPI error %d)", rc);
    }
    for (int g = 1; g < TM_COMM_NGROUPS; g++) MPI_Comm_set_errhandler(m->comm[g], MPI_ERRORS_RETURN);
    return TM_OK;
}

static MPI_Datatype mpi_type(tm_dtype dt) {
    switch (dt) {
    case TM_F32: return MPI_FLOAT;
    case TM_F64: return MPI_DOUBLE;
    case TM_I32: return MPI_INT32_T;
    case TM_I64: return MPI_INT64_T;
    case TM_BF16: return MPI_UINT16_T;
    default: return MPI_UINT8_T;
    }
}

static void pause_briefly(int spins, double waited) {
    if (spins < 64) return;
    if (waited < 2e-3) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, waited < 0.1 ? 20000 : 200000};
    nanosleep(&ts, NULL);
}

/* Complete a started collective, or fail after the timeout naming it. */
static tm_status wait_for(tm__comm *c, MPI_Request *req, const char *what, int g, size_t bytes) {
    double t0 = tm__now(), timeout = c->opts.timeout_s;
    for (int spins = 0;; spins++) {
        int done = 0;
        int rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) return mpi_fail(c, what, g, rc);
        if (done) return TM_OK;
        double waited = tm__now() - t0;
        if (timeout > 0 && waited > timeout)
            return tm__err(c->ctx, TM_ERR_COMM,
                           "%s of %zu bytes over %s did not complete within %g s: a rank died, stopped answering, or "
                           "left the collective sequence (every rank must run the same collectives in the same order)",
                           what, bytes, tm__comm_gdesc(c, g), timeout);
        pause_briefly(spins, waited);
    }
}

static int fits_int(int64_t n) { return n >= 0 && n <= INT_MAX; }

static tm_status too_big(tm__comm *c, const char *what, int64_t n) {
    return tm__err(c->ctx, TM_ERR_UNSUPPORTED, "%s: %lld elements exceed MPI's int counts", what, (long long)n);
}

static MPI_Comm gcomm(tm__comm *c, int g) { return ((mpi_state *)c->mpi)->comm[g]; }

/* bf16 sums: widen to f32 on host copies, sum, round back. */
/* Host scratch from the context's arena inside a kernel scope (tm__scope_open), given back
 * when the scope closes: no system allocation per call. */
static void *scratch(tm__comm *c, size_t nbytes) { return tm__arena_alloc(c->ctx, tm_cpu(), nbytes ? nbytes : 1); }

static tm_status bf16_widen(tm__comm *c, const void *src, int64_t n, float **out) {
    float *f = scratch(c, sizeof(float) * (size_t)n);
    if (!f) return tm__err(c->ctx, TM_ERR_NOMEM, "collective: out of host memory staging bf16 as f32");
    tm__host_ops()->convert(f, TM_F32, src, TM_BF16, n, 1);
    *out = f;
    return TM_OK;
}

static tm_status mpi_allreduce(tm__comm *c, int g, const void *send, void *recv, int64_t n, tm_dtype dt,
                               tm_device dev) {
    if (!fits_int(n)) return too_big(c, "allreduce", n);
    if (dt == TM_BF16) {
        int mark = tm__scope_open(c->ctx);
        float *f;
        tm_status s = bf16_widen(c, send, n, &f);
        if (!s) s = mpi_allreduce(c, g, f, f, n, TM_F32, dev);
        if (!s) tm__host_ops()->convert(recv, TM_BF16, f, TM_F32, n, 1);
        tm__scope_close(c->ctx, mark, NULL, 0);
        return s;
    }
    MPI_Request req;
    int rc = MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, (int)n, mpi_type(dt), MPI_SUM, gcomm(c, g), &req);
    if (rc != MPI_SUCCESS) return mpi_fail(c, "allreduce", g, rc);
    return wait_for(c, &req, "allreduce", g, (size_t)n * tm_dtype_size(dt));
}

static tm_status mpi_allgatherv(tm__comm *c, int g, const void *send, void *recv, const int64_t *counts,
                                const int64_t *displs, tm_dtype dt, tm_device dev) {
    int G = c->size[g], me = c->rank[g];
    int *ic = tm__meta_alloc(c->ctx, sizeof(int) * 2 * (size_t)G);
    if (!ic) return tm__err(c->ctx, TM_ERR_NOMEM, "allgather: out of host memory");
    for (int j = 0; j < G; j++) {
        if (!fits_int(counts[j]) || !fits_int(displs[j])) return too_big(c, "allgather", counts[j] + displs[j]);
        ic[j] = (int)counts[j];
        ic[G + j] = (int)displs[j];
    }
    size_t es = tm_dtype_size(dt);
    const void *s = (const char *)recv + displs[me] * (int64_t)es == (const char *)send ? MPI_IN_PLACE : send;
    MPI_Request req;
    int rc = MPI_Iallgatherv(s, ic[me], mpi_type(dt), recv, ic, ic + G, mpi_type(dt), gcomm(c, g), &req);
    return rc != MPI_SUCCESS ? mpi_fail(c, "allgather", g, rc) : wait_for(c, &req, "allgather", g, (size_t)counts[me] * es);
}

/* Both reduce-scatters: blocks of `counts` elements (NULL: G equal blocks of n). The equal form
 * stays MPI_Reduce_scatter_block and the ragged one MPI_Reduce_scatter (Open MPI picks its
 * algorithm, and so the order of the sums, by the call: the bit-exact resume tests compare
 * them). bf16 is widened to f32 and reduced there; recv inside send (in place) goes through a
 * scratch block, since MPI's in-place form leaves the result at the start of the buffer, not
 * at this rank's block. */
static tm_status reduce_scatter_any(tm__comm *c, int g, const void *send, void *recv, const int64_t *counts,
                                    int64_t n, tm_dtype dt, tm_device dev) {
    int G = c->size[g], me = c->rank[g];
    int64_t total = 0, before = 0, mine = counts ? counts[me] : n;
    for (int j = 0; j < G; j++) {
        int64_t k = counts ? counts[j] : n;
        if (!fits_int(k)) return too_big(c, "reduce_scatter", k);
        if (j < me) before += k;
        total += k;
    }
    if (!fits_int(total)) return too_big(c, "reduce_scatter", total);
    int mark = tm__scope_open(c->ctx);
    tm_status st = TM_OK;
    if (dt == TM_BF16) {
        float *f;
        st = bf16_widen(c, send, total, &f);
        if (!st) st = reduce_scatter_any(c, g, f, f + before, counts, n, TM_F32, dev);
        if (!st) tm__host_ops()->convert(recv, TM_BF16, f + before, TM_F32, mine, 1);
        tm__scope_close(c->ctx, mark, NULL, 0);
        return st;
    }
    size_t es = tm_dtype_size(dt);
    const char *sb = send, *rb = recv;
    int inside = rb >= sb && rb < sb + (size_t)total * es;
    int *rc = counts ? tm__meta_alloc(c->ctx, sizeof(int) * (size_t)G) : NULL;
    void *tmp = inside ? scratch(c, (size_t)mine * es + 1) : recv;
    if ((counts && !rc) || !tmp) st = tm__err(c->ctx, TM_ERR_NOMEM, "reduce_scatter: out of host memory");
    for (int j = 0; !st && counts && j < G; j++) rc[j] = (int)counts[j];
    MPI_Request req;
    int r = MPI_SUCCESS;
    if (!st)
        r = counts ? MPI_Ireduce_scatter(send, tmp, rc, mpi_type(dt), MPI_SUM, gcomm(c, g), &req)
                   : MPI_Ireduce_scatter_block(send, tmp, (int)n, mpi_type(dt), MPI_SUM, gcomm(c, g), &req);
    if (!st) st = r != MPI_SUCCESS ? mpi_fail(c, "reduce_scatter", g, r)
                                   : wait_for(c, &req, "reduce_scatter", g, (size_t)total * es);
    if (inside && !st) memcpy(recv, tmp, (size_t)mine * es);
    tm__scope_close(c->ctx, mark, NULL, 0);
    return st;
}

static tm_status mpi_reduce_scatter(tm__comm *c, int g, const void *send, void *recv, int64_t n, tm_dtype dt,
                                    tm_device dev) {
    if (!fits_int(n * c->size[g])) return too_big(c, "reduce_scatter", n * c->size[g]);
    return reduce_scatter_any(c, g, send, recv, NULL, n, dt, dev);
}

static tm_status mpi_reduce_scatterv(tm__comm *c, int g, const void *send, void *recv, const int64_t *counts,
                                     tm_dtype dt, tm_device dev) {
    return reduce_scatter_any(c, g, send, recv, counts, 0, dt, dev);
}

static tm_status mpi_alltoallv(tm__comm *c, int g, const void *send, const int64_t *sc, const int64_t *sd, void *recv,
                               const int64_t *rc_, const int64_t *rd, tm_dtype dt, tm_device dev) {
    int G = c->size[g];
    int *v = tm__meta_alloc(c->ctx, sizeof(int) * 4 * (size_t)G);
    if (!v) return tm__err(c->ctx, TM_ERR_NOMEM, "alltoall: out of host memory");
    size_t sent = 0;
    for (int j = 0; j < G; j++) {
        if (!fits_int(sc[j]) || !fits_int(sd[j]) || !fits_int(rc_[j]) || !fits_int(rd[j]))
            return too_big(c, "alltoall", sd[j] + sc[j]);
        v[j] = (int)sc[j], v[G + j] = (int)sd[j], v[2 * G + j] = (int)rc_[j], v[3 * G + j] = (int)rd[j];
        sent += (size_t)sc[j];
    }
    MPI_Datatype t = mpi_type(dt);
    MPI_Request req;
    int rc = MPI_Ialltoallv(send, v, v + G, t, recv, v + 2 * G, v + 3 * G, t, gcomm(c, g), &req);
    return rc != MPI_SUCCESS ? mpi_fail(c, "alltoall", g, rc) : wait_for(c, &req, "alltoall", g, sent * tm_dtype_size(dt));
}

static tm_status mpi_bcast(tm__comm *c, int g, void *buf, int64_t n, tm_dtype dt, int root, tm_device dev) {
    if (!fits_int(n)) return too_big(c, "bcast", n);
    MPI_Request req;
    int rc = MPI_Ibcast(buf, (int)n, mpi_type(dt), root, gcomm(c, g), &req);
    if (rc != MPI_SUCCESS) return mpi_fail(c, "bcast", g, rc);
    return wait_for(c, &req, "bcast", g, (size_t)n * tm_dtype_size(dt));
}

static tm_status mpi_barrier(tm__comm *c, int g) {
    MPI_Request req;
    int rc = MPI_Ibarrier(gcomm(c, g), &req);
    if (rc != MPI_SUCCESS) return mpi_fail(c, "barrier", g, rc);
    return wait_for(c, &req, "barrier", g, 0);
}

const tm__comm_ops tm__comm_mpi_ops = {
    "mpi", mpi_allreduce, mpi_allgatherv, mpi_reduce_scatter, mpi_reduce_scatterv, mpi_alltoallv, mpi_bcast, mpi_barrier,
    mpi_state_free, NULL,
};
