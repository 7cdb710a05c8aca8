/* child.c — the tinymoe binary in a child process; see child.h. */
#include "child.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

double tt_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Children not yet waited for, for tt_kill_children. */
static pid_t live[64];
static int n_live;

static void forget(pid_t pid) {
    for (int i = 0; i < n_live; i++)
        if (live[i] == pid) live[i] = live[--n_live];
}

void tt_kill_children(void) {
    while (n_live > 0) {
        pid_t pid = live[--n_live];
        kill(-pid, SIGKILL);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
}

const char *tt_tinymoe(void) {
    static char path[PATH_MAX];
    if (path[0]) return path;
    ssize_t n = readlink("/proc/self/exe", path, sizeof path - 16);
    cr_assert(n > 0, "readlink /proc/self/exe: %s", strerror(errno));
    path[n] = 0;
    char *slash = strrchr(path, '/');
    cr_assert_not_null(slash);
    strcpy(slash + 1, "tinymoe");
    cr_assert_eq(access(path, X_OK), 0, "%s: %s (build it: make)", path, strerror(errno));
    return path;
}

tt_child tt_spawn(char *const *argv, const char *out_path, long fsize_limit) {
    int p[2] = {-1, -1};
    if (!out_path) cr_assert_eq(pipe(p), 0);
    fflush(NULL);
    pid_t pid = fork();
    cr_assert(pid >= 0, "fork: %s", strerror(errno));
    if (pid == 0) {
        setpgid(0, 0);
        int fd = out_path ? open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644) : p[1];
        if (fd < 0) _exit(120);
        dup2(fd, 1);
        dup2(fd, 2);
        if (p[0] >= 0) close(p[0]);
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull >= 0) dup2(devnull, 0);
        if (fsize_limit > 0) {
            struct rlimit rl = {(rlim_t)fsize_limit, (rlim_t)fsize_limit};
            setrlimit(RLIMIT_FSIZE, &rl);
        }
        /* The test runner's own dispositions must not leak into the driver. */
        signal(SIGPIPE, SIG_DFL);
        signal(SIGXFSZ, SIG_DFL);
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        execvp(argv[0], argv);
        _exit(121);
    }
    setpgid(pid, pid); /* also here: no race with a signal sent to the group right away */
    if (p[1] >= 0) close(p[1]);
    if (n_live < (int)(sizeof live / sizeof live[0])) live[n_live++] = pid;
    return (tt_child){pid, p[0]};
}

tt_child tt_spawn_pty(char *const *argv, int cols, int rows) {
    struct winsize ws = {(unsigned short)rows, (unsigned short)cols, 0, 0};
    int master = -1;
    fflush(NULL);
    pid_t pid = forkpty(&master, NULL, NULL, &ws);
    cr_assert(pid >= 0, "forkpty: %s", strerror(errno));
    if (pid == 0) {
        static const char *const launcher_vars[] = {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                                                    "PMIX_RANK", "SLURM_STEP_ID", "SLURM_PROCID"};
        for (size_t i = 0; i < sizeof launcher_vars / sizeof launcher_vars[0]; i++) unsetenv(launcher_vars[i]);
        setenv("TERM", "xterm", 1);
        signal(SIGPIPE, SIG_DFL);
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        execvp(argv[0], argv);
        _exit(121);
    }
    if (n_live < (int)(sizeof live / sizeof live[0])) live[n_live++] = pid;
    return (tt_child){pid, master};
}

char *tt_capture(tt_child *c, double seconds, int *status) {
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    cr_assert_not_null(buf);
    double end = tt_now() + seconds;
    while (c->out_fd >= 0 && tt_now() < end) {
        struct pollfd pf = {c->out_fd, POLLIN, 0};
        int r = poll(&pf, 1, 100);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) continue;
        if (n + 4096 + 1 > cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            cr_assert_not_null(buf);
        }
        ssize_t got = read(c->out_fd, buf + n, 4096);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) break; /* EOF on a pipe, EIO on a pseudo-terminal whose child is gone */
        n += (size_t)got;
    }
    buf[n] = 0;
    int st = tt_wait(c, end - tt_now() > 1 ? end - tt_now() : 1);
    if (status) *status = st == -1 ? -1 : WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return buf;
}

int tt_wait(tt_child *c, double seconds) {
    double end = tt_now() + seconds;
    int status = 0;
    for (;;) {
        pid_t r = waitpid(c->pid, &status, WNOHANG);
        if (r == c->pid) break;
        if (r < 0 && errno != EINTR) return -1;
        if (tt_now() > end) {
            kill(-c->pid, SIGKILL);
            kill(c->pid, SIGKILL);
            waitpid(c->pid, &status, 0);
            status = -1;
            break;
        }
        usleep(2000);
    }
    forget(c->pid);
    if (c->out_fd >= 0) close(c->out_fd);
    c->out_fd = -1;
    return status;
}

int tt_run(char *const *argv, const char *out_path, double seconds, double *elapsed) {
    double t0 = tt_now();
    tt_child c = tt_spawn(argv, out_path, 0);
    int st = tt_wait(&c, seconds);
    if (elapsed) *elapsed = tt_now() - t0;
    if (st == -1) return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

int tt_wait_for_text(const char *path, const char *text, double seconds) {
    double end = tt_now() + seconds;
    while (tt_now() < end) {
        struct stat sb;
        if (stat(path, &sb) == 0 && sb.st_size > 0) {
            if (!text) return 1;
            long len;
            char *s = (char *)tt_slurp(path, &len);
            int found = strstr(s, text) != NULL;
            free(s);
            if (found) return 1;
        }
        usleep(5000);
    }
    return 0;
}
