/*
 * tree: a parent and C forked children connected by two pipes each.
 *
 * Each step the parent writes the step number (8 bytes) to every child; the
 * child advances its own state and answers with its checksum (8 bytes); the
 * parent prints the combined checksum.  Children exit on EOF or after the
 * last step; the parent reaps them before printing "done".
 */
#include "common.h"

#include <signal.h>
#include <sys/wait.h>

#define PROG "tree"
#define INNER 1000
#define MAX_CHILDREN 256

struct child {
    pid_t pid;
    int to_child;   /* parent's write end */
    int from_child; /* parent's read end */
    uint64_t last;  /* last checksum received */
};

static struct child *kids;
static unsigned nkids;

static void usage(FILE *out)
{
    fprintf(out,
            "usage: " PROG " [--steps N] [--interval-ms M] [--children C]\n"
            WL_COMMON_USAGE
            "  --children C       number of child processes (default 2)\n",
            "100");
}

static __attribute__((noreturn)) void child_main(unsigned idx, int rfd, int wfd,
                                                 uint64_t steps)
{
    uint64_t x = wl_seed(0x6368696c64ULL + idx);
    double acc = (double)idx;

    for (;;) {
        uint64_t i, sum;
        ssize_t r = wl_read_full(rfd, &i, sizeof i);

        if (r == 0)
            _exit(0); /* parent closed the pipe */
        if (r < 0)
            _exit(3);
        for (int k = 0; k < INNER; k++) {
            wl_xorshift(&x);
            acc = acc * 0.999 + (double)(x % 1000) / 7.0;
        }
        sum = wl_mix(0x6b6964ULL ^ idx, i);
        sum = wl_mix(sum, x);
        sum = wl_mix(sum, wl_dbits(acc));
        if (wl_write_full(wfd, &sum, sizeof sum) < 0)
            _exit(4);
        if (steps && i >= steps)
            _exit(0);
    }
}

static uint64_t step(uint64_t i, void *ctx)
{
    uint64_t h = wl_mix(0x74726565ULL, i);

    (void)ctx;
    for (unsigned k = 0; k < nkids; k++)
        if (wl_write_full(kids[k].to_child, &i, sizeof i) < 0)
            wl_die(PROG, "write to child %u:", k);
    for (unsigned k = 0; k < nkids; k++) {
        ssize_t r = wl_read_full(kids[k].from_child, &kids[k].last, sizeof kids[k].last);
        if (r <= 0) {
            if (r == 0)
                errno = EPIPE;
            wl_die(PROG, "read from child %u:", k);
        }
        h = wl_mix(h, kids[k].last);
    }
    return h;
}

int main(int argc, char **argv)
{
    struct wl_common o = { .steps = 100, .interval_ms = 100 };
    struct wl_cli c = { .argc = argc, .argv = argv, .prog = PROG, .usage = usage };
    uint64_t nchildren = 2, last, extra = 0;
    int failed = 0;

    for (c.i = 1; c.i < argc; c.i++) {
        const char *v;
        if (wl_common_opt(&c, &o))
            continue;
        if ((v = wl_match(&c, "--children")))
            nchildren = wl_u64(&c, "--children", v, 1, MAX_CHILDREN);
        else
            wl_bad_arg(&c);
    }
    wl_init_stdout();
    /* A dead child shows up as EPIPE/EOF, reported below, not as a signal. */
    signal(SIGPIPE, SIG_IGN);

    nkids = (unsigned)nchildren;
    kids = calloc(nkids, sizeof *kids);
    if (!kids)
        wl_die(PROG, "out of memory:");

    fflush(NULL);
    for (unsigned k = 0; k < nkids; k++) {
        int down[2], up[2];

        if (pipe(down) < 0 || pipe(up) < 0)
            wl_die(PROG, "pipe:");
        pid_t pid = fork();
        if (pid < 0)
            wl_die(PROG, "fork:");
        if (pid == 0) {
            /* Drop the parent's ends of all earlier children's pipes so that
             * they see EOF when the parent closes them. */
            for (unsigned j = 0; j < k; j++) {
                close(kids[j].to_child);
                close(kids[j].from_child);
            }
            close(down[1]);
            close(up[0]);
            child_main(k, down[0], up[1], o.steps);
        }
        close(down[0]);
        close(up[1]);
        kids[k].pid = pid;
        kids[k].to_child = down[1];
        kids[k].from_child = up[0];
    }

    last = wl_loop(PROG, &o, step, NULL);

    for (unsigned k = 0; k < nkids; k++) {
        int status;

        close(kids[k].to_child);
        close(kids[k].from_child);
        while (waitpid(kids[k].pid, &status, 0) < 0) {
            if (errno != EINTR)
                wl_die(PROG, "waitpid:");
        }
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, PROG ": child %u exited abnormally (status 0x%x)\n", k, status);
            failed = 1;
        }
        extra = wl_mix(extra, kids[k].last);
    }
    if (failed)
        return 1;
    wl_print_done(PROG, wl_done_sum(o.steps, last, extra));
    return 0;
}
