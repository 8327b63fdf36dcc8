/*
 * fill: deterministic CUDA workload for GPU checkpoint/restore tests.
 *
 * Allocates --mib N MiB of device memory (cudaMalloc), fills it with a fixed
 * pattern, then each step runs a kernel that rewrites every 64-bit word from
 * its old value and the step number and sums a hash of every word on the
 * device (a wrapping 64-bit sum: order independent, so deterministic).  Prints
 * "step <i> <16 hex>" per step; at the end copies the whole buffer back to the
 * host, hashes it there and prints "done <16 hex>".
 *
 * Output contract: native/workloads/README.md (--steps, --interval-ms, usage
 * errors exit 2, runtime errors exit 1 with a message on stderr).  Integer
 * arithmetic only: the output depends on nothing but the flags.
 */
#include <cerrno>
#include <cinttypes>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

#include <cuda_runtime.h>

#define PROG "fill"

static const uint64_t GOLDEN = 0x9e3779b97f4a7c15ULL;

/* ---- hashing (the same functions as native/workloads/common.h) ---------- */

__host__ __device__ static inline uint64_t fmix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static inline uint64_t mix(uint64_t h, uint64_t v)
{
    return fmix(h ^ (v + GOLDEN + (h << 6) + (h >> 2)));
}

static inline uint64_t rotl(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static uint64_t hash_words(const uint64_t *w, size_t n, uint64_t h)
{
    for (size_t i = 0; i < n; i++) {
        h ^= w[i] * 0x87c37b91114253d5ULL;
        h = rotl(h, 31) * 0x4cf5ad432745937fULL + 0x52dce729ULL;
    }
    return h;
}

/* ---- errors and command line -------------------------------------------- */

static void die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

static void die(const char *fmt, ...)
{
    va_list ap;

    fprintf(stderr, PROG ": ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

#define CK(call)                                                               \
    do {                                                                       \
        cudaError_t err_ = (call);                                             \
        if (err_ != cudaSuccess)                                               \
            die("%s: %s (%s)", #call, cudaGetErrorString(err_),                \
                cudaGetErrorName(err_));                                       \
    } while (0)

static void usage(FILE *out)
{
    fprintf(out,
            "usage: " PROG " [--steps N] [--interval-ms M] [--mib N]\n"
            "  --steps N          number of steps, 0 = run forever (default 100)\n"
            "  --interval-ms M    sleep between steps in ms (default 100)\n"
            "  --mib N            device memory to fill and update, MiB (default 256)\n");
}

static void usage_error(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

static void usage_error(const char *fmt, ...)
{
    va_list ap;

    fprintf(stderr, PROG ": ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    usage(stderr);
    exit(2);
}

/* "NAME VALUE" or "NAME=VALUE" at argv[*i]: the value (consuming it), else NULL. */
static const char *match(int argc, char **argv, int *i, const char *name)
{
    const char *arg = argv[*i];
    size_t n = strlen(name);

    if (strncmp(arg, name, n) != 0)
        return NULL;
    if (arg[n] == '=')
        return arg + n + 1;
    if (arg[n] != '\0')
        return NULL;
    if (*i + 1 >= argc)
        usage_error("option '%s' requires a value", name);
    return argv[++*i];
}

static uint64_t number(const char *name, const char *v, uint64_t min, uint64_t max)
{
    char *end = NULL;
    unsigned long long x;

    if (*v < '0' || *v > '9')
        usage_error("invalid value '%s' for %s", v, name);
    errno = 0;
    x = strtoull(v, &end, 10);
    if (errno || *end != '\0')
        usage_error("invalid value '%s' for %s", v, name);
    if (x < min || x > max)
        usage_error("value for %s must be in [%" PRIu64 ", %" PRIu64 "]", name, min, max);
    return (uint64_t)x;
}

static void sleep_ms(uint64_t ms)
{
    struct timespec req, rem;

    if (ms == 0)
        return;
    req.tv_sec = (time_t)(ms / 1000);
    req.tv_nsec = (long)((ms % 1000) * 1000000);
    while (nanosleep(&req, &rem) == -1 && errno == EINTR)
        req = rem;
}

static void print_line(const char *what, const char *step, uint64_t sum)
{
    if (printf("%s%s%016" PRIx64 "\n", what, step, sum) < 0 || fflush(stdout) != 0)
        die("writing to stdout: %s", strerror(errno));
}

/* ---- kernels ------------------------------------------------------------- */

__global__ void fill_kernel(uint64_t *buf, size_t n, uint64_t seed)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;

    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        buf[i] = fmix(seed + (uint64_t)i * GOLDEN);
}

/* Rewrites every word from its old value and the step; adds a hash of each new
 * word to *sum (wrapping, so the order of the additions does not matter). */
__global__ void step_kernel(uint64_t *buf, size_t n, uint64_t step,
                            unsigned long long *sum)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    uint64_t local = 0;

    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        uint64_t w = buf[i];
        for (int r = 0; r < 4; r++)
            w = fmix(w ^ (step * GOLDEN + (uint64_t)i + (uint64_t)r));
        buf[i] = w;
        local += fmix(w + (uint64_t)i);
    }
    for (int offset = 16; offset > 0; offset /= 2)
        local += __shfl_down_sync(0xffffffffu, local, offset);
    if ((threadIdx.x & 31) == 0)
        atomicAdd(sum, (unsigned long long)local);
}

/* ---- main ----------------------------------------------------------------- */

int main(int argc, char **argv)
{
    uint64_t steps = 100, interval_ms = 100, mib = 256, last = 0;

    for (int i = 1; i < argc; i++) {
        const char *v;
        if ((v = match(argc, argv, &i, "--steps")))
            steps = number("--steps", v, 0, UINT64_MAX);
        else if ((v = match(argc, argv, &i, "--interval-ms")))
            interval_ms = number("--interval-ms", v, 0, 86400000ULL);
        else if ((v = match(argc, argv, &i, "--mib")))
            mib = number("--mib", v, 1, 1ULL << 20);
        else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            usage(stdout);
            return 0;
        } else if (argv[i][0] == '-')
            usage_error("unknown option '%s'", argv[i]);
        else
            usage_error("unexpected argument '%s'", argv[i]);
    }
    setvbuf(stdout, NULL, _IOLBF, 0);

    const size_t words = (size_t)(mib << 20) / sizeof(uint64_t);
    const unsigned threads = 256;
    int device = 0, sms = 0;
    uint64_t *buf = NULL;
    unsigned long long *sum = NULL;

    CK(cudaGetDevice(&device));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    /* The grid size only partitions the work: the sums do not depend on it. */
    size_t want = (words + threads - 1) / threads;
    unsigned blocks = (unsigned)(want < (size_t)sms * 8 ? want : (size_t)sms * 8);

    CK(cudaMalloc(&buf, words * sizeof(uint64_t)));
    CK(cudaMalloc(&sum, sizeof(*sum)));
    fill_kernel<<<blocks, threads>>>(buf, words, 0x66696c6cULL /* "fill" */);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());

    for (uint64_t i = 1; steps == 0 || i <= steps; i++) {
        unsigned long long device_sum = 0;
        char label[32];

        CK(cudaMemset(sum, 0, sizeof(*sum)));
        step_kernel<<<blocks, threads>>>(buf, words, i, sum);
        CK(cudaGetLastError());
        CK(cudaMemcpy(&device_sum, sum, sizeof(device_sum), cudaMemcpyDeviceToHost));
        last = mix(mix(mix(0x66696c6c73746570ULL /* "fillstep" */, i), device_sum), words);
        snprintf(label, sizeof(label), " %" PRIu64 " ", i);
        print_line("step", label, last);
        if (steps == 0 || i < steps)
            sleep_ms(interval_ms);
    }

    /* The done line covers every byte of device memory, hashed on the host. */
    const size_t chunk = (size_t)1 << 21; /* words: 16 MiB */
    std::vector<uint64_t> host(chunk < words ? chunk : words);
    uint64_t h = 0x646f6e65ULL ^ ((uint64_t)words * GOLDEN);
    for (size_t off = 0; off < words; off += host.size()) {
        size_t n = words - off < host.size() ? words - off : host.size();
        CK(cudaMemcpy(host.data(), buf + off, n * sizeof(uint64_t), cudaMemcpyDeviceToHost));
        h = hash_words(host.data(), n, h);
    }
    print_line("done", " ", mix(mix(mix(0x646f6e65ULL /* "done" */, steps), last), fmix(h)));
    CK(cudaFree(sum));
    CK(cudaFree(buf));
    return 0;
}
