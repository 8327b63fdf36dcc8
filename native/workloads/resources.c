/*
 * resources: open files, file-backed and anonymous shared memory, a unix
 * socketpair and one child process, all in one small process tree.
 *
 *   DIR/data.bin    opened O_RDWR|O_CREAT|O_TRUNC; each step reads at the
 *                   offset left by the previous step, appends 16 bytes,
 *                   lseeks to a step-dependent position and reads again.
 *                   Offsets (lseek(fd, 0, SEEK_CUR)) go into the checksum.
 *   DIR/mapped.bin  1 MiB, MAP_SHARED (fd closed after mmap); one page is
 *                   rewritten per step.
 *   anonymous       64 KiB MAP_SHARED|MAP_ANONYMOUS, shared with the child.
 *   socketpair      AF_UNIX/SOCK_STREAM: parent sends the step number, the
 *                   child updates the shared memory and sends an ack.
 *
 * Note: CRIU does not snapshot regular file contents, so a restore expects
 * DIR to be unchanged since the dump.
 */
#include "common.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>

#define PROG "resources"
#define MAPPED_SIZE (1u << 20)
#define SHM_SIZE (64u << 10)
#define REC_SIZE 16
#define SHM_CHUNK 256

struct state {
    int fd;               /* data.bin */
    unsigned char *fmap;  /* mapped.bin */
    unsigned char *shm;   /* anonymous shared */
    int sock;             /* parent's end of the socketpair */
    pid_t child;
    uint64_t x;
};

static void usage(FILE *out)
{
    fprintf(out,
            "usage: " PROG " --dir PATH [--steps N] [--interval-ms M]\n"
            WL_COMMON_USAGE
            "  --dir PATH         directory owned by this workload (required);\n"
            "                     data.bin and mapped.bin are created there\n",
            "100");
}

static void update_words(unsigned char *p, size_t len, uint64_t seed)
{
    for (size_t off = 0; off < len; off += 8) {
        uint64_t w;
        memcpy(&w, p + off, 8);
        w = w * 6364136223846793005ULL + wl_splitmix(&seed);
        memcpy(p + off, &w, 8);
    }
}

static __attribute__((noreturn)) void child_main(int sock, unsigned char *shm)
{
    uint64_t x = wl_seed(0x736f636bULL);

    for (;;) {
        uint64_t i, ack, counter;
        ssize_t r = wl_read_full(sock, &i, sizeof i);

        if (r == 0)
            _exit(0); /* parent closed the socket */
        if (r < 0)
            _exit(3);
        wl_xorshift(&x);
        /* Word 0 is a running sum; the rest is updated chunk-wise. */
        memcpy(&counter, shm, 8);
        counter += i;
        memcpy(shm, &counter, 8);
        size_t off = 8 + (size_t)(x % ((SHM_SIZE - 8) / SHM_CHUNK)) * SHM_CHUNK;
        update_words(shm + off, SHM_CHUNK, x ^ i);
        ack = wl_mix(wl_mix(x, i), wl_hash(shm + off, SHM_CHUNK, off));
        if (wl_write_full(sock, &ack, sizeof ack) < 0)
            _exit(4);
    }
}

static ssize_t read_retry(int fd, void *buf, size_t n)
{
    ssize_t r;

    do
        r = read(fd, buf, n);
    while (r < 0 && errno == EINTR);
    return r;
}

static off_t cur_off(int fd)
{
    off_t o = lseek(fd, 0, SEEK_CUR);
    if (o < 0)
        wl_die(PROG, "lseek:");
    return o;
}

static uint64_t step(uint64_t i, void *ctx)
{
    struct state *s = ctx;
    unsigned char buf[16];
    uint64_t h = wl_mix(0x7265736f75726365ULL, i);
    ssize_t n;
    off_t size, pos;
    uint64_t rec[2], ack;

    /* (a) data.bin: the offset left by the previous step matters. */
    h = wl_mix(h, (uint64_t)cur_off(s->fd));
    n = read_retry(s->fd, buf, 8);
    if (n < 0)
        wl_die(PROG, "read data.bin:");
    h = wl_mix(h, (uint64_t)n);
    h = wl_mix(h, wl_hash(buf, (size_t)n, 1));

    rec[0] = i;
    rec[1] = wl_xorshift(&s->x);
    if (lseek(s->fd, 0, SEEK_END) < 0)
        wl_die(PROG, "lseek:");
    if (wl_write_full(s->fd, rec, sizeof rec) < 0)
        wl_die(PROG, "write data.bin:");
    size = cur_off(s->fd);

    pos = (off_t)(wl_fmix(i) % (uint64_t)size);
    if (lseek(s->fd, pos, SEEK_SET) < 0)
        wl_die(PROG, "lseek:");
    n = read_retry(s->fd, buf, 12);
    if (n < 0)
        wl_die(PROG, "read data.bin:");
    h = wl_mix(h, (uint64_t)size);
    h = wl_mix(h, (uint64_t)n);
    h = wl_mix(h, wl_hash(buf, (size_t)n, 2));
    h = wl_mix(h, (uint64_t)cur_off(s->fd));

    /* (b) mapped.bin: rewrite one page, fold it in. */
    size_t pg = (size_t)(wl_xorshift(&s->x) % (MAPPED_SIZE / WL_PAGE));
    update_words(s->fmap + pg * WL_PAGE, WL_PAGE, s->x);
    h = wl_mix(h, pg);
    h = wl_mix(h, wl_hash(s->fmap + pg * WL_PAGE, WL_PAGE, pg));

    /* (c)+(d) child updates the shared anonymous memory. */
    if (wl_write_full(s->sock, &i, sizeof i) < 0)
        wl_die(PROG, "write to child:");
    n = wl_read_full(s->sock, &ack, sizeof ack);
    if (n <= 0) {
        if (n == 0)
            errno = EPIPE;
        wl_die(PROG, "read from child:");
    }
    h = wl_mix(h, ack);
    h = wl_mix(h, wl_hash(s->shm, SHM_SIZE, 3));
    return h;
}

static char *join(const char *dir, const char *name)
{
    size_t len = strlen(dir) + strlen(name) + 2;
    char *p = malloc(len);

    if (!p)
        wl_die(PROG, "out of memory:");
    snprintf(p, len, "%s/%s", dir, name);
    return p;
}

int main(int argc, char **argv)
{
    struct wl_common o = { .steps = 100, .interval_ms = 100 };
    struct wl_cli c = { .argc = argc, .argv = argv, .prog = PROG, .usage = usage };
    struct state s = { .x = wl_seed(0x7265736fULL) };
    const char *dir = NULL;
    char *data_path, *map_path;
    uint64_t last, extra;
    int sv[2], mfd, status;
    struct stat st;

    for (c.i = 1; c.i < argc; c.i++) {
        const char *v;
        if (wl_common_opt(&c, &o))
            continue;
        if ((v = wl_match(&c, "--dir")))
            dir = v;
        else
            wl_bad_arg(&c);
    }
    if (!dir || !*dir) {
        wl_usage_error(&c, "--dir is required");
    }
    wl_init_stdout();
    signal(SIGPIPE, SIG_IGN);

    if (stat(dir, &st) < 0 || !S_ISDIR(st.st_mode))
        wl_die(PROG, "%s is not a directory", dir);
    data_path = join(dir, "data.bin");
    map_path = join(dir, "mapped.bin");

    /* (a) */
    s.fd = open(data_path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (s.fd < 0)
        wl_die(PROG, "open %s:", data_path);

    /* (b) */
    mfd = open(map_path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (mfd < 0)
        wl_die(PROG, "open %s:", map_path);
    if (ftruncate(mfd, MAPPED_SIZE) < 0)
        wl_die(PROG, "ftruncate %s:", map_path);
    s.fmap = mmap(NULL, MAPPED_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
    if (s.fmap == MAP_FAILED)
        wl_die(PROG, "mmap %s:", map_path);
    close(mfd);
    update_words(s.fmap, MAPPED_SIZE, 0x6d6170ULL);

    /* (c) */
    s.shm = mmap(NULL, SHM_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (s.shm == MAP_FAILED)
        wl_die(PROG, "mmap shared anonymous:");
    update_words(s.shm, SHM_SIZE, 0x73686dULL);
    free(data_path);
    free(map_path);

    /* (d) */
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) < 0)
        wl_die(PROG, "socketpair:");
    fflush(NULL);
    s.child = fork();
    if (s.child < 0)
        wl_die(PROG, "fork:");
    if (s.child == 0) {
        close(sv[0]);
        close(s.fd);
        child_main(sv[1], s.shm);
    }
    close(sv[1]);
    s.sock = sv[0];

    last = wl_loop(PROG, &o, step, &s);

    close(s.sock);
    while (waitpid(s.child, &status, 0) < 0) {
        if (errno != EINTR)
            wl_die(PROG, "waitpid:");
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, PROG ": child exited abnormally (status 0x%x)\n", status);
        return 1;
    }

    /* Final line covers all of data.bin, mapped.bin and the shared memory. */
    extra = wl_mix((uint64_t)cur_off(s.fd), wl_hash(s.fmap, MAPPED_SIZE, 4));
    extra = wl_mix(extra, wl_hash(s.shm, SHM_SIZE, 5));
    {
        unsigned char chunk[65536];
        off_t off = 0;
        ssize_t n;

        while ((n = pread(s.fd, chunk, sizeof chunk, off)) != 0) {
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                wl_die(PROG, "read data.bin:");
            }
            extra = wl_mix(extra, wl_hash(chunk, (size_t)n, (uint64_t)off));
            off += n;
        }
        extra = wl_mix(extra, (uint64_t)off);
    }
    wl_print_done(PROG, wl_done_sum(o.steps, last, extra));
    return 0;
}
