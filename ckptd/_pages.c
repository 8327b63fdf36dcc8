/*
 * ckptd._pages: the store's per-page data path in C (docs/adr/0012-native-page-path.md).
 *
 * Every call that touches page contents runs without the GIL; calls over big buffers
 * split the pages across threads (up to the CPUs this process may run on):
 *
 *   hash_pages(buffer, seed, zero_ref=False, threads=0) -> bytes
 *       xxh3-128 (64-bit seed) of every 4 KiB page, canonical (big-endian) form,
 *       concatenated: byte-identical to xxhash.xxh3_128_digest(page, seed=seed).
 *       zero_ref=True: a page of zeros gives 16 zero bytes (ZERO_REF) and is not hashed.
 *   verify_pages(buffer, hashes, seed, threads=0) -> int
 *       index of the first page whose hash is not the one in `hashes`, -1 if none.
 *   plan_new(refs, known, fresh, start=0) -> (list[bytes], list[tuple[int, int]])
 *       (GIL held: it looks up Python containers) the references one by one, and the
 *       runs (first page, count) of pages neither zero, `in known`, nor in the set `fresh`
 *       (first occurrences only; each is added to `fresh`); pages numbered from `start`.
 *   compress_frame(data, level, codec=CODEC_ZSTD) -> bytes | None
 *       a zstd frame (level: zstd's, negative for its fast levels) or an LZ4 frame (level:
 *       LZ4F's, 0 the default fast mode, negative faster) of `data`, always strictly shorter
 *       than it; None when `data` does not compress (decided on a sample of its pages,
 *       confirmed on the result): the caller stores it as it is, and a frame exactly
 *       len(data) long is how readers know it. Both formats declare their content size.
 *   decompress_frame(frame, size) -> bytes
 *       a zstd or LZ4 frame (told apart by their magic numbers) decompressed: exactly `size`
 *       bytes, its declared content size `size`, or ValueError saying what is wrong.
 *   concat_digest(parts) -> (bytes, bytes)
 *   digest_parts(parts) -> bytes
 *       the parts concatenated (a pack), and its xxh3-128 (unseeded, canonical: its name).
 *   slot_counts(buffers, pages) -> dict[int, int]
 *       (GIL held) the references of every buffer looked up in the dict `pages` (hash ->
 *       code): how many distinct codes each slot (code >> 32) has (a commit's footprint).
 *   encode_delta(refs, base, base_hash) -> bytes
 *       pagelist.encode_delta, the same bytes, of packed references against a packed base.
 *   code_runs(codes, refs, start=0) -> (list[tuple[int, int, int]], list[int])
 *       (GIL held) for a restore's plan: the runs (position, first code, count) of
 *       consecutive index codes, and where a page is neither located nor ZERO_REF.
 *   gather_pages(buffer, runs) -> bytes
 *       the pages of each run (first page, count) of `buffer`, concatenated (a frame).
 *   write_runs(fd, buffer, runs) -> None
 *       pwrite every run (page in the file, page in buffer, count) of `buffer`'s pages.
 *   ps_entries(rbuf, rpos, rend, chunk, fill, dst_id, v42) -> (rpos, fill, entries, n, pages)
 *       the page-server receiver's inner loop (adapters/criu/pageserver.py): the messages
 *       PS_IOV_ADD / ADD_F / HOLE for `dst_id` that lie whole in rbuf[rpos:rend] (header
 *       and pages), in order, each PRESENT one's pages copied to chunk[fill:] while they fit,
 *       each encoded as its pagemap entry (CRIU 4.2's layout, or 4.1's with v42 false) into
 *       `entries`; stops, consuming nothing more, at the first message it cannot take whole
 *       (another command or image, cut short, pages not fitting): the caller's slow path
 *       takes that one. n entries, of which `pages` pages, were taken.
 *   pagemap_columns(image) -> (pages_id, vaddrs, counts, flags, firsts)
 *       a CRIU pagemap image (its magics not checked: the caller does) as columns, for a
 *       lazy restore (adapters/criu/lazypages.py); ValueError if it is cut short.
 *
 * Buffers are held (PyBUF_SIMPLE) for the whole call, so an mmap cannot be closed or a
 * bytearray resized under the threads. Sizes are size_t / Py_ssize_t throughout: buffers
 * over 4 GiB are fine.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>
#include <zstd.h>
#include <lz4.h>
#include <lz4frame.h>

#define PAGE 4096
#define HASH 16
#define MIN_PAGES_PER_THREAD 256 /* 1 MiB: below that a thread costs more than it saves */
#define MAX_THREADS 64
#define SAMPLE_PAGES 16
#define CODEC_ZSTD 0
#define CODEC_LZ4 1
/* A sample that saves less than 1/32 of its size means the frame is stored raw. */
#define SAMPLE_MIN_GAIN_SHIFT 5

/* ---- threads ------------------------------------------------------------------------ */

typedef struct {
    const unsigned char *data;
    const unsigned char *expected; /* verify: the hashes to match */
    unsigned char *out;            /* hash: where the hashes go */
    size_t first, end;             /* pages [first, end) */
    uint64_t seed;
    int zero_ref;
    size_t bad; /* verify: first mismatching page in [first, end), or SIZE_MAX */
} job_t;

static int usable_cpus(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0)
            return n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* How many threads for `pages` pages (`asked` > 0: that many, at most one per page). */
static int thread_count(size_t pages, int asked)
{
    size_t n;
    if (asked > 0)
        n = (size_t)asked;
    else {
        n = (size_t)usable_cpus();
        size_t by_size = pages / MIN_PAGES_PER_THREAD;
        if (by_size < n)
            n = by_size;
    }
    if (n > pages)
        n = pages;
    if (n > MAX_THREADS)
        n = MAX_THREADS;
    return n < 1 ? 1 : (int)n;
}

/* Split pages [0, pages) into `n` jobs (copies of `proto`) and run them: job 0 on the
 * calling thread, the others on new threads (or here too, if a thread cannot start). */
static void run_split(void *(*fn)(void *), const job_t *proto, size_t pages, int n,
                      job_t *jobs)
{
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS];
    size_t base = pages / (size_t)n, extra = pages % (size_t)n, at = 0;
    for (int i = 0; i < n; i++) {
        jobs[i] = *proto;
        jobs[i].first = at;
        at += base + ((size_t)i < extra ? 1 : 0);
        jobs[i].end = at;
        jobs[i].bad = SIZE_MAX;
    }
    /* helpers block every signal (Python handles them on its own threads) and need
     * little stack */
    sigset_t all, old;
    pthread_attr_t attr;
    int have_attr = n > 1 && pthread_attr_init(&attr) == 0;
    if (have_attr)
        pthread_attr_setstacksize(&attr, 512 * 1024);
    sigfillset(&all);
    int masked = n > 1 && pthread_sigmask(SIG_SETMASK, &all, &old) == 0;
    for (int i = 1; i < n; i++)
        started[i] = pthread_create(&tid[i], have_attr ? &attr : NULL, fn, &jobs[i]) == 0;
    if (masked)
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (have_attr)
        pthread_attr_destroy(&attr);
    fn(&jobs[0]);
    for (int i = 1; i < n; i++) {
        if (started[i])
            pthread_join(tid[i], NULL);
        else
            fn(&jobs[i]);
    }
}

/* ---- pages -------------------------------------------------------------------------- */

static int page_is_zero(const unsigned char *p)
{
    uint64_t w;
    memcpy(&w, p, sizeof w); /* most pages end here */
    if (w)
        return 0;
    for (size_t off = 0; off < PAGE; off += 64) {
        uint64_t acc = 0, v;
        for (size_t k = 0; k < 64; k += 8) {
            memcpy(&v, p + off + k, sizeof v);
            acc |= v;
        }
        if (acc)
            return 0;
    }
    return 1;
}

static void *hash_job(void *arg)
{
    job_t *j = arg;
    for (size_t p = j->first; p < j->end; p++) {
        const unsigned char *page = j->data + p * PAGE;
        unsigned char *o = j->out + p * HASH;
        if (j->zero_ref && page_is_zero(page)) {
            memset(o, 0, HASH);
            continue;
        }
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits_withSeed(page, PAGE, j->seed));
        memcpy(o, c.digest, HASH);
    }
    return NULL;
}

static void *verify_job(void *arg)
{
    job_t *j = arg;
    for (size_t p = j->first; p < j->end; p++) {
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits_withSeed(j->data + p * PAGE, PAGE, j->seed));
        if (memcmp(c.digest, j->expected + p * HASH, HASH) != 0) {
            j->bad = p;
            break;
        }
    }
    return NULL;
}

/* ---- argument helpers ------------------------------------------------------------------- */

static int seed_arg(PyObject *obj, uint64_t *seed)
{
    if (!PyLong_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "seed must be an int");
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj); /* OverflowError: < 0, >= 2**64 */
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *seed = (uint64_t)v;
    return 0;
}

static int whole_pages(const Py_buffer *buf)
{
    if (buf->len % PAGE != 0) {
        PyErr_Format(PyExc_ValueError, "buffer of %zd bytes is not a whole number of %d-byte pages",
                     buf->len, PAGE);
        return -1;
    }
    return 0;
}

/* ---- hash_pages ------------------------------------------------------------------------ */

static PyObject *hash_pages(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buffer", "seed", "zero_ref", "threads", NULL};
    Py_buffer buf;
    PyObject *seed_obj, *out = NULL;
    int zero_ref = 0, threads = 0;
    uint64_t seed;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*O|$pi:hash_pages", kwlist, &buf, &seed_obj,
                                     &zero_ref, &threads))
        return NULL;
    if (seed_arg(seed_obj, &seed) < 0 || whole_pages(&buf) < 0)
        goto done;
    size_t pages = (size_t)buf.len / PAGE;
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(pages * HASH));
    if (out == NULL || pages == 0)
        goto done;
    job_t proto = {.data = buf.buf, .out = (unsigned char *)PyBytes_AS_STRING(out),
                   .seed = seed, .zero_ref = zero_ref};
    job_t jobs[MAX_THREADS];
    int n = thread_count(pages, threads);
    Py_BEGIN_ALLOW_THREADS
    run_split(hash_job, &proto, pages, n, jobs);
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&buf);
    return out;
}

/* ---- verify_pages ------------------------------------------------------------------------ */

static PyObject *verify_pages(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buffer", "hashes", "seed", "threads", NULL};
    Py_buffer buf, hashes;
    PyObject *seed_obj, *out = NULL;
    int threads = 0;
    uint64_t seed;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*y*O|$i:verify_pages", kwlist, &buf,
                                     &hashes, &seed_obj, &threads))
        return NULL;
    if (seed_arg(seed_obj, &seed) < 0 || whole_pages(&buf) < 0)
        goto done;
    size_t pages = (size_t)buf.len / PAGE;
    if ((size_t)hashes.len != pages * HASH) {
        PyErr_Format(PyExc_ValueError, "%zu pages but %zd bytes of hashes (want %zu)", pages,
                     hashes.len, pages * HASH);
        goto done;
    }
    size_t bad = SIZE_MAX;
    if (pages) {
        job_t proto = {.data = buf.buf, .expected = hashes.buf, .seed = seed};
        job_t jobs[MAX_THREADS];
        int n = thread_count(pages, threads);
        Py_BEGIN_ALLOW_THREADS
        run_split(verify_job, &proto, pages, n, jobs);
        Py_END_ALLOW_THREADS
        for (int i = 0; i < n; i++) {
            if (jobs[i].bad != SIZE_MAX) {
                bad = jobs[i].bad; /* jobs are in page order: the first is the lowest */
                break;
            }
        }
    }
    out = PyLong_FromSsize_t(bad == SIZE_MAX ? -1 : (Py_ssize_t)bad);
done:
    PyBuffer_Release(&hashes);
    PyBuffer_Release(&buf);
    return out;
}

/* ---- plan_new ---------------------------------------------------------------------------- */

static int flush_run(PyObject *runs, size_t first, size_t count)
{
    if (count == 0)
        return 0;
    PyObject *run = Py_BuildValue("(nn)", (Py_ssize_t)first, (Py_ssize_t)count);
    if (run == NULL)
        return -1;
    int rc = PyList_Append(runs, run);
    Py_DECREF(run);
    return rc;
}

static PyObject *plan_new(PyObject *self, PyObject *args)
{
    Py_buffer refs;
    PyObject *known, *fresh, *list = NULL, *runs = NULL, *zero = NULL, *result = NULL;
    static const unsigned char zeros[HASH];
    (void)self;
    Py_ssize_t start = 0;
    if (!PyArg_ParseTuple(args, "y*OO|n:plan_new", &refs, &known, &fresh, &start))
        return NULL;
    if (start < 0) {
        PyErr_SetString(PyExc_ValueError, "start must not be negative");
        goto done;
    }
    if (!PyAnySet_Check(fresh) || PyFrozenSet_Check(fresh)) {
        PyErr_SetString(PyExc_TypeError, "fresh must be a set");
        goto done;
    }
    if (refs.len % HASH != 0) {
        PyErr_Format(PyExc_ValueError, "references of %zd bytes are not a whole number of %d",
                     refs.len, HASH);
        goto done;
    }
    size_t count = (size_t)refs.len / HASH, run_first = 0, run_len = 0;
    const unsigned char *r = refs.buf;
    if ((list = PyList_New((Py_ssize_t)count)) == NULL || (runs = PyList_New(0)) == NULL ||
        (zero = PyBytes_FromStringAndSize((const char *)zeros, HASH)) == NULL)
        goto done;
    for (size_t i = 0; i < count; i++) {
        const unsigned char *h = r + i * HASH;
        if (memcmp(h, zeros, HASH) == 0) {
            Py_INCREF(zero);
            PyList_SET_ITEM(list, (Py_ssize_t)i, zero);
            continue;
        }
        PyObject *ref = PyBytes_FromStringAndSize((const char *)h, HASH);
        if (ref == NULL)
            goto done;
        PyList_SET_ITEM(list, (Py_ssize_t)i, ref); /* the list owns it */
        int seen = PySet_Contains(fresh, ref);
        if (seen == 0)
            seen = PySequence_Contains(known, ref);
        if (seen < 0)
            goto done;
        if (seen)
            continue;
        if (PySet_Add(fresh, ref) < 0)
            goto done;
        if (run_len && i == run_first + run_len) {
            run_len++;
            continue;
        }
        if (flush_run(runs, (size_t)start + run_first, run_len) < 0)
            goto done;
        run_first = i;
        run_len = 1;
    }
    if (flush_run(runs, (size_t)start + run_first, run_len) < 0)
        goto done;
    result = PyTuple_Pack(2, list, runs);
done:
    Py_XDECREF(zero);
    Py_XDECREF(runs);
    Py_XDECREF(list); /* a NULL item (error half-way) is fine for list_dealloc */
    PyBuffer_Release(&refs);
    return result;
}

/* ---- compress_frame, decompress_frame ------------------------------------------------- */

/* Each thread's contexts (kept: the executor's threads live long). */
typedef struct {
    ZSTD_CCtx *zc;
    ZSTD_DCtx *zd;
    LZ4F_dctx *ld;
} contexts_t;

static pthread_key_t ctx_key;

static void free_contexts(void *p)
{
    contexts_t *c = p;
    ZSTD_freeCCtx(c->zc);
    ZSTD_freeDCtx(c->zd);
    if (c->ld != NULL)
        LZ4F_freeDecompressionContext(c->ld);
    free(c);
}

static contexts_t *thread_contexts(void)
{
    contexts_t *c = pthread_getspecific(ctx_key);
    if (c == NULL) {
        if ((c = calloc(1, sizeof *c)) == NULL)
            return NULL;
        if (pthread_setspecific(ctx_key, c) != 0) {
            free(c);
            return NULL;
        }
    }
    return c;
}

static ZSTD_CCtx *thread_zstd_cctx(void)
{
    contexts_t *c = thread_contexts();
    if (c != NULL && c->zc == NULL)
        c->zc = ZSTD_createCCtx();
    return c ? c->zc : NULL;
}

static void lz4_prefs(LZ4F_preferences_t *prefs, size_t len, int level)
{
    memset(prefs, 0, sizeof *prefs);
    prefs->frameInfo.blockSizeID = LZ4F_max4MB;
    prefs->frameInfo.blockMode = LZ4F_blockIndependent;
    prefs->frameInfo.contentSize = len;
    prefs->compressionLevel = level;
}

static size_t codec_bound(int codec, size_t len, int level)
{
    if (codec == CODEC_LZ4) {
        LZ4F_preferences_t prefs;
        lz4_prefs(&prefs, len, level);
        return LZ4F_compressFrameBound(len, &prefs);
    }
    return ZSTD_compressBound(len);
}

/* `len` bytes of `src` as one frame of `codec` into `dst` (`cap` bytes): its length, or 0
 * when it could not be made. */
static size_t codec_compress(int codec, ZSTD_CCtx *zc, void *dst, size_t cap, const void *src,
                             size_t len, int level)
{
    if (codec == CODEC_LZ4) {
        LZ4F_preferences_t prefs;
        lz4_prefs(&prefs, len, level);
        size_t got = LZ4F_compressFrame(dst, cap, src, len, &prefs);
        return LZ4F_isError(got) ? 0 : got;
    }
    size_t got = ZSTD_compressCCtx(zc, dst, cap, src, len, level);
    return ZSTD_isError(got) ? 0 : got;
}

/* Whether SAMPLE_PAGES pages spread over the frame compress at all (1), not (0), or the
 * sample could not be made (-1: compress the whole frame, the result decides). */
static int sample_compresses(int codec, ZSTD_CCtx *zc, const unsigned char *data, size_t pages,
                             int level)
{
    if (pages <= SAMPLE_PAGES)
        return -1; /* small frame: compressing it is as cheap as a sample */
    size_t in_len = SAMPLE_PAGES * PAGE, cap = codec_bound(codec, in_len, level);
    unsigned char *sample = malloc(in_len + cap);
    if (sample == NULL)
        return -1;
    for (size_t k = 0; k < SAMPLE_PAGES; k++)
        memcpy(sample + k * PAGE, data + (k * pages / SAMPLE_PAGES) * PAGE, PAGE);
    size_t got = codec_compress(codec, zc, sample + in_len, cap, sample, in_len, level);
    free(sample);
    if (got == 0)
        return -1;
    return got < in_len - (in_len >> SAMPLE_MIN_GAIN_SHIFT);
}

static PyObject *compress_frame(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    int level, codec = CODEC_ZSTD;
    PyObject *out = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*i|i:compress_frame", &buf, &level, &codec))
        return NULL;
    if (whole_pages(&buf) < 0)
        goto done;
    if (buf.len == 0) {
        PyErr_SetString(PyExc_ValueError, "empty frame");
        goto done;
    }
    if (codec != CODEC_ZSTD && codec != CODEC_LZ4) {
        PyErr_Format(PyExc_ValueError, "unknown codec %d", codec);
        goto done;
    }
    size_t len = (size_t)buf.len, pages = len / PAGE;
    ZSTD_CCtx *zc = NULL;
    if (codec == CODEC_ZSTD && (zc = thread_zstd_cctx()) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int worth;
    Py_BEGIN_ALLOW_THREADS
    worth = sample_compresses(codec, zc, buf.buf, pages, level);
    Py_END_ALLOW_THREADS
    if (worth == 0) {
        out = Py_NewRef(Py_None); /* store it as it is */
        goto done;
    }
    size_t cap = codec_bound(codec, len, level);
    if ((out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cap)) == NULL)
        goto done;
    size_t got;
    Py_BEGIN_ALLOW_THREADS
    got = codec_compress(codec, zc, PyBytes_AS_STRING(out), cap, buf.buf, len, level);
    Py_END_ALLOW_THREADS
    if (got == 0 || got >= len) {
        Py_SETREF(out, Py_NewRef(Py_None)); /* not shorter: store it as it is */
        goto done;
    }
    if (_PyBytes_Resize(&out, (Py_ssize_t)got) < 0)
        out = NULL; /* _PyBytes_Resize freed it */
done:
    PyBuffer_Release(&buf);
    return out;
}

static const unsigned char ZSTD_MAGIC_LE[4] = {0x28, 0xb5, 0x2f, 0xfd};
static const unsigned char LZ4_MAGIC_LE[4] = {0x04, 0x22, 0x4d, 0x18};

/* Decompress `src` into exactly `size` bytes at `dst`: NULL, or what is wrong. */
static const char *decompress_into(contexts_t *c, unsigned char *dst, size_t size,
                                   const unsigned char *src, size_t len)
{
    if (len >= 4 && memcmp(src, ZSTD_MAGIC_LE, 4) == 0) {
        unsigned long long declared = ZSTD_getFrameContentSize(src, len);
        if (declared != size && declared != ZSTD_CONTENTSIZE_UNKNOWN)
            return "its zstd header declares another size";
        if (c->zd == NULL && (c->zd = ZSTD_createDCtx()) == NULL)
            return "out of memory";
        size_t got = ZSTD_decompressDCtx(c->zd, dst, size, src, len);
        if (ZSTD_isError(got))
            return ZSTD_getErrorName(got);
        return got == size ? NULL : "zstd frame shorter than declared";
    }
    if (len >= 4 && memcmp(src, LZ4_MAGIC_LE, 4) == 0) {
        if (c->ld == NULL && LZ4F_isError(LZ4F_createDecompressionContext(&c->ld, LZ4F_VERSION))) {
            c->ld = NULL;
            return "out of memory";
        }
        LZ4F_resetDecompressionContext(c->ld);
        LZ4F_frameInfo_t info;
        size_t in = len;
        size_t hint = LZ4F_getFrameInfo(c->ld, &info, src, &in);
        if (LZ4F_isError(hint))
            return LZ4F_getErrorName(hint);
        if (info.contentSize != size)
            return "its LZ4 header declares another size";
        size_t pos = in, out = 0;
        while (hint != 0) {
            size_t src_n = len - pos, dst_n = size - out;
            if (src_n == 0)
                return "LZ4 frame cut short";
            hint = LZ4F_decompress(c->ld, dst + out, &dst_n, src + pos, &src_n, NULL);
            if (LZ4F_isError(hint))
                return LZ4F_getErrorName(hint);
            pos += src_n;
            out += dst_n;
            if (src_n == 0 && dst_n == 0 && hint != 0)
                return "LZ4 frame makes no progress";
        }
        if (pos != len)
            return "bytes after the LZ4 frame's end";
        return out == size ? NULL : "LZ4 frame shorter than declared";
    }
    return "neither a zstd nor an LZ4 frame";
}

static PyObject *decompress_frame(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t size;
    PyObject *out = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*n:decompress_frame", &buf, &size))
        return NULL;
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "negative size");
        goto done;
    }
    contexts_t *c = thread_contexts();
    if (c == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if ((out = PyBytes_FromStringAndSize(NULL, size)) == NULL)
        goto done;
    const char *wrong;
    Py_BEGIN_ALLOW_THREADS
    wrong = decompress_into(c, (unsigned char *)PyBytes_AS_STRING(out), (size_t)size, buf.buf,
                            (size_t)buf.len);
    Py_END_ALLOW_THREADS
    if (wrong != NULL) {
        PyErr_SetString(PyExc_ValueError, wrong);
        Py_CLEAR(out);
    }
done:
    PyBuffer_Release(&buf);
    return out;
}

/* ---- concat_digest ----------------------------------------------------------------------- */

static PyObject *concat_digest(PyObject *self, PyObject *arg)
{
    PyObject *seq, *blob = NULL, *result = NULL;
    Py_buffer *parts = NULL;
    Py_ssize_t n, got = 0;
    (void)self;
    if ((seq = PySequence_Fast(arg, "parts must be a sequence")) == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    if ((parts = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof *parts)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    size_t total = 0;
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &parts[got], PyBUF_SIMPLE) < 0)
            goto done;
        if ((size_t)parts[got].len > (size_t)PY_SSIZE_T_MAX - total) {
            got++;
            PyErr_SetString(PyExc_OverflowError, "parts too large together");
            goto done;
        }
        total += (size_t)parts[got].len;
    }
    if ((blob = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total)) == NULL)
        goto done;
    XXH128_canonical_t c;
    char *dst = PyBytes_AS_STRING(blob);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(dst, parts[i].buf, (size_t)parts[i].len);
        dst += parts[i].len;
    }
    XXH128_canonicalFromHash(&c, XXH3_128bits(PyBytes_AS_STRING(blob), total));
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(Oy#)", blob, (const char *)c.digest, (Py_ssize_t)HASH);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&parts[i]);
    PyMem_Free(parts);
    Py_XDECREF(blob);
    Py_DECREF(seq);
    return result;
}

/* ---- digest_parts ------------------------------------------------------------------------ */

/* The xxh3-128 of the parts as if concatenated, without concatenating them (a pack is written
 * from its frames with writev: no copy of it is made to name it). */
static PyObject *digest_parts(PyObject *self, PyObject *arg)
{
    PyObject *seq, *result = NULL;
    Py_buffer *parts = NULL;
    Py_ssize_t n, got = 0;
    XXH3_state_t *state = NULL;
    (void)self;
    if ((seq = PySequence_Fast(arg, "parts must be a sequence")) == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    if ((parts = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof *parts)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &parts[got], PyBUF_SIMPLE) < 0)
            goto done;
    if ((state = XXH3_createState()) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    XXH128_canonical_t c;
    Py_BEGIN_ALLOW_THREADS
    XXH3_128bits_reset(state);
    for (Py_ssize_t i = 0; i < n; i++)
        XXH3_128bits_update(state, parts[i].buf, (size_t)parts[i].len);
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(state));
    Py_END_ALLOW_THREADS
    result = PyBytes_FromStringAndSize((const char *)c.digest, (Py_ssize_t)HASH);
done:
    if (state != NULL)
        XXH3_freeState(state);
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&parts[i]);
    PyMem_Free(parts);
    Py_DECREF(seq);
    return result;
}

/* ---- slot_counts --------------------------------------------------------------------------- */

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static PyObject *slot_counts(PyObject *self, PyObject *args)
{
    PyObject *buffers, *pages, *seq = NULL, *key = NULL, *result = NULL;
    static const unsigned char zeros[HASH];
    uint64_t *codes = NULL;
    size_t n = 0, cap = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO!:slot_counts", &buffers, &PyDict_Type, &pages))
        return NULL;
    if ((seq = PySequence_Fast(buffers, "buffers must be a sequence")) == NULL)
        return NULL;
    for (Py_ssize_t b = 0; b < PySequence_Fast_GET_SIZE(seq); b++) {
        Py_buffer refs;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, b), &refs, PyBUF_SIMPLE) < 0)
            goto done;
        if (refs.len % HASH != 0) {
            PyErr_Format(PyExc_ValueError,
                         "references of %zd bytes are not a whole number of %d", refs.len, HASH);
            PyBuffer_Release(&refs);
            goto done;
        }
        const unsigned char *r = refs.buf;
        size_t count = (size_t)refs.len / HASH;
        if (n + count > cap) {
            size_t want = n + count;
            uint64_t *grown = realloc(codes, want * sizeof *codes);
            if (grown == NULL && want) {
                PyBuffer_Release(&refs);
                PyErr_NoMemory();
                goto done;
            }
            codes = grown;
            cap = want;
        }
        for (size_t i = 0; i < count; i++) {
            const unsigned char *h = r + i * HASH;
            if (memcmp(h, zeros, HASH) == 0)
                continue;
            if ((key = PyBytes_FromStringAndSize((const char *)h, HASH)) == NULL) {
                PyBuffer_Release(&refs);
                goto done;
            }
            PyObject *code = PyDict_GetItemWithError(pages, key); /* borrowed */
            Py_CLEAR(key);
            if (code == NULL) {
                if (PyErr_Occurred()) {
                    PyBuffer_Release(&refs);
                    goto done;
                }
                continue;
            }
            unsigned long long c = PyLong_AsUnsignedLongLong(code);
            if (c == (unsigned long long)-1 && PyErr_Occurred()) {
                PyBuffer_Release(&refs);
                goto done;
            }
            codes[n++] = (uint64_t)c;
        }
        PyBuffer_Release(&refs);
    }
    if (n > 1)
        qsort(codes, n, sizeof *codes, cmp_u64);
    if ((result = PyDict_New()) == NULL)
        goto done;
    for (size_t i = 0; i < n;) {
        uint64_t slot = codes[i] >> 32;
        size_t distinct = 0;
        for (; i < n && codes[i] >> 32 == slot; i++)
            if (i == 0 || codes[i] != codes[i - 1])
                distinct++;
        PyObject *k = PyLong_FromUnsignedLongLong(slot), *v = PyLong_FromSize_t(distinct);
        int rc = (k == NULL || v == NULL) ? -1 : PyDict_SetItem(result, k, v);
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (rc < 0) {
            Py_CLEAR(result);
            goto done;
        }
    }
done:
    free(codes);
    Py_XDECREF(key);
    Py_XDECREF(seq);
    return result;
}

/* ---- encode_delta ------------------------------------------------------------------------- */

typedef struct {
    unsigned char *data;
    size_t len, cap;
} outbuf_t;

static int out_put(outbuf_t *o, const void *src, size_t n)
{
    if (o->len + n > o->cap) {
        size_t cap = o->cap ? o->cap : 4096;
        while (cap < o->len + n)
            cap *= 2;
        unsigned char *grown = realloc(o->data, cap);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        o->data = grown;
        o->cap = cap;
    }
    memcpy(o->data + o->len, src, n);
    o->len += n;
    return 0;
}

static int out_op(outbuf_t *o, unsigned op, size_t n)
{
    unsigned char b[5] = {(unsigned char)op, (unsigned char)n, (unsigned char)(n >> 8),
                          (unsigned char)(n >> 16), (unsigned char)(n >> 24)};
    return out_put(o, b, 5);
}

static int out_u32(outbuf_t *o, size_t v)
{
    unsigned char b[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                          (unsigned char)(v >> 24)};
    return out_put(o, b, 4);
}

static size_t ref_slot(const unsigned char *h, int shift)
{
    uint64_t a, b;
    memcpy(&a, h, 8);
    memcpy(&b, h + 8, 8);
    return (size_t)(((a ^ b) * 0x9E3779B97F4A7C15ULL) >> shift);
}

/* pagelist.encode_delta, byte for byte, for packed references: the base's first position of
 * every reference in an open-addressing table of u32 (8 bytes a base page at most). */
static PyObject *encode_delta(PyObject *self, PyObject *args)
{
    Py_buffer refs, base, base_hash;
    static const unsigned char zeros[HASH];
    uint32_t *table = NULL;
    outbuf_t o = {NULL, 0, 0};
    PyObject *result = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*:encode_delta", &refs, &base, &base_hash))
        return NULL;
    if (refs.len % HASH != 0 || base.len % HASH != 0 || base_hash.len != HASH) {
        PyErr_SetString(PyExc_ValueError, "references and the base hash are 16 bytes each");
        goto done;
    }
    size_t n = (size_t)refs.len / HASH, nb = (size_t)base.len / HASH;
    if (n > UINT32_MAX || nb >= UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "too many references for a page list");
        goto done;
    }
    const unsigned char *r = refs.buf, *bs = base.buf;
    int bits = 1;
    while (((size_t)1 << bits) < 2 * nb)
        bits++;
    size_t mask = ((size_t)1 << bits) - 1;
    int shift = 64 - bits;
    if ((table = calloc(mask + 1, sizeof *table)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (size_t p = 0; p < nb; p++) {
        const unsigned char *h = bs + p * HASH;
        if (memcmp(h, zeros, HASH) == 0)
            continue;
        size_t slot = ref_slot(h, shift);
        while (table[slot] && memcmp(bs + (size_t)(table[slot] - 1) * HASH, h, HASH) != 0)
            slot = (slot + 1) & mask;
        if (!table[slot])
            table[slot] = (uint32_t)(p + 1); /* the first occurrence only */
    }
    unsigned char head[6] = {'C', 'K', 'P', 'L', '1', 1};
    if (out_put(&o, head, 6) < 0 || out_u32(&o, n) < 0 || out_put(&o, base_hash.buf, HASH) < 0)
        goto done;
    size_t lit_first = 0, lit_n = 0, i = 0;
#define FLUSH_LITERAL()                                                                        \
    do {                                                                                       \
        if (lit_n) {                                                                           \
            if (out_op(&o, 0, lit_n) < 0 || out_put(&o, r + lit_first * HASH, lit_n * HASH) < 0) \
                goto done;                                                                     \
            lit_n = 0;                                                                         \
        }                                                                                      \
    } while (0)
    while (i < n) {
        const unsigned char *h = r + i * HASH;
        if (memcmp(h, zeros, HASH) == 0) {
            size_t j = i;
            while (j < n && memcmp(r + j * HASH, zeros, HASH) == 0)
                j++;
            FLUSH_LITERAL();
            if (out_op(&o, 1, j - i) < 0)
                goto done;
            i = j;
            continue;
        }
        size_t slot = ref_slot(h, shift);
        while (table[slot] && memcmp(bs + (size_t)(table[slot] - 1) * HASH, h, HASH) != 0)
            slot = (slot + 1) & mask;
        if (!table[slot]) {
            if (!lit_n)
                lit_first = i;
            lit_n++;
            i++;
            continue;
        }
        size_t start = table[slot] - 1, length = 1;
        while (i + length < n && start + length < nb &&
               memcmp(r + (i + length) * HASH, bs + (start + length) * HASH, HASH) == 0) {
            if (memcmp(r + (i + length) * HASH, zeros, HASH) == 0)
                break;
            length++;
        }
        FLUSH_LITERAL();
        if (out_op(&o, 2, length) < 0 || out_u32(&o, start) < 0)
            goto done;
        i += length;
    }
    FLUSH_LITERAL();
#undef FLUSH_LITERAL
    result = PyBytes_FromStringAndSize((const char *)o.data, (Py_ssize_t)o.len);
done:
    free(table);
    free(o.data);
    PyBuffer_Release(&refs);
    PyBuffer_Release(&base);
    PyBuffer_Release(&base_hash);
    return result;
}

/* ---- code_runs ---------------------------------------------------------------------------- */

static PyObject *code_runs(PyObject *self, PyObject *args)
{
    PyObject *codes_obj, *refs_obj, *codes = NULL, *refs = NULL, *runs = NULL, *missing = NULL;
    PyObject *result = NULL;
    static const unsigned char zeros[HASH];
    (void)self;
    Py_ssize_t start = 0;
    if (!PyArg_ParseTuple(args, "OO|n:code_runs", &codes_obj, &refs_obj, &start))
        return NULL;
    if (start < 0) {
        PyErr_SetString(PyExc_ValueError, "start must not be negative");
        return NULL;
    }
    if ((codes = PySequence_Fast(codes_obj, "codes must be a sequence")) == NULL ||
        (refs = PySequence_Fast(refs_obj, "refs must be a sequence")) == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(codes);
    if (PySequence_Fast_GET_SIZE(refs) != n) {
        PyErr_SetString(PyExc_ValueError, "as many codes as references");
        goto done;
    }
    if ((runs = PyList_New(0)) == NULL || (missing = PyList_New(0)) == NULL)
        goto done;
    Py_ssize_t i = 0;
    while (i < n) {
        PyObject *c = PySequence_Fast_GET_ITEM(codes, i);
        if (c == Py_None) {
            PyObject *r = PySequence_Fast_GET_ITEM(refs, i);
            if (!PyBytes_Check(r) || PyBytes_GET_SIZE(r) != HASH) {
                PyErr_SetString(PyExc_TypeError, "a reference is 16 bytes");
                goto done;
            }
            if (memcmp(PyBytes_AS_STRING(r), zeros, HASH) != 0) { /* not a zero page */
                PyObject *at = PyLong_FromSsize_t(start + i);
                if (at == NULL || PyList_Append(missing, at) < 0) {
                    Py_XDECREF(at);
                    goto done;
                }
                Py_DECREF(at);
            }
            i++;
            continue;
        }
        long long code = PyLong_AsLongLong(c);
        if (code == -1 && PyErr_Occurred())
            goto done;
        if (code < 0) {
            PyErr_SetString(PyExc_ValueError, "codes are not negative");
            goto done;
        }
        Py_ssize_t j = i + 1;
        while (j < n) {
            PyObject *d = PySequence_Fast_GET_ITEM(codes, j);
            if (d == Py_None || !PyLong_Check(d))
                break;
            int overflow;
            long long next = PyLong_AsLongLongAndOverflow(d, &overflow);
            if (overflow || next != code + (long long)(j - i))
                break;
            j++;
        }
        PyObject *run = Py_BuildValue("(nLn)", start + i, code, j - i);
        if (run == NULL || PyList_Append(runs, run) < 0) {
            Py_XDECREF(run);
            goto done;
        }
        Py_DECREF(run);
        i = j;
    }
    result = PyTuple_Pack(2, runs, missing);
done:
    Py_XDECREF(missing);
    Py_XDECREF(runs);
    Py_XDECREF(refs);
    Py_XDECREF(codes);
    return result;
}

/* ---- gather_pages ------------------------------------------------------------------------ */

static PyObject *gather_pages(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    PyObject *runs_obj, *seq = NULL, *out = NULL;
    size_t *spans = NULL; /* (from, len) in bytes, pairs */
    (void)self;
    if (!PyArg_ParseTuple(args, "y*O:gather_pages", &buf, &runs_obj))
        return NULL;
    if (whole_pages(&buf) < 0)
        goto done;
    if ((seq = PySequence_Fast(runs_obj, "runs must be a sequence")) == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    size_t pages = (size_t)buf.len / PAGE, total = 0;
    if ((spans = PyMem_Calloc(n > 0 ? 2 * (size_t)n : 1, sizeof *spans)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t first, count;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "nn;a run is (first, count)",
                              &first, &count))
            goto done;
        if (first < 0 || count < 0 || (size_t)first > pages ||
            (size_t)count > pages - (size_t)first) {
            PyErr_Format(PyExc_ValueError, "run (%zd, %zd) outside %zu pages", first, count,
                         pages);
            goto done;
        }
        spans[2 * i] = (size_t)first * PAGE;
        spans[2 * i + 1] = (size_t)count * PAGE;
        total += (size_t)count * PAGE; /* runs may repeat: bounded by n * len, checked below */
        if (total > (size_t)PY_SSIZE_T_MAX) {
            PyErr_SetString(PyExc_OverflowError, "runs too large together");
            goto done;
        }
    }
    if ((out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total)) == NULL)
        goto done;
    char *dst = PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(dst, (const char *)buf.buf + spans[2 * i], spans[2 * i + 1]);
        dst += spans[2 * i + 1];
    }
    Py_END_ALLOW_THREADS
done:
    PyMem_Free(spans);
    Py_XDECREF(seq);
    PyBuffer_Release(&buf);
    return out;
}

/* ---- write_runs ------------------------------------------------------------------------ */

typedef struct {
    off_t at;
    size_t from, len;
} wrun_t;

static PyObject *write_runs(PyObject *self, PyObject *args)
{
    int fd;
    Py_buffer buf;
    PyObject *runs_obj, *seq = NULL, *out = NULL;
    wrun_t *runs = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*O:write_runs", &fd, &buf, &runs_obj))
        return NULL;
    if (whole_pages(&buf) < 0)
        goto done;
    if ((seq = PySequence_Fast(runs_obj, "runs must be a sequence")) == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    size_t pages = (size_t)buf.len / PAGE;
    if (n > 0 && (runs = PyMem_Calloc((size_t)n, sizeof *runs)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t dst, src, count;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "nnn;a run is (dst, src, count)",
                              &dst, &src, &count))
            goto done;
        if (dst < 0 || src < 0 || count < 0 || (size_t)src > pages ||
            (size_t)count > pages - (size_t)src ||
            (size_t)dst > (size_t)(INT64_MAX / PAGE) - (size_t)count) {
            PyErr_Format(PyExc_ValueError, "run (%zd, %zd, %zd) outside %zu pages", dst, src,
                         count, pages);
            goto done;
        }
        runs[i] = (wrun_t){(off_t)dst * PAGE, (size_t)src * PAGE, (size_t)count * PAGE};
    }
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && !err; i++) {
        const char *from = (const char *)buf.buf + runs[i].from;
        size_t left = runs[i].len;
        off_t at = runs[i].at;
        while (left) {
            ssize_t w = pwrite(fd, from, left, at);
            if (w < 0 && errno == EINTR)
                continue;
            if (w <= 0) {
                err = w < 0 ? errno : EIO;
                break;
            }
            from += w;
            at += w;
            left -= (size_t)w;
        }
    }
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    out = Py_NewRef(Py_None);
done:
    PyMem_Free(runs);
    Py_XDECREF(seq);
    PyBuffer_Release(&buf);
    return out;
}

/* ---- module ------------------------------------------------------------------------------ */

static PyObject *cpu_count(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromLong(usable_cpus());
}


/* ---- pagemap_columns ------------------------------------------------------------------ */

static int read_varint(const uint8_t *p, size_t len, size_t *pos, uint64_t *out)
{
    uint64_t value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (*pos >= len)
            return -1;
        uint8_t byte = p[(*pos)++];
        value |= (uint64_t)(byte & 0x7F) << shift;
        if (!(byte & 0x80)) {
            *out = value;
            return 0;
        }
    }
    return -1;
}

/* Skip one field of wire type `wire` at *pos (varints read by the caller). */
static int skip_field(const uint8_t *p, size_t len, size_t *pos, unsigned wire)
{
    uint64_t n;
    switch (wire) {
    case 0: return read_varint(p, len, pos, &n);
    case 1: *pos += 8; return *pos <= len ? 0 : -1;
    case 5: *pos += 4; return *pos <= len ? 0 : -1;
    case 2:
        if (read_varint(p, len, pos, &n) < 0 || n > len - *pos)
            return -1;
        *pos += n;
        return 0;
    default: return -1;
    }
}

#define PE_PARENT_ 1
#define PE_PRESENT_ 4

static PyObject *pagemap_columns(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *p = view.buf;
    size_t len = (size_t)view.len, pos = 8, n = 0, cap = 0;
    uint64_t *vaddrs = NULL, *counts = NULL, *firsts = NULL, first = 0, pages_id = 0;
    uint32_t *flags = NULL;
    int have_head = 0, bad = 0;
    PyObject *result = NULL;

    if (len < 8) {
        bad = 1;
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    while (pos < len && !bad) {
        if (len - pos < 4) { bad = 1; break; }
        uint32_t size;
        memcpy(&size, p + pos, 4);
        pos += 4;
        if (size > len - pos) { bad = 1; break; }
        size_t end = pos + size, at = pos;
        uint64_t f_vaddr = 0, f_compat = 0, f_nr = 0, f_flags = 0, f_parent = 0, v;
        int has_vaddr = 0, has_nr = 0, has_compat = 0, has_flags = 0, has_id = 0;
        while (at < end) {
            uint64_t key;
            if (read_varint(p, end, &at, &key) < 0) { bad = 1; break; }
            unsigned number = (unsigned)(key >> 3), wire = (unsigned)(key & 7);
            if (wire == 0) {
                if (read_varint(p, end, &at, &v) < 0) { bad = 1; break; }
                if (!have_head) {
                    if (number == 1) { pages_id = v; has_id = 1; }
                    continue;
                }
                switch (number) {
                case 1: f_vaddr = v; has_vaddr = 1; break;
                case 2: f_compat = v; has_compat = 1; break;
                case 3: f_parent = v; break;
                case 4: f_flags = v; has_flags = 1; break;
                case 5: f_nr = v; has_nr = 1; break;
                default: break;
                }
            } else if (skip_field(p, end, &at, wire) < 0) {
                bad = 1;
                break;
            }
        }
        pos = end;
        if (bad)
            break;
        if (!have_head) {
            if (!has_id) { bad = 1; break; }
            have_head = 1;
            continue;
        }
        if (!has_vaddr || (!has_nr && !has_compat)) { bad = 1; break; }
        if (n == cap) {
            cap = cap ? cap * 2 : 1024;
            uint64_t *a = realloc(vaddrs, cap * 8), *b = realloc(counts, cap * 8);
            uint64_t *c = realloc(firsts, cap * 8);
            uint32_t *d = realloc(flags, cap * 4);
            if (a) vaddrs = a;
            if (b) counts = b;
            if (c) firsts = c;
            if (d) flags = d;
            if (!a || !b || !c || !d) { bad = 2; break; }
        }
        uint64_t count = has_nr ? f_nr : f_compat;
        uint32_t fl = has_flags ? (uint32_t)f_flags : (f_parent ? PE_PARENT_ : PE_PRESENT_);
        vaddrs[n] = f_vaddr;
        counts[n] = count;
        flags[n] = fl;
        firsts[n] = first;
        if (fl & PE_PRESENT_)
            first += count;
        n++;
    }
    Py_END_ALLOW_THREADS
    if (!have_head && !bad)
        bad = 1;
done:
    if (bad == 2)
        PyErr_NoMemory();
    else if (bad)
        PyErr_SetString(PyExc_ValueError, "not a pagemap image (or one cut short)");
    else
        /* no entries: the columns are NULL, which "y#" would turn into None */
        result = Py_BuildValue("(Ky#y#y#y#)", (unsigned long long)pages_id,
                               n ? (const char *)vaddrs : "", (Py_ssize_t)(n * 8),
                               n ? (const char *)counts : "", (Py_ssize_t)(n * 8),
                               n ? (const char *)flags : "", (Py_ssize_t)(n * 4),
                               n ? (const char *)firsts : "", (Py_ssize_t)(n * 8));
    free(vaddrs);
    free(counts);
    free(firsts);
    free(flags);
    PyBuffer_Release(&view);
    return result;
}

/* ---- ps_entries ------------------------------------------------------------------------- */

#define PS_ADD 1
#define PS_HOLE 2
#define PS_ADD_F 6
#define PE_PARENT_F 1
#define PE_PRESENT_F 4

static uint64_t le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static size_t put_varint(unsigned char *o, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        o[n++] = (unsigned char)(v | 0x80);
        v >>= 7;
    }
    o[n++] = (unsigned char)v;
    return n;
}

static PyObject *ps_entries(PyObject *self, PyObject *args)
{
    Py_buffer rb, chunk;
    Py_ssize_t rpos, rend, fill;
    unsigned long long dst_id;
    int v42;
    PyObject *result = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnw*nKp:ps_entries", &rb, &rpos, &rend, &chunk, &fill,
                          &dst_id, &v42))
        return NULL;
    if (rpos < 0 || rend < rpos || rend > rb.len || fill < 0 || fill > chunk.len) {
        PyErr_SetString(PyExc_ValueError, "positions outside the buffers");
        goto done;
    }
    const unsigned char *in = rb.buf;
    unsigned char *dst = chunk.buf;
    size_t pos = (size_t)rpos, end = (size_t)rend, at = (size_t)fill, cap = (size_t)chunk.len;
    size_t hdr = v42 ? 32 : 24, count = 0, pages = 0;
    /* an entry is at most 4 + 3 tags + 3 varints of 10 bytes + 2 */
    size_t out_cap = 4096, out_len = 0;
    unsigned char *out = malloc(out_cap);
    if (out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    while (end - pos >= hdr) {
        const unsigned char *p = in + pos;
        uint32_t word = le32(p);
        uint64_t nr = v42 ? le64(p + 8) : le32(p + 4);
        uint64_t vaddr = v42 ? le64(p + 16) : le64(p + 8);
        uint64_t dst_of = v42 ? le64(p + 24) : le64(p + 16);
        unsigned cmd = word & 0xFFFF, flags = word >> 16;
        if (cmd == PS_ADD)
            flags = PE_PRESENT_F;
        else if (cmd == PS_HOLE)
            flags = PE_PARENT_F;
        else if (cmd != PS_ADD_F)
            break;
        if (dst_of != dst_id)
            break;
        size_t len = 0;
        if (flags & PE_PRESENT_F) {
            if (nr > (end - pos - hdr) / PAGE)
                break; /* its pages are not all in the buffer yet */
            len = (size_t)nr * PAGE;
            if (len > cap - at)
                break; /* they do not fit the chunk */
        }
        if (out_cap - out_len < 64) {
            unsigned char *grown = realloc(out, out_cap * 2);
            if (grown == NULL) {
                nomem = 1;
                break;
            }
            out = grown;
            out_cap *= 2;
        }
        unsigned char *e = out + out_len + 4;
        size_t n = 0;
        e[n++] = 0x08;
        n += put_varint(e + n, vaddr);
        if (v42) {
            e[n++] = 0x10;
            e[n++] = 0x00;
            e[n++] = 0x20;
            n += put_varint(e + n, flags);
            e[n++] = 0x28;
            n += put_varint(e + n, nr);
        } else {
            e[n++] = 0x10;
            n += put_varint(e + n, nr);
            e[n++] = 0x20;
            n += put_varint(e + n, flags);
        }
        out[out_len] = (unsigned char)n;
        out[out_len + 1] = (unsigned char)(n >> 8);
        out[out_len + 2] = out[out_len + 3] = 0;
        out_len += 4 + n;
        if (len) {
            memcpy(dst + at, p + hdr, len);
            at += len;
            pages += (size_t)nr;
        }
        pos += hdr + len;
        count++;
    }
    Py_END_ALLOW_THREADS
    if (nomem)
        PyErr_NoMemory();
    else
        result = Py_BuildValue("(nny#nn)", (Py_ssize_t)pos, (Py_ssize_t)at, (const char *)out,
                               (Py_ssize_t)out_len, (Py_ssize_t)count, (Py_ssize_t)pages);
    free(out);
done:
    PyBuffer_Release(&rb);
    PyBuffer_Release(&chunk);
    return result;
}

static PyMethodDef methods[] = {
    {"hash_pages", (PyCFunction)(void (*)(void))hash_pages, METH_VARARGS | METH_KEYWORDS,
     "hash_pages(buffer, seed, *, zero_ref=False, threads=0) -> bytes: the xxh3-128 of every "
     "4 KiB page (canonical form), concatenated; zero_ref: a zero page gives 16 zero bytes."},
    {"verify_pages", (PyCFunction)(void (*)(void))verify_pages, METH_VARARGS | METH_KEYWORDS,
     "verify_pages(buffer, hashes, seed, *, threads=0) -> int: the first page whose hash "
     "differs from hashes, -1 if none."},
    {"plan_new", plan_new, METH_VARARGS,
     "plan_new(refs, known, fresh) -> (refs list, runs): runs (first, count) of pages not "
     "zero, not in known, not in the set fresh (added to it)."},
    {"compress_frame", compress_frame, METH_VARARGS,
     "compress_frame(data, level, codec=CODEC_ZSTD) -> bytes | None: a zstd or LZ4 frame "
     "strictly shorter than data, or None: data does not compress, store it as it is."},
    {"decompress_frame", decompress_frame, METH_VARARGS,
     "decompress_frame(frame, size) -> bytes: a zstd or LZ4 frame decompressed, exactly size "
     "bytes, or ValueError."},
    {"concat_digest", concat_digest, METH_O,
     "concat_digest(parts) -> (bytes, bytes): the parts concatenated, and the xxh3-128 "
     "(unseeded, canonical) of the result."},
    {"digest_parts", digest_parts, METH_O,
     "digest_parts(parts) -> bytes: the xxh3-128 (unseeded, canonical) of the parts as if "
     "concatenated, without a copy."},
    {"slot_counts", slot_counts, METH_VARARGS,
     "slot_counts(buffers, pages) -> dict: for the references (16 bytes each) of every buffer, "
     "located in the dict pages (hash -> code), the distinct codes per slot (code >> 32)."},
    {"encode_delta", encode_delta, METH_VARARGS,
     "encode_delta(refs, base, base_hash) -> bytes: pagelist.encode_delta of packed references "
     "(16 bytes each) against the packed full list base."},
    {"code_runs", code_runs, METH_VARARGS,
     "code_runs(codes, refs) -> (runs, missing): runs (position, first code, count) of "
     "consecutive codes, and the positions whose code is None but whose ref is not ZERO_REF."},
    {"gather_pages", gather_pages, METH_VARARGS,
     "gather_pages(buffer, runs) -> bytes: the pages of each run (first, count) of buffer, "
     "concatenated."},
    {"write_runs", write_runs, METH_VARARGS,
     "write_runs(fd, buffer, runs) -> None: pwrite each run (page in the file, page in "
     "buffer, count) of buffer's pages to fd."},
    {"pagemap_columns", pagemap_columns, METH_O,
     "pagemap_columns(image) -> (pages_id, vaddrs, counts, flags, firsts): a CRIU pagemap "
     "image (after its two magics) as columns, native-endian u64 / u64 / u32 / u64 arrays; "
     "firsts: each entry's first page in the pages image. ValueError if it is not one."},
    {"ps_entries", ps_entries, METH_VARARGS,
     "ps_entries(rbuf, rpos, rend, chunk, fill, dst_id, v42) -> (rpos, fill, entries, n, "
     "pages): the page-server messages ADD/ADD_F/HOLE of dst_id whole in rbuf[rpos:rend], "
     "their pages copied into chunk[fill:], their pagemap entries encoded."},
    {"cpu_count", cpu_count, METH_NOARGS,
     "cpu_count() -> int: the CPUs this process may run on (the threads' upper bound)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ckptd._pages",
    "The store's per-page data path in C, without the GIL (docs/adr/0012-native-page-path.md).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pages(void)
{
    if (pthread_key_create(&ctx_key, free_contexts) != 0) {
        PyErr_SetString(PyExc_OSError, "pthread_key_create failed");
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "PAGE_SIZE", PAGE) < 0 ||
        PyModule_AddIntConstant(m, "HASH_SIZE", HASH) < 0 ||
        PyModule_AddIntConstant(m, "MAX_THREADS", MAX_THREADS) < 0 ||
        PyModule_AddIntConstant(m, "CODEC_ZSTD", CODEC_ZSTD) < 0 ||
        PyModule_AddIntConstant(m, "CODEC_LZ4", CODEC_LZ4) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
