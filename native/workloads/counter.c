/*
 * counter: single-threaded deterministic numeric loop.
 *
 * State: a xorshift64 PRNG, a double accumulator and (with --mem-mib K) a
 * K MiB heap buffer of which one 4 KiB page is rewritten per step.
 *
 * With --port P it also listens on 0.0.0.0:P (TCP).  After each step every
 * pending connection is accepted, sent "counter step <i> <checksum>\n" and
 * closed.  The socket is not part of the checksums: stdout is the same with
 * and without --port.
 *
 * With --fork-readers (and --mem-mib) each step forks a child that hashes
 * every page of the buffer and sends the hash to the parent over a pipe; the
 * parent mixes it into the step's checksum and reaps the child.  A process
 * forked after a restore reads memory its parent has not touched yet: with a
 * lazy restore, those pages reach the child through the fork.
 */
#include "common.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>

#define PROG "counter"
#define INNER 1000 /* PRNG/accumulator iterations per step */
#define HASHED_PAGES 3 /* extra random pages hashed per step */

struct state {
    uint64_t x;
    double acc;
    unsigned char *mem;
    size_t npages;
    int listen_fd; /* -1 without --port */
    int fork_readers;
    int drop_page;
};

static void usage(FILE *out)
{
    fprintf(out,
            "usage: " PROG " [--steps N] [--interval-ms M] [--mem-mib K] [--port P]\n"
            "               [--fork-readers] [--drop-page]\n"
            WL_COMMON_USAGE
            "  --mem-mib K        also allocate K MiB, modify one page per step\n"
            "                     (default 0)\n"
            "  --port P           listen on TCP 0.0.0.0:P; after each step, send each\n"
            "                     pending connection \"" PROG " step <i> <checksum>\" and\n"
            "                     close it (default 0 = off; stdout is unchanged)\n"
            "  --fork-readers     each step, fork a child that hashes every page of the\n"
            "                     --mem-mib buffer; its hash feeds the step's checksum\n"
            "  --drop-page        each step, madvise(MADV_DONTNEED) the page before it is\n"
            "                     rewritten (it reads back as zeros: the kernel refills it)\n",
            "100");
}

static uint64_t page_hash(const struct state *s, size_t pg)
{
    return wl_hash(s->mem + pg * WL_PAGE, WL_PAGE, pg);
}

/*
 * Fork a child that hashes every page of the buffer and writes the hash to a
 * pipe; return it once the child has exited 0.  Any failure ends the workload.
 */
static uint64_t forked_reader_hash(const struct state *s, uint64_t i)
{
    int fds[2], status;
    uint64_t h = 0;
    pid_t pid;

    if (pipe2(fds, O_CLOEXEC) != 0)
        wl_die(PROG, "pipe2:");
    pid = fork();
    if (pid < 0)
        wl_die(PROG, "fork:");
    if (pid == 0) {
        uint64_t c = wl_mix(0x6b6964ULL, i);
        close(fds[0]);
        for (size_t pg = 0; pg < s->npages; pg++)
            c = wl_mix(c, page_hash(s, pg));
        _exit(wl_write_full(fds[1], &c, sizeof c) < 0 ? 4 : 0);
    }
    close(fds[1]);
    if (wl_read_full(fds[0], &h, sizeof h) != (ssize_t)sizeof h)
        wl_die(PROG, "step %" PRIu64 ": the forked reader sent no hash", i);
    close(fds[0]);
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR)
            wl_die(PROG, "waitpid:");
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        wl_die(PROG, "step %" PRIu64 ": the forked reader failed (status %d)", i, status);
    return h;
}

/* Non-blocking TCP listener on 0.0.0.0:port (SO_REUSEADDR, backlog 8). */
static int listen_on(uint16_t port)
{
    struct sockaddr_in sa;
    int one = 1;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);

    if (fd < 0)
        wl_die(PROG, "socket:");
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0)
        wl_die(PROG, "setsockopt(SO_REUSEADDR):");
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    sa.sin_port = htons(port);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0)
        wl_die(PROG, "bind to 0.0.0.0:%u:", (unsigned)port);
    if (listen(fd, 8) != 0)
        wl_die(PROG, "listen:");
    return fd;
}

/*
 * Accept every pending connection without blocking, send each the state line
 * and close it.  Errors on one client are ignored (the client may be gone);
 * none of this touches the deterministic state.
 */
static void serve_pending(int lfd, uint64_t i, uint64_t sum)
{
    char line[96];
    int n = snprintf(line, sizeof line, PROG " step %" PRIu64 " %016" PRIx64 "\n", i, sum);

    for (;;) {
        int cfd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);

        if (cfd < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO)
                continue;
            return; /* EAGAIN: nothing pending; anything else: try next step */
        }
        /* A fresh socket's send buffer takes the short line in one go. */
        while (send(cfd, line, (size_t)n, MSG_NOSIGNAL) < 0 && errno == EINTR)
            ;
        close(cfd);
    }
}

static uint64_t step(uint64_t i, void *ctx)
{
    struct state *s = ctx;
    uint64_t h;

    for (int k = 0; k < INNER; k++) {
        wl_xorshift(&s->x);
        s->acc = s->acc * 0.999 + (double)(s->x % 1000) / 7.0;
    }
    h = wl_mix(0x636f756e746572ULL, i);
    h = wl_mix(h, s->x);
    h = wl_mix(h, wl_dbits(s->acc));

    if (s->npages) {
        size_t pg = (size_t)(wl_xorshift(&s->x) % s->npages);
        uint64_t r = s->x ^ i;
        unsigned char *p = s->mem + pg * WL_PAGE;

        if (s->drop_page && madvise(p, WL_PAGE, MADV_DONTNEED) != 0)
            wl_die(PROG, "madvise(MADV_DONTNEED):");

        /* New content depends on the old content: history matters. */
        for (size_t off = 0; off < WL_PAGE; off += 8) {
            uint64_t w;
            memcpy(&w, p + off, 8);
            w = w * 6364136223846793005ULL + wl_splitmix(&r);
            memcpy(p + off, &w, 8);
        }
        h = wl_mix(h, pg);
        h = wl_mix(h, page_hash(s, pg));
        for (int k = 0; k < HASHED_PAGES; k++) {
            size_t q = (size_t)(wl_xorshift(&s->x) % s->npages);
            h = wl_mix(h, q);
            h = wl_mix(h, page_hash(s, q));
        }
    }
    if (s->fork_readers && s->npages)
        h = wl_mix(h, forked_reader_hash(s, i));
    if (s->listen_fd >= 0)
        serve_pending(s->listen_fd, i, h);
    return h;
}

int main(int argc, char **argv)
{
    struct wl_common o = { .steps = 100, .interval_ms = 100 };
    struct wl_cli c = { .argc = argc, .argv = argv, .prog = PROG, .usage = usage };
    struct state s = { .x = wl_seed(0xc0ffee), .acc = 0.0, .listen_fd = -1 };
    uint64_t mem_mib = 0, port = 0, last, extra = 0;

    for (c.i = 1; c.i < argc; c.i++) {
        const char *v;
        if (wl_common_opt(&c, &o))
            continue;
        if ((v = wl_match(&c, "--mem-mib")))
            mem_mib = wl_u64(&c, "--mem-mib", v, 0, 1ULL << 20);
        else if ((v = wl_match(&c, "--port")))
            port = wl_u64(&c, "--port", v, 0, 65535);
        else if (strcmp(argv[c.i], "--fork-readers") == 0)
            s.fork_readers = 1;
        else if (strcmp(argv[c.i], "--drop-page") == 0)
            s.drop_page = 1;
        else
            wl_bad_arg(&c);
    }
    if ((s.fork_readers || s.drop_page) && !mem_mib)
        wl_die(PROG, "--fork-readers and --drop-page need --mem-mib K (the buffer)");
    wl_init_stdout();

    if (mem_mib) {
        size_t bytes = (size_t)mem_mib << 20;
        uint64_t seed = 0x6d656d;

        /* --drop-page madvises single pages: page-aligned memory of its own */
        s.mem = s.drop_page ? mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
                            : malloc(bytes);
        if (s.mem == MAP_FAILED)
            s.mem = NULL;
        if (!s.mem)
            wl_die(PROG, "cannot allocate %" PRIu64 " MiB:", mem_mib);
        s.npages = bytes / WL_PAGE;
        for (size_t off = 0; off < bytes; off += 8) {
            uint64_t w = wl_splitmix(&seed);
            memcpy(s.mem + off, &w, 8);
        }
    }

    if (port)
        s.listen_fd = listen_on((uint16_t)port);

    last = wl_loop(PROG, &o, step, &s);

    /* Final line also covers every page of the buffer. */
    for (size_t pg = 0; pg < s.npages; pg++)
        extra = wl_mix(extra, page_hash(&s, pg));
    wl_print_done(PROG, wl_done_sum(o.steps, last, wl_mix(extra, wl_dbits(s.acc))));
    if (s.drop_page)
        munmap(s.mem, (size_t)mem_mib << 20);
    else
        free(s.mem);
    if (s.listen_fd >= 0)
        close(s.listen_fd);
    return 0;
}
