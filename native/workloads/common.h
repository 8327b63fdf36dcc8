/*
 * Shared helpers for the deterministic C/R test workloads.
 *
 * Everything here is header-only (static inline) so that each program is a
 * single translation unit.  See README.md for the output contract.
 */
#ifndef CKPTD_WORKLOADS_COMMON_H
#define CKPTD_WORKLOADS_COMMON_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define WL_PAGE 4096u /* logical page size, fixed for determinism */

/* ------------------------------------------------------------------ */
/* Errors                                                               */
/* ------------------------------------------------------------------ */

static inline __attribute__((noreturn, format(printf, 2, 3))) void
wl_die(const char *prog, const char *fmt, ...)
{
    va_list ap;
    int saved = errno;

    fprintf(stderr, "%s: ", prog);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    if (saved && fmt[strlen(fmt) - 1] == ':')
        fprintf(stderr, " %s", strerror(saved));
    fputc('\n', stderr);
    exit(1);
}

/* ------------------------------------------------------------------ */
/* Hashing / PRNG (all 64-bit, platform independent)                  */
/* ------------------------------------------------------------------ */

static inline uint64_t wl_fmix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* Fold value v into running checksum h (order sensitive). */
static inline uint64_t wl_mix(uint64_t h, uint64_t v)
{
    return wl_fmix(h ^ (v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2)));
}

static inline uint64_t wl_rotl(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

/* Hash of a byte range (byte-order of the host; fine for same-host C/R). */
static inline uint64_t wl_hash(const void *p, size_t n, uint64_t seed)
{
    const unsigned char *b = p;
    uint64_t h = seed ^ ((uint64_t)n * 0x9e3779b97f4a7c15ULL);

    while (n >= 8) {
        uint64_t w;
        memcpy(&w, b, 8);
        h ^= w * 0x87c37b91114253d5ULL;
        h = wl_rotl(h, 31) * 0x4cf5ad432745937fULL + 0x52dce729ULL;
        b += 8;
        n -= 8;
    }
    if (n) {
        uint64_t w = 0;
        memcpy(&w, b, n);
        h ^= w * 0x87c37b91114253d5ULL;
        h = wl_rotl(h, 31) * 0x4cf5ad432745937fULL + 0x52dce729ULL;
    }
    return wl_fmix(h);
}

/* Marsaglia xorshift64; state must be non-zero. */
static inline uint64_t wl_xorshift(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *s = x;
    return x;
}

static inline uint64_t wl_splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Seed for a xorshift64 state (never zero). */
static inline uint64_t wl_seed(uint64_t v)
{
    uint64_t s = v;
    uint64_t r = wl_splitmix(&s);
    return r ? r : 0x2545f4914f6cdd1dULL;
}

static inline uint64_t wl_dbits(double d)
{
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
}

/* ------------------------------------------------------------------ */
/* Command line                                                        */
/* ------------------------------------------------------------------ */

struct wl_cli {
    int argc;
    char **argv;
    int i;                    /* index of the argument being parsed */
    const char *prog;
    void (*usage)(FILE *out); /* prints the program's usage text */
};

struct wl_common {
    uint64_t steps;       /* 0 = forever */
    uint64_t interval_ms; /* sleep between steps */
};

static inline __attribute__((noreturn, format(printf, 2, 3))) void
wl_usage_error(struct wl_cli *c, const char *fmt, ...)
{
    va_list ap;

    fprintf(stderr, "%s: ", c->prog);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    c->usage(stderr);
    exit(2);
}

/*
 * If argv[i] is "NAME VALUE" or "NAME=VALUE", return VALUE (consuming the
 * separate argument if needed), else NULL.
 */
static inline const char *wl_match(struct wl_cli *c, const char *name)
{
    const char *arg = c->argv[c->i];
    size_t n = strlen(name);

    if (strncmp(arg, name, n) != 0)
        return NULL;
    if (arg[n] == '=')
        return arg + n + 1;
    if (arg[n] != '\0')
        return NULL;
    if (c->i + 1 >= c->argc)
        wl_usage_error(c, "option '%s' requires a value", name);
    return c->argv[++c->i];
}

static inline uint64_t wl_u64(struct wl_cli *c, const char *name, const char *v,
                              uint64_t min, uint64_t max)
{
    char *end = NULL;
    unsigned long long x;

    if (*v < '0' || *v > '9')
        wl_usage_error(c, "invalid value '%s' for %s", v, name);
    errno = 0;
    x = strtoull(v, &end, 10);
    if (errno || *end != '\0')
        wl_usage_error(c, "invalid value '%s' for %s", v, name);
    if (x < min || x > max)
        wl_usage_error(c, "value for %s must be in [%" PRIu64 ", %" PRIu64 "]", name,
                       min, max);
    return (uint64_t)x;
}

/* Handles --steps / --interval-ms; returns 1 if argv[i] was consumed. */
static inline int wl_common_opt(struct wl_cli *c, struct wl_common *o)
{
    const char *v;

    if ((v = wl_match(c, "--steps"))) {
        o->steps = wl_u64(c, "--steps", v, 0, UINT64_MAX);
        return 1;
    }
    if ((v = wl_match(c, "--interval-ms"))) {
        o->interval_ms = wl_u64(c, "--interval-ms", v, 0, 86400000ULL);
        return 1;
    }
    return 0;
}

/* Anything not recognised: --help -> usage on stdout, exit 0; else exit 2. */
static inline __attribute__((noreturn)) void wl_bad_arg(struct wl_cli *c)
{
    const char *arg = c->argv[c->i];

    if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
        c->usage(stdout);
        exit(0);
    }
    if (arg[0] == '-')
        wl_usage_error(c, "unknown option '%s'", arg);
    wl_usage_error(c, "unexpected argument '%s'", arg);
}

#define WL_COMMON_USAGE                                                       \
    "  --steps N          number of steps, 0 = run forever (default 100)\n"   \
    "  --interval-ms M    sleep between steps in ms (default %s)\n"

/* ------------------------------------------------------------------ */
/* Output and main loop                                                */
/* ------------------------------------------------------------------ */

static inline void wl_init_stdout(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
}

static inline void wl_print_step(const char *prog, uint64_t i, uint64_t sum)
{
    if (printf("step %" PRIu64 " %016" PRIx64 "\n", i, sum) < 0 || fflush(stdout) != 0)
        wl_die(prog, "writing to stdout:");
}

static inline void wl_print_done(const char *prog, uint64_t sum)
{
    if (printf("done %016" PRIx64 "\n", sum) < 0 || fflush(stdout) != 0)
        wl_die(prog, "writing to stdout:");
}

/* Sleep ms milliseconds; EINTR restarts with the remaining time. */
static inline void wl_sleep_ms(uint64_t ms)
{
    struct timespec req, rem;

    if (ms == 0)
        return;
    req.tv_sec = (time_t)(ms / 1000);
    req.tv_nsec = (long)((ms % 1000) * 1000000);
    while (nanosleep(&req, &rem) == -1 && errno == EINTR)
        req = rem;
}

/*
 * Runs the step loop: step(i) for i = 1..steps (forever when steps == 0),
 * printing "step <i> <sum>" after each and sleeping between steps.
 * Returns the checksum of the last step (0 if no step ran).
 */
static inline uint64_t wl_loop(const char *prog, const struct wl_common *o,
                               uint64_t (*step)(uint64_t i, void *ctx), void *ctx)
{
    uint64_t last = 0;

    for (uint64_t i = 1; o->steps == 0 || i <= o->steps; i++) {
        last = step(i, ctx);
        wl_print_step(prog, i, last);
        if (o->steps == 0 || i < o->steps)
            wl_sleep_ms(o->interval_ms);
    }
    return last;
}

/* Checksum for the "done" line: last step sum + extra final-state hash. */
static inline uint64_t wl_done_sum(uint64_t steps, uint64_t last, uint64_t extra)
{
    return wl_mix(wl_mix(wl_mix(0x646f6e65ULL /* "done" */, steps), last), extra);
}

/* ------------------------------------------------------------------ */
/* Full read/write on fds (EINTR-safe)                                 */
/* ------------------------------------------------------------------ */

/* Returns bytes read: n on success, 0 on EOF before any byte, -1 on error
 * or on EOF in the middle of the record. */
static inline ssize_t wl_read_full(int fd, void *buf, size_t n)
{
    size_t got = 0;

    while (got < n) {
        ssize_t r = read(fd, (char *)buf + got, n - got);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (r == 0) {
            if (got == 0)
                return 0;
            errno = EPIPE;
            return -1;
        }
        got += (size_t)r;
    }
    return (ssize_t)got;
}

static inline int wl_write_full(int fd, const void *buf, size_t n)
{
    size_t put = 0;

    while (put < n) {
        ssize_t r = write(fd, (const char *)buf + put, n - put);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        put += (size_t)r;
    }
    return 0;
}

#endif /* CKPTD_WORKLOADS_COMMON_H */
