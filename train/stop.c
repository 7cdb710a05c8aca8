/* stop.c — stop requests from signals; see stop.h. */
#include "stop.h"

#include <stdio.h>
#include <string.h>

static volatile sig_atomic_t g_first, g_count;

/* Only async-signal-safe calls here: sigaction and raise. The stop signals are blocked while
 * the handler runs (sa_mask), so the count cannot race with itself. */
static void on_stop(int sig) {
    if (!g_first) g_first = sig;
    if (g_count < 1000) g_count++;
    if (g_count >= 3) {
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigemptyset(&dfl.sa_mask);
        sigaction(sig, &dfl, NULL);
        raise(sig); /* delivered, with the default action, once the handler returns */
    }
}

void tmd_stop_catch(tmd_stop_saved *old) {
    struct sigaction sa, ign;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigemptyset(&sa.sa_mask);
    sigaddset(&sa.sa_mask, SIGINT);
    sigaddset(&sa.sa_mask, SIGTERM);
    sigaddset(&sa.sa_mask, SIGHUP);
    /* SA_RESTART: a write or fsync of the checkpoint that a signal interrupts goes on instead
     * of failing with EINTR; the run looks at the flag at its safe points. */
    sa.sa_flags = SA_RESTART;
    memset(&ign, 0, sizeof ign);
    ign.sa_handler = SIG_IGN;
    sigemptyset(&ign.sa_mask);
    g_first = 0;
    g_count = 0;
    sigaction(SIGINT, &sa, &old->intr);
    sigaction(SIGTERM, &sa, &old->term);
    sigaction(SIGHUP, &sa, &old->hup);
    sigaction(SIGPIPE, &ign, &old->pipe);
    sigaction(SIGXFSZ, &ign, &old->xfsz);
}

void tmd_stop_restore(const tmd_stop_saved *old) {
    /* The run has reported its stop by now; a later run (or eval) in this process starts clean. */
    g_first = 0;
    g_count = 0;
    sigaction(SIGINT, &old->intr, NULL);
    sigaction(SIGTERM, &old->term, NULL);
    sigaction(SIGHUP, &old->hup, NULL);
    sigaction(SIGPIPE, &old->pipe, NULL);
    sigaction(SIGXFSZ, &old->xfsz, NULL);
}

int tmd_stop_signal(void) { return g_first; }
int tmd_stop_count(void) { return g_count; }

const char *tmd_stop_name(int sig) {
    static char buf[32];
    if (sig == SIGINT) return "SIGINT";
    if (sig == SIGTERM) return "SIGTERM";
    if (sig == SIGHUP) return "SIGHUP";
    snprintf(buf, sizeof buf, "signal %d", sig);
    return buf;
}

void tmd_signals_ignore_io(void) {
    signal(SIGPIPE, SIG_IGN);
    signal(SIGXFSZ, SIG_IGN);
}
