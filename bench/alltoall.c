/*
 * alltoall.c — the bandwidth of tinymoe's ragged all-to-all (tm_comm_alltoall, the expert-parallel
 * dispatch) against the engine's own all-to-all of the same bytes, on the same ranks, in one run.
 *
 *   mpirun -np N build/bench_alltoall [--device cuda|cpu] [--tokens T] [--hidden H] [--topk K]
 *                                     [--experts E] [--iters I] [--dtype bf16|f32]
 *
 * The default workload is the dispatch of the "fine" benchmark model (issue 12/13): the global
 * batch of 16 x 1024 tokens split over the N ranks, each token sent to topk 6 of 64 experts,
 * the experts split contiguously over the N ranks (ep_size N), rows of d_model 1024 in bf16.
 * The routing is uniform at random (seed fixed), so rank r sends send[j] rows to rank j, as
 * the layer's permute would lay them out (rank order).
 *
 * Reference, moving exactly the same bytes with the same counts:
 *   CUDA tensors: NCCL's grouped ncclSend / ncclRecv (ncclGroupStart ... ncclGroupEnd, then a
 *                 stream synchronisation), as nccl-tests' alltoall does (not installed there);
 *   CPU tensors:  MPI_Alltoallv.
 * Two timings of each, after two warm-up calls and a barrier, the best of three repeats, the
 * slowest rank's time:
 *   queued: `iters` calls enqueued back to back, then one wait for the stream (tm_ctx_sync /
 *           cudaStreamSynchronize): the device's time per call, as nccl-tests times a
 *           collective and as a training step meets it (the host runs ahead of the device).
 *           Also printed: tinymoe's host time to enqueue one call in that mode (when it
 *           approaches the queued time, the host, not the device, sets the pace).
 *   waited: a wait after every call: the latency a caller sees who reads the result at once;
 *           it adds each call's host work (tinymoe's op: its checks, including the exchange of
 *           the counts that the public tm_comm_alltoall makes, the arena, the dispatch) to it.
 * The nccl engine queues its collective on the stream without waiting; the host engines
 * (CPU tensors) block, so there both timings are the same thing. Both tinymoe's nccl engine
 * (kernels/cuda/comm_nccl.cu) and the reference send the rows a rank keeps to itself inside
 * the NCCL group; the two diagnostic rows copy them with cudaMemcpyAsync instead (what the
 * engine did through 0ab29e2). Bandwidth = bytes this rank sends to other
 * ranks / time (the "algorithm bandwidth" of nccl-tests; rows kept on the rank itself are not
 * counted). Ratio = reference time / tinymoe time (1.0: no overhead beyond the engine); the
 * issue's target (>= 0.95) is on the queued ratio.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BENCH_PROG "bench_alltoall"
#include "bench.h"

#ifdef TM_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

int main(int argc, char **argv) {
    long tokens = 16 * 1024, hidden = 1024, topk = 6, experts = 64, iters = 20;
    const char *device = "cuda", *dtype = "bf16";
    const bench_opt opts[] = {
        {"--device", NULL, &device, 0, "cuda (NCCL reference), or cpu (MPI_Alltoallv reference)"},
        {"--dtype", NULL, &dtype, 0, "bf16 or f32"},
        {"--tokens", &tokens, NULL, 1, "global tokens (a multiple of the ranks)"},
        {"--hidden", &hidden, NULL, 1, "row length"},
        {"--topk", &topk, NULL, 1, "experts per token"},
        {"--experts", &experts, NULL, 1, "experts (a multiple of the ranks)"},
        {"--iters", &iters, NULL, 1, "timed calls per repeat"},
    };
    int pr = bench_parse(argc, argv, BENCH_PROG, "ragged all-to-all vs the engine's own (bench/alltoall.c); run under mpirun",
                         opts, (int)(sizeof opts / sizeof opts[0]));
    if (pr <= 0) return pr < 0 ? 2 : 0;
    tm_ctx *ctx = NULL;
    MPI_Init(&argc, &argv);
    int rank, N;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &N);
    int cuda = !strcmp(device, "cuda");
    if (tokens % N || experts % N) {
        if (!rank) fprintf(stderr, "bench_alltoall: --tokens %lld and --experts %lld must be multiples of the %d ranks\n",
                           (long long)tokens, (long long)experts, N);
        MPI_Finalize();
        return 2;
    }
    int ndev = cuda ? tm_cuda_device_count() : 0;
    if (cuda && ndev < 1) {
        if (!rank) fprintf(stderr, "bench_alltoall: --device cuda, but no CUDA device is visible\n");
        MPI_Finalize();
        return 2;
    }
    const char *lr = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    int gpu = cuda ? (lr ? atoi(lr) : rank) % ndev : -1;
    tm_ctx_options o = tm_ctx_options_default();
    o.cuda_device = gpu;
    if (tm_ctx_new(&ctx, &o)) {
        fprintf(stderr, "bench_alltoall: rank %d: cannot create a context: %s\n", rank, tm_last_create_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    tm_comm_options co = tm_comm_options_default();
    co.ep_size = N;
    CHECK(tm_comm_init(ctx, &co));
    tm_device dev = cuda ? tm_cuda(gpu) : tm_cpu();
    tm_dtype dt = !strcmp(dtype, "f32") ? TM_F32 : TM_BF16;
    size_t es = tm_dtype_size(dt);

    /* This rank's routing: tokens / N tokens, topk distinct-enough experts each (uniform; the
     * count per destination rank is what matters), rows grouped by destination rank. */
    int64_t *send = calloc((size_t)N, sizeof *send), *recv = calloc((size_t)N, sizeof *recv);
    uint64_t seed = 1234 + (uint64_t)rank;
    for (int64_t t = 0; t < tokens / N * topk; t++) send[(bench_rand(&seed) >> 1) % (uint64_t)experts / (uint64_t)(experts / N)]++; /* >> 1: the draw of the measured runs */
    MPI_Alltoall(send, 1, MPI_INT64_T, recv, 1, MPI_INT64_T, MPI_COMM_WORLD);
    int64_t rows = 0, rrows = 0, sent_off = 0;
    for (int j = 0; j < N; j++) rows += send[j], rrows += recv[j], sent_off += j == rank ? 0 : send[j];
    tm_tensor *x, *sc, *rc, *y;
    CHECK(tm_buffer_new(ctx, "x", dt, 2, (int64_t[]){rows, hidden}, dev, &x));
    CHECK(tm_tensor_fill(ctx, x, 1.0));
    CHECK(tm_buffer_new(ctx, "send_counts", TM_I64, 1, (int64_t[]){N}, tm_cpu(), &sc));
    CHECK(tm_buffer_new(ctx, "recv_counts", TM_I64, 1, (int64_t[]){N}, tm_cpu(), &rc));
    CHECK(tm_tensor_write(ctx, sc, TM_I64, send, N));
    CHECK(tm_tensor_write(ctx, rc, TM_I64, recv, N));
    tm_ctx_set_grad_enabled(ctx, 0);

    /* the reference's buffers and displacements (bytes) */
    size_t *sd = calloc((size_t)N, sizeof *sd), *rd = calloc((size_t)N, sizeof *rd);
    for (int j = 1; j < N; j++) sd[j] = sd[j - 1] + (size_t)send[j - 1] * (size_t)hidden * es,
                                rd[j] = rd[j - 1] + (size_t)recv[j - 1] * (size_t)hidden * es;
    size_t sbytes = (size_t)rows * (size_t)hidden * es, rbytes = (size_t)rrows * (size_t)hidden * es;
    void *rs = NULL, *rr = NULL;
#ifdef TM_HAVE_NCCL
    ncclComm_t nc = NULL;
    cudaStream_t stream = NULL;
    if (cuda) {
        ncclUniqueId id;
        if (!rank) ncclGetUniqueId(&id);
        MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
        cudaSetDevice(gpu);
        cudaStreamCreate(&stream);
        if (ncclCommInitRank(&nc, N, id, rank) != ncclSuccess || cudaMalloc(&rs, sbytes + 1) != cudaSuccess ||
            cudaMalloc(&rr, rbytes + 1) != cudaSuccess) {
            fprintf(stderr, "bench_alltoall: rank %d: NCCL or cudaMalloc failed\n", rank);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
    }
#else
    if (cuda) {
        if (!rank) fprintf(stderr, "bench_alltoall: this build has no NCCL: the CUDA reference needs it\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
#endif
    int *msc = NULL, *msd = NULL, *mrc = NULL, *mrd = NULL;
    if (!cuda) {
        rs = malloc(sbytes + 1), rr = malloc(rbytes + 1);
        msc = calloc((size_t)N, sizeof *msc), msd = calloc((size_t)N, sizeof *msd);
        mrc = calloc((size_t)N, sizeof *mrc), mrd = calloc((size_t)N, sizeof *mrd);
        for (int j = 0; j < N; j++)
            msc[j] = (int)(send[j] * hidden * (int64_t)es), msd[j] = (int)sd[j],
            mrc[j] = (int)(recv[j] * hidden * (int64_t)es), mrd[j] = (int)rd[j];
    }

    /* best[waited][which]: which 0 = tinymoe, 1 = the reference, 2 = the reference without the
     * rows a rank keeps (NCCL, peers only: what the other ranks' rows alone take; a floor);
     * 3 and 4 (CUDA): the peers' rows by NCCL and the own rows by cudaMemcpyAsync, on the same
     * stream before the group (what tinymoe's engine does) or on a second stream forked before
     * and joined after it: whether the own rows' copy is what separates 0 from 1. */
    double best[2][5] = {{1e30, 1e30, 1e30, 1e30, 1e30}, {1e30, 1e30, 1e30, 1e30, 1e30}};
    double enq = 1e30; /* tinymoe, queued: the host's time to enqueue a call (slowest rank) */
    int nwhich = cuda ? 5 : 2;
#ifdef TM_HAVE_NCCL
    cudaStream_t side = NULL;
    cudaEvent_t fork_ev = NULL, join_ev = NULL;
    if (cuda) {
        cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
        cudaEventCreateWithFlags(&fork_ev, cudaEventDisableTiming);
        cudaEventCreateWithFlags(&join_ev, cudaEventDisableTiming);
    }
#endif
    for (int rep = 0; rep < 3; rep++) {
        for (int waited = 0; waited < 2; waited++) {
            for (int which = 0; which < nwhich; which++) {
                double t0 = 0;
                for (int64_t it = 0; it < iters + 2; it++) {
                    if (it == 2) { /* after two warm-up calls, each rank's queue empty */
                        if (which == 0) CHECK(tm_ctx_sync(ctx));
#ifdef TM_HAVE_NCCL
                        if (which >= 1 && cuda) cudaStreamSynchronize(stream);
#endif
                        MPI_Barrier(MPI_COMM_WORLD);
                        t0 = MPI_Wtime();
                    }
                    if (which == 0) {
                        CHECK(tm_comm_alltoall(ctx, x, sc, rc, TM_COMM_EP, &y));
                        if (waited || it < 2) CHECK(tm_ctx_sync(ctx));
                        /* y's block is reused by the next call, after this one in stream order */
                        tm_ctx_arena_reset(ctx);
                    } else if (cuda) {
#ifdef TM_HAVE_NCCL
                        ncclDataType_t nt = dt == TM_F32 ? ncclFloat32 : ncclBfloat16;
                        size_t own = (size_t)send[rank] * (size_t)hidden * es;
                        if (which == 3 && own) cudaMemcpyAsync((char *)rr + rd[rank], (char *)rs + sd[rank], own,
                                                               cudaMemcpyDeviceToDevice, stream);
                        if (which == 4 && own) {
                            cudaEventRecord(fork_ev, stream);
                            cudaStreamWaitEvent(side, fork_ev, 0);
                            cudaMemcpyAsync((char *)rr + rd[rank], (char *)rs + sd[rank], own, cudaMemcpyDeviceToDevice,
                                            side);
                            cudaEventRecord(join_ev, side);
                        }
                        ncclGroupStart();
                        for (int j = 0; j < N; j++) {
                            if (which >= 2 && j == rank) continue;
                            ncclSend((char *)rs + sd[j], (size_t)(send[j] * hidden), nt, j, nc, stream);
                            ncclRecv((char *)rr + rd[j], (size_t)(recv[j] * hidden), nt, j, nc, stream);
                        }
                        ncclGroupEnd();
                        if (which == 4 && own) cudaStreamWaitEvent(stream, join_ev, 0);
                        if (waited || it < 2) cudaStreamSynchronize(stream);
#endif
                    } else {
                        MPI_Alltoallv(rs, msc, msd, MPI_BYTE, rr, mrc, mrd, MPI_BYTE, MPI_COMM_WORLD);
                    }
                }
                double te = (MPI_Wtime() - t0) / (double)iters;
                if (which == 0) CHECK(tm_ctx_sync(ctx));
#ifdef TM_HAVE_NCCL
                if (which >= 1 && cuda) cudaStreamSynchronize(stream);
#endif
                double t = (MPI_Wtime() - t0) / (double)iters, tmax, temax;
                if (which == 0 && !waited) {
                    MPI_Allreduce(&te, &temax, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
                    if (temax < enq) enq = temax;
                }
                MPI_Allreduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
                if (tmax < best[waited][which]) best[waited][which] = tmax;
            }
        }
    }
    double bytes = (double)sent_off * (double)hidden * (double)es;
    if (!rank) {
        const char *ref = cuda ? "NCCL send/recv" : "MPI_Alltoallv";
        printf("all-to-all, %d ranks (%s, engine %s): %lld tokens x top-%lld of %lld experts, rows of %lld %s;\n"
               "rank 0 sends %.1f MB to other ranks per call (%lld of its %lld rows)\n\n",
               N, cuda ? "cuda" : "cpu", tm_comm_engine(ctx, dev), (long long)tokens, (long long)topk,
               (long long)experts, (long long)hidden, dt == TM_F32 ? "f32" : "bf16", bytes / 1e6,
               (long long)sent_off, (long long)rows);
        printf("%-26s %12s %10s %12s %10s\n", "", "queued ms", "GB/s", "waited ms", "GB/s");
        printf("%-26s %12.3f %10.2f %12.3f %10.2f\n", "tinymoe tm_comm_alltoall", 1e3 * best[0][0],
               bytes / best[0][0] / 1e9, 1e3 * best[1][0], bytes / best[1][0] / 1e9);
        printf("%-26s %12.3f %10.2f %12.3f %10.2f\n", ref, 1e3 * best[0][1], bytes / best[0][1] / 1e9,
               1e3 * best[1][1], bytes / best[1][1] / 1e9);
        if (cuda) {
            static const char *diag[] = {"NCCL, other ranks' rows only", "NCCL + own rows copied before",
                                         "NCCL + own rows copied beside"};
            for (int w = 2; w < 5; w++)
                printf("%-30s %8.3f %10.2f %12.3f %10.2f\n", diag[w - 2], 1e3 * best[0][w], bytes / best[0][w] / 1e9,
                       1e3 * best[1][w], bytes / best[1][w] / 1e9);
        }
        printf("%-26s %12.3f\n", "tinymoe, host enqueue", 1e3 * enq);
        printf("%-26s %12.2f %10s %12.2f\n", "ratio (ref / tinymoe)", best[0][1] / best[0][0], "",
               best[1][1] / best[1][0]);
        printf("RESULT bench=alltoall ranks=%d device=%s bytes=%.0f tinymoe_ms=%.4f ref_ms=%.4f ratio=%.4f "
               "waited_tinymoe_ms=%.4f waited_ref_ms=%.4f waited_ratio=%.4f\n",
               N, cuda ? "cuda" : "cpu", bytes, 1e3 * best[0][0], 1e3 * best[0][1], best[0][1] / best[0][0],
               1e3 * best[1][0], 1e3 * best[1][1], best[1][1] / best[1][0]);
    }
#ifdef TM_HAVE_NCCL
    if (cuda) {
        ncclCommDestroy(nc);
        cudaFree(rs);
        cudaFree(rr);
        cudaStreamDestroy(stream);
        cudaStreamDestroy(side);
        cudaEventDestroy(fork_ev);
        cudaEventDestroy(join_ev);
    } else
#endif
    {
        free(rs), free(rr), free(msc), free(msd), free(mrc), free(mrd);
    }
    free(send), free(recv), free(sd), free(rd);
    tm_ctx_free(ctx);
    MPI_Finalize();
    return 0;
fail: /* a collective failed on this rank: the others would wait for it */
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
}
