/*
 * bigmem: a large anonymous mapping with a realistic page mix, for
 * checkpoint size/speed benchmarks.
 *
 * Every 4 KiB page gets a fixed kind (derived from its index only):
 *   ~40% float32 "weights" (approximately normal, std ~0.02)
 *   ~30% zero pages, never touched (not even read) before the first step
 *   ~30% text: JSON-ish ASCII records with varying numbers
 * --random makes every page random bytes instead (incompressible, no zero pages).
 * --rewrite-pct P rewrites P% of the non-zero pages every step (new content
 * of the same kind, chosen by the PRNG).  SIGUSR1 requests one extra
 * rewrite round (P%, or 5% when P is 0) at the next step.
 * The per-step checksum only hashes a handful of pages (cheap); the final
 * "done" line hashes the whole mapping.
 */
#include "common.h"

#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/mman.h>

#define PROG "bigmem"
#define HASHED_PAGES 8
#define SIGNAL_PCT 5

enum kind { K_FLOAT, K_ZERO, K_TEXT, K_RANDOM };

static int all_random;

struct state {
    unsigned char *mem;
    size_t npages;
    uint32_t *nz; /* indices of non-zero pages */
    size_t nnz;
    size_t zero_pg; /* one zero page, checked every step (SIZE_MAX: none) */
    uint64_t x;
    uint64_t rewrites;
    unsigned pct;
};

static atomic_int usr1_pending;

static void usage(FILE *out)
{
    fprintf(out,
            "usage: " PROG " [--steps N] [--interval-ms M] [--mib N] [--rewrite-pct P]\n"
            "              [--ready-file PATH]\n"
            WL_COMMON_USAGE
            "  --mib N            size of the mapping in MiB (default 1024)\n"
            "  --rewrite-pct P    rewrite P%% of non-zero pages each step (default 0)\n"
            "  --random           every page random bytes (default: the mix above)\n"
            "  --ready-file PATH  write \"ready\\n\" to PATH once the memory is filled\n"
            "SIGUSR1: one extra rewrite round (P%%, or %d%% if P is 0) at the next step\n",
            "1000", SIGNAL_PCT);
}

static void on_usr1(int sig)
{
    (void)sig;
    atomic_store(&usr1_pending, 1);
}

static enum kind page_kind(size_t pg)
{
    uint64_t r = wl_fmix((uint64_t)pg + 0x6b696e64ULL) % 10;
    if (all_random)
        return K_RANDOM;
    return r < 4 ? K_FLOAT : r < 7 ? K_ZERO : K_TEXT;
}

static void fill_float(unsigned char *p, uint64_t seed)
{
    float v[WL_PAGE / sizeof(float)];

    for (size_t k = 0; k < WL_PAGE / sizeof(float); k++) {
        uint64_t r = wl_splitmix(&seed);
        /* Irwin-Hall(4): sum of four 16-bit uniforms, roughly normal. */
        uint32_t sum = (uint32_t)(r & 0xffff) + (uint32_t)((r >> 16) & 0xffff) +
                       (uint32_t)((r >> 32) & 0xffff) + (uint32_t)(r >> 48);
        v[k] = ((float)sum * (1.0f / 65536.0f) - 2.0f) * 0.035f;
    }
    memcpy(p, v, WL_PAGE);
}

static char *put_str(char *p, const char *s)
{
    size_t n = strlen(s);
    memcpy(p, s, n);
    return p + n;
}

/* Decimal, zero-padded to at least `width` digits. */
static char *put_uint(char *p, uint64_t v, int width)
{
    char tmp[24];
    int n = 0;

    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n < width)
        tmp[n++] = '0';
    while (n)
        *p++ = tmp[--n];
    return p;
}

static void fill_text(unsigned char *page, uint64_t seed)
{
    static const char *const events[] = {
        "login", "logout", "click", "view", "purchase", "search", "upload", "share",
    };
    char buf[WL_PAGE + 256];
    char *p = buf;

    while (p < buf + WL_PAGE) {
        uint64_t a = wl_splitmix(&seed), b = wl_splitmix(&seed);
        p = put_str(p, "{\"id\":");
        p = put_uint(p, a % 10000000, 0);
        p = put_str(p, ",\"user\":\"user_");
        p = put_uint(p, (a >> 24) % 10000, 4);
        p = put_str(p, "\",\"event\":\"");
        p = put_str(p, events[(a >> 40) % 8]);
        p = put_str(p, "\",\"score\":");
        p = put_uint(p, b % 100, 0);
        *p++ = '.';
        p = put_uint(p, (b >> 8) % 10000, 4);
        p = put_str(p, ",\"ts\":");
        p = put_uint(p, 1700000000 + (b >> 24) % 100000000, 0);
        p = put_str(p, (b >> 60) & 1 ? ",\"ok\":true}\n" : ",\"ok\":false}\n");
    }
    memcpy(page, buf, WL_PAGE);
}

static void fill_random(unsigned char *p, uint64_t seed)
{
    for (size_t k = 0; k < WL_PAGE; k += sizeof(uint64_t)) {
        uint64_t r = wl_splitmix(&seed);
        memcpy(p + k, &r, sizeof r);
    }
}

static void fill_page(struct state *s, size_t pg, uint64_t seed)
{
    unsigned char *p = s->mem + pg * WL_PAGE;

    if (page_kind(pg) == K_RANDOM)
        fill_random(p, seed);
    else if (page_kind(pg) == K_FLOAT)
        fill_float(p, seed);
    else
        fill_text(p, seed);
}

static uint64_t page_hash(const struct state *s, size_t pg)
{
    return wl_hash(s->mem + pg * WL_PAGE, WL_PAGE, pg);
}

static size_t pct_of(size_t n, unsigned pct)
{
    return (size_t)(((uint64_t)n * pct + 99) / 100);
}

static uint64_t step(uint64_t i, void *ctx)
{
    struct state *s = ctx;
    size_t count = 0;
    uint64_t h;

    if (s->pct)
        count += pct_of(s->nnz, s->pct);
    if (atomic_exchange(&usr1_pending, 0))
        count += pct_of(s->nnz, s->pct ? s->pct : SIGNAL_PCT);
    if (s->nnz) {
        for (size_t k = 0; k < count; k++) {
            size_t pg = s->nz[wl_xorshift(&s->x) % s->nnz];
            fill_page(s, pg, wl_xorshift(&s->x));
        }
        s->rewrites += count;
    }

    h = wl_mix(0x6269676d656dULL, i);
    h = wl_mix(h, s->rewrites);
    for (int k = 0; k < HASHED_PAGES && s->nnz; k++) {
        size_t pg = s->nz[wl_xorshift(&s->x) % s->nnz];
        h = wl_mix(h, pg);
        h = wl_mix(h, page_hash(s, pg));
    }
    if (s->zero_pg != SIZE_MAX)
        h = wl_mix(h, page_hash(s, s->zero_pg));
    return wl_mix(h, s->x);
}

static void write_ready(const char *path)
{
    size_t len = strlen(path) + 5;
    char *tmp = malloc(len);
    int fd;

    if (!tmp)
        wl_die(PROG, "out of memory:");
    snprintf(tmp, len, "%s.tmp", path);
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        wl_die(PROG, "open %s:", tmp);
    if (wl_write_full(fd, "ready\n", 6) < 0 || close(fd) < 0)
        wl_die(PROG, "write %s:", tmp);
    /* rename: readers never see an empty or partial file */
    if (rename(tmp, path) < 0)
        wl_die(PROG, "rename %s:", path);
    free(tmp);
}

int main(int argc, char **argv)
{
    struct wl_common o = { .steps = 100, .interval_ms = 1000 };
    struct wl_cli c = { .argc = argc, .argv = argv, .prog = PROG, .usage = usage };
    struct state s = { .x = wl_seed(0x626967ULL), .zero_pg = SIZE_MAX };
    const char *ready = NULL;
    uint64_t mib = 1024, last, extra = 0;
    size_t bytes;
    struct sigaction sa;

    for (c.i = 1; c.i < argc; c.i++) {
        const char *v;
        if (wl_common_opt(&c, &o))
            continue;
        if ((v = wl_match(&c, "--mib")))
            mib = wl_u64(&c, "--mib", v, 1, 1ULL << 24);
        else if ((v = wl_match(&c, "--rewrite-pct")))
            s.pct = (unsigned)wl_u64(&c, "--rewrite-pct", v, 0, 100);
        else if ((v = wl_match(&c, "--ready-file")))
            ready = v;
        else if (strcmp(argv[c.i], "--random") == 0)
            all_random = 1;
        else
            wl_bad_arg(&c);
    }
    wl_init_stdout();

    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGUSR1, &sa, NULL) < 0)
        wl_die(PROG, "sigaction:");

    bytes = (size_t)mib << 20;
    s.npages = bytes / WL_PAGE;
    s.mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (s.mem == MAP_FAILED)
        wl_die(PROG, "mmap %" PRIu64 " MiB:", mib);
    /* Keep 4 KiB granularity so zero pages really stay unpopulated even with
     * THP=always (a huge page would materialise its zero 4 KiB pages). */
    (void)madvise(s.mem, bytes, MADV_NOHUGEPAGE);

    s.nz = malloc(s.npages * sizeof *s.nz);
    if (!s.nz)
        wl_die(PROG, "out of memory:");
    for (size_t pg = 0; pg < s.npages; pg++) {
        if (page_kind(pg) == K_ZERO) {
            if (s.zero_pg == SIZE_MAX)
                s.zero_pg = pg;
            continue;
        }
        s.nz[s.nnz++] = (uint32_t)pg;
        fill_page(&s, pg, wl_fmix(pg ^ 0x66696c6cULL));
    }
    if (ready)
        write_ready(ready);

    last = wl_loop(PROG, &o, step, &s);

    for (size_t pg = 0; pg < s.npages; pg++)
        extra = wl_mix(extra, page_hash(&s, pg));
    wl_print_done(PROG, wl_done_sum(o.steps, last, extra));
    free(s.nz);
    munmap(s.mem, bytes);
    return 0;
}
