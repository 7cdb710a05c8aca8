/* hello.c — tinymoe in one screen: a parameter, two ops, backward, an error.
 *
 *   cc hello.c $(pkg-config --cflags --libs tinymoe) \
 *       -Wl,-rpath,$(pkg-config --variable=libdir tinymoe) -o hello
 */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <tinymoe.h>

#define CHECK(ctx, expr)                                                                     \
    do {                                                                                     \
        tm_status s_ = (expr);                                                               \
        if (s_ != TM_OK) {                                                                   \
            fprintf(stderr, "%s: %s: %s\n", #expr, tm_status_str(s_), tm_ctx_errmsg(ctx));  \
            return 1;                                                                        \
        }                                                                                    \
    } while (0)

int main(void) {
    tm_ctx *ctx = NULL;
    if (tm_ctx_new(&ctx, NULL) != TM_OK) {
        fprintf(stderr, "tm_ctx_new: %s\n", tm_last_create_error());
        return 1;
    }
    printf("tinymoe %s\n", tm_version());

    /* w: a persistent 3x2 parameter; x: a temporary 2x3 input. */
    int64_t ws[2] = {3, 2}, xs[2] = {2, 3};
    const float w0[6] = {1, -1, 0.5f, 2, -0.25f, 0};
    const float x0[6] = {1, 2, 3, -1, 0, 1};
    tm_tensor *w, *x, *y, *loss;
    CHECK(ctx, tm_param_new(ctx, "w", TM_F32, 2, ws, tm_cpu(), &w));
    CHECK(ctx, tm_tensor_write(ctx, w, TM_F32, w0, 6));
    CHECK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, xs, tm_cpu(), TM_F32, x0, &x));

    /* loss = mean(silu(x @ w)); d loss / d w = x^T (silu'(x @ w) / 4). */
    CHECK(ctx, tm_matmul(ctx, x, w, 0, 0, &y));
    CHECK(ctx, tm_silu(ctx, y, &y));
    CHECK(ctx, tm_mean_all(ctx, y, &loss));
    CHECK(ctx, tm_backward(ctx, loss));

    float l, g[6];
    CHECK(ctx, tm_tensor_read(ctx, loss, TM_F32, &l, 1));
    CHECK(ctx, tm_tensor_read(ctx, tm_tensor_grad(w), TM_F32, g, 6));
    printf("loss = %.6f\nd loss / d w =\n", l);
    for (int i = 0; i < 3; i++) printf("  [% .6f % .6f]\n", g[2 * i], g[2 * i + 1]);

    /* Errors are values with a message naming the op and the shapes: [2,3] @ [2,3] fails. */
    tm_tensor *bad = NULL;
    tm_status s = tm_matmul(ctx, x, x, 0, 0, &bad);
    printf("x @ x -> %s: %s\n", tm_status_str(s), tm_ctx_errmsg(ctx));
    int ok = s == TM_ERR_SHAPE && bad == NULL && strstr(tm_ctx_errmsg(ctx), "matmul") && isfinite(l);

    tm_ctx_arena_reset(ctx); /* temporaries (x, y, loss) are gone; w and its gradient stay */
    tm_ctx_free(ctx);
    puts(ok ? "ok" : "FAILED");
    return ok ? 0 : 1;
}
