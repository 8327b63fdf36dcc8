/*
 * threads: T worker threads, each with its own PRNG and accumulator.
 *
 * Per step the main thread releases all workers through a barrier, every
 * worker advances exactly once, and a second barrier hands the results back;
 * main then prints the combined checksum (folded in worker order).
 */
#include "common.h"

#include <pthread.h>

#define PROG "threads"
#define INNER 1000
#define MAX_THREADS 1024

struct worker {
    pthread_t tid;
    unsigned idx;
    uint64_t x;
    double acc;
    uint64_t sum; /* checksum of the last step */
} __attribute__((aligned(64)));

static struct {
    pthread_barrier_t start, end;
    uint64_t cur_step; /* written by main before `start` */
    int stop;          /* written by main before `start` */
    unsigned nthreads;
    struct worker *w;
} g;

static void usage(FILE *out)
{
    fprintf(out,
            "usage: " PROG " [--steps N] [--interval-ms M] [--threads T]\n"
            WL_COMMON_USAGE
            "  --threads T        number of worker threads (default 4)\n",
            "100");
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;

    for (;;) {
        /* pthread_barrier_wait synchronises memory (POSIX 4.12). */
        pthread_barrier_wait(&g.start);
        if (g.stop)
            break;
        uint64_t i = g.cur_step;
        for (int k = 0; k < INNER; k++) {
            wl_xorshift(&w->x);
            w->acc = w->acc * 0.999 + (double)(w->x % 1000) / 7.0 + (double)w->idx;
        }
        uint64_t h = wl_mix(0x7468726561647300ULL ^ w->idx, i);
        h = wl_mix(h, w->x);
        w->sum = wl_mix(h, wl_dbits(w->acc));
        pthread_barrier_wait(&g.end);
    }
    return NULL;
}

static uint64_t step(uint64_t i, void *ctx)
{
    uint64_t h = wl_mix(0x74687265616473ULL, i);

    (void)ctx;
    g.cur_step = i;
    pthread_barrier_wait(&g.start);
    pthread_barrier_wait(&g.end);
    for (unsigned t = 0; t < g.nthreads; t++)
        h = wl_mix(h, g.w[t].sum);
    return h;
}

int main(int argc, char **argv)
{
    struct wl_common o = { .steps = 100, .interval_ms = 100 };
    struct wl_cli c = { .argc = argc, .argv = argv, .prog = PROG, .usage = usage };
    uint64_t nthreads = 4, last, extra = 0;
    int err;

    for (c.i = 1; c.i < argc; c.i++) {
        const char *v;
        if (wl_common_opt(&c, &o))
            continue;
        if ((v = wl_match(&c, "--threads")))
            nthreads = wl_u64(&c, "--threads", v, 1, MAX_THREADS);
        else
            wl_bad_arg(&c);
    }
    wl_init_stdout();

    g.nthreads = (unsigned)nthreads;
    g.w = aligned_alloc(64, sizeof(struct worker) * g.nthreads);
    if (!g.w)
        wl_die(PROG, "out of memory:");
    memset(g.w, 0, sizeof(struct worker) * g.nthreads);
    if (pthread_barrier_init(&g.start, NULL, g.nthreads + 1) ||
        pthread_barrier_init(&g.end, NULL, g.nthreads + 1))
        wl_die(PROG, "pthread_barrier_init failed");
    for (unsigned t = 0; t < g.nthreads; t++) {
        g.w[t].idx = t;
        g.w[t].x = wl_seed(0x7468ULL + t);
        g.w[t].acc = 0.0;
        err = pthread_create(&g.w[t].tid, NULL, worker_main, &g.w[t]);
        if (err) {
            errno = err;
            wl_die(PROG, "pthread_create:");
        }
    }

    last = wl_loop(PROG, &o, step, NULL);

    g.stop = 1;
    pthread_barrier_wait(&g.start);
    for (unsigned t = 0; t < g.nthreads; t++) {
        pthread_join(g.w[t].tid, NULL);
        extra = wl_mix(extra, g.w[t].x);
        extra = wl_mix(extra, wl_dbits(g.w[t].acc));
    }
    wl_print_done(PROG, wl_done_sum(o.steps, last, extra));
    return 0;
}
