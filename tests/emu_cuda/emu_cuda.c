/*
 * An emulated CUDA driver (libcuda.so.1) over host memory, for testing CudaDevice without a GPU.
 *
 * It implements the driver entry points lifecycle's CudaDevice uses, and the path through which
 * cuda-bindings loads a driver: dlopen("libcuda.so.1"), dlsym("cuGetProcAddress_v2"), then one
 * cuGetProcAddress_v2 per entry point.
 *
 * It is meant to be at least as strict as a real driver wherever the library could get something
 * wrong, so that a regression shows up in CI rather than on the first GPU:
 *  - Device and pinned allocations are host memory, 256-byte aligned, filled with 0xCD (memory from
 *    cuMemAlloc is not zeroed on a GPU either).
 *  - Async copies and memsets are queued on their stream and run at cuStreamSynchronize (or
 *    cuCtxSynchronize, cuStreamDestroy, cuMemFree/cuMemFreeHost, which synchronise on a GPU too):
 *    a missing synchronize shows up as stale data. A host->device copy from pageable memory
 *    snapshots the source at the call, as the real driver stages it before returning.
 *  - Streams are independent: work queued on one stream runs only when that stream is drained,
 *    unless another stream waits for it through an event (cuEventRecord + cuStreamWaitEvent).
 *    Handles 0, CU_STREAM_LEGACY (1) and CU_STREAM_PER_THREAD (2) name one emulated default stream.
 *  - cuMemcpyBatchAsync checks its attributes as the driver documents them (srcAccessOrder one of
 *    STREAM, DURING_API_CALL, ANY; no flag but PREFER_OVERLAP_WITH_COMPUTE; attribute indices
 *    starting at 0, strictly increasing, inside the batch), refuses a batch whose copies overlap
 *    (a destination overlapping another copy's destination or any source, its own included: the
 *    driver leaves their order undefined), and runs the copies of a batch in reverse issue order.
 *  - cuGetProcAddress: a requested version newer than the driver's is CUDA_ERROR_INVALID_VALUE; an
 *    entry point this driver lacks is CUDA_SUCCESS with a NULL pointer (symbolStatus
 *    SYMBOL_NOT_FOUND, or VERSION_NOT_SUFFICIENT when only a newer ABI than requested exists).
 *  - The pid that called cuInit owns the driver: every call from a forked child fails with
 *    CUDA_ERROR_NOT_INITIALIZED.
 *  - A destroyed stream or event handle stays poisoned: its memory is never reused, so a use after
 *    destroy fails with CUDA_ERROR_INVALID_HANDLE instead of reaching a newer object.
 *  - Every device range a call names must lie inside one live device allocation (for cuMemcpyAsync
 *    and cuMemcpyBatchAsync, which take unified addresses: a device or pinned allocation),
 *    otherwise the call fails with CUDA_ERROR_INVALID_VALUE and nothing is queued.
 *  - Allocation, copy and stream calls need a current context (cuCtxSetCurrent), per thread.
 *  - cuPointerGetAttributes knows the emulator's own allocations only (memory type DEVICE or HOST,
 *    ordinal, range start and size); any other address gets the driver's "not a CUDA pointer"
 *    defaults (memory type 0), and an attribute it does not emulate is CUDA_ERROR_INVALID_VALUE.
 *
 * Fault injection and test hooks (C functions, called through ctypes; never counted as driver calls):
 *  emu_set_alloc_budget(bytes)       cuMemAlloc fails with CUDA_ERROR_OUT_OF_MEMORY past this many
 *                                    live device bytes (-1: no budget)
 *  emu_fail_from_call(n, code)       the n-th driver call from now (1 = the next) and every later
 *                                    one fail with `code`: a sticky error
 *  emu_fail_call(name, code, times)  the next `times` calls (-1: all) of entry point `name`
 *                                    (e.g. "cuMemcpyDtoDAsync") fail with `code`
 *  emu_fail_at_sync(code)            an asynchronous fault: calls keep succeeding until the next
 *                                    one that waits for the device (stream/context synchronize,
 *                                    cuMemFree, cuMemFreeHost, cuStreamDestroy), which fails with
 *                                    `code`, as does every call after it (sticky)
 *  emu_engine_write(stream, dst, src, n)  stand-in for an engine kernel: queues a write of the `n`
 *                                    bytes at host address `src` (copied now) into device memory
 *                                    `dst` on `stream`, to land when that stream is drained
 *  emu_hold_call(name)               the next call of `name` waits, outside the driver lock, until
 *                                    emu_release_hold(); emu_holding() tells whether one waits, and
 *                                    emu_calls_during_hold() counts driver calls made meanwhile
 *  emu_count_calls(name)             count the calls of entry point `name` from now on (NULL: stop);
 *                                    emu_counted_calls() reads the count
 *  emu_reset()                       clear every fault, hold and the budget (allocations stay)
 *  emu_live_allocations(), emu_live_bytes(), emu_pending_ops(), emu_call_count()
 *  emu_set_device_count(n)           0 makes cuInit fail with CUDA_ERROR_NO_DEVICE
 * Environment: EMU_CUDA_TOTAL_MEM (bytes reported as total, default 16 GiB), EMU_CUDA_DEVICES
 * (device count, default 1), EMU_CUDA_DRIVER_VERSION (default 13000), EMU_CUDA_TRACE=1 (print every
 * cuGetProcAddress request to stderr).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
typedef struct emu_ctx *CUcontext;
typedef struct emu_stream *CUstream;
typedef struct emu_event *CUevent;

#define EXPORT __attribute__((visibility("default")))

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEINITIALIZED = 4,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};

/* CUmemcpySrcAccessOrder, CUmemcpyFlags and CUdriverProcAddressQueryResult values */
enum { ORDER_STREAM = 1, ORDER_ANY = 3 };
enum { MEMCPY_FLAGS_KNOWN = 0x1 };
enum { PROC_SUCCESS = 0, PROC_SYMBOL_NOT_FOUND = 1, PROC_VERSION_NOT_SUFFICIENT = 2 };

static const struct {
    int code;
    const char *name;
    const char *text;
} error_table[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

/* ---------------------------------------------------------------------------------------------- */
/* state                                                                                           */

enum { KIND_DEVICE = 0, KIND_PINNED = 1 };

struct allocation {
    char *ptr;
    size_t size;
    int kind;
};

enum { OP_COPY = 0, OP_SET = 1, OP_WAIT = 2 };

struct op {
    int kind;
    char *dst;
    const char *src;
    size_t nbytes;
    int value;
    void *owned;                  /* snapshot of a pageable source, freed once the op ran */
    struct emu_stream *wait_for;  /* OP_WAIT: the stream whose first `wait_until` ops must be done */
    unsigned long long wait_until;
};

struct emu_stream {
    unsigned magic;
    struct op *ops; /* pending ops are ops[head .. num_ops) */
    size_t head, num_ops, cap_ops;
    unsigned long long issued, done; /* ops ever queued / ever run */
    int draining;
    struct emu_stream *next;
};

struct emu_event {
    unsigned magic;
    struct emu_stream *stream; /* where it was last recorded (NULL: never) */
    unsigned long long position;
};

struct emu_ctx {
    unsigned magic;
    int device;
    int refcount;
};

#define STREAM_MAGIC 0x5354524du
#define EVENT_MAGIC 0x45564e54u
#define DEAD_MAGIC 0xdeadbeefu
#define CTX_MAGIC 0x43545821u
#define MAX_DEVICES 8

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized = 0;
static pid_t init_pid = 0;
static int device_count = -1;
static long long total_mem = -1;
static int driver_version = -1;
static int trace_lookups = 0;
static struct emu_ctx primary[MAX_DEVICES];
static __thread struct emu_ctx *current_ctx = NULL;
static struct emu_stream *streams = NULL; /* live streams created by cuStreamCreate */
static struct emu_stream default_stream = {STREAM_MAGIC, NULL, 0, 0, 0, 0, 0, 0, NULL};

static struct allocation *allocs = NULL;
static size_t num_allocs = 0, cap_allocs = 0;
static long long device_bytes = 0;

/* faults and hooks */
static long long alloc_budget = -1;
static unsigned long long call_count = 0;
static unsigned long long sticky_from = 0; /* 0: none; else the call number from which calls fail */
static int sticky_code = 0;
static char named_fault[128];
static int named_code = 0;
static int named_times = 0;
static int deferred_code = 0;
static char hold_name[128];
static int hold_armed = 0, holding = 0, hold_released = 0;
static long long calls_during_hold = 0;
static char counted_name[128];
static long long counted_calls = 0;

static void load_config(void) {
    if (device_count >= 0) return;
    const char *s = getenv("EMU_CUDA_DEVICES");
    device_count = s ? atoi(s) : 1;
    if (device_count > MAX_DEVICES) device_count = MAX_DEVICES;
    if (device_count < 0) device_count = 0;
    s = getenv("EMU_CUDA_TOTAL_MEM");
    total_mem = s ? atoll(s) : (16LL << 30);
    s = getenv("EMU_CUDA_DRIVER_VERSION");
    driver_version = s ? atoi(s) : 13000;
    s = getenv("EMU_CUDA_TRACE");
    trace_lookups = s && s[0] == '1';
}

static void pause_briefly(void) {
    struct timespec ts = {0, 1000000}; /* 1 ms */
    nanosleep(&ts, NULL);
}

/* A call named by emu_hold_call waits here, without the driver lock, until emu_release_hold(). */
static void maybe_hold(const char *name) {
    pthread_mutex_lock(&lock);
    int mine = hold_armed && strcmp(name, hold_name) == 0;
    if (mine) {
        hold_armed = 0;
        holding = 1;
        hold_released = 0;
    } else if (holding) {
        calls_during_hold++;
    }
    pthread_mutex_unlock(&lock);
    if (!mine) return;
    for (;;) {
        pthread_mutex_lock(&lock);
        int released = hold_released;
        pthread_mutex_unlock(&lock);
        if (released) break;
        pause_briefly();
    }
    pthread_mutex_lock(&lock);
    holding = 0;
    pthread_mutex_unlock(&lock);
}

/* Every counted entry point starts with ENTER(name): it takes the lock, counts the call and returns
 * an injected fault if one applies. LEAVE(rc) releases the lock. */
static CUresult enter(const char *name) {
    maybe_hold(name);
    pthread_mutex_lock(&lock);
    load_config();
    call_count++;
    if (counted_name[0] && strcmp(name, counted_name) == 0) counted_calls++;
    if (initialized && getpid() != init_pid) return CUDA_ERROR_NOT_INITIALIZED;
    if (sticky_from && call_count >= sticky_from) return sticky_code;
    if (named_times != 0 && strcmp(name, named_fault) == 0) {
        if (named_times > 0) named_times--;
        return named_code;
    }
    return CUDA_SUCCESS;
}

#define ENTER(name)                                   \
    do {                                              \
        CUresult rc_enter_ = enter(name);             \
        if (rc_enter_ != CUDA_SUCCESS) LEAVE(rc_enter_); \
    } while (0)
#define LEAVE(rc)                        \
    do {                                 \
        CUresult rc_leave_ = (rc);       \
        pthread_mutex_unlock(&lock);     \
        return rc_leave_;                \
    } while (0)

/* A call that waits for the device reports a deferred (asynchronous) fault, which then sticks. */
#define SYNC_POINT()                                   \
    do {                                               \
        if (deferred_code != 0) {                      \
            sticky_from = call_count;                  \
            sticky_code = deferred_code;               \
            deferred_code = 0;                         \
            LEAVE(sticky_code);                        \
        }                                              \
    } while (0)

static CUresult need_ctx(void) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (current_ctx == NULL || current_ctx->refcount <= 0) return CUDA_ERROR_INVALID_CONTEXT;
    return CUDA_SUCCESS;
}

#define NEED_CTX()                          \
    do {                                    \
        CUresult rc_ctx_ = need_ctx();      \
        if (rc_ctx_ != CUDA_SUCCESS) LEAVE(rc_ctx_); \
    } while (0)

static struct allocation *find_alloc(const char *ptr, size_t nbytes, int kind) {
    for (size_t i = 0; i < num_allocs; i++) {
        struct allocation *a = &allocs[i];
        if (a->kind == kind && ptr >= a->ptr && ptr + nbytes <= a->ptr + a->size && ptr + nbytes >= ptr)
            return a;
    }
    return NULL;
}

static int device_range_ok(CUdeviceptr p, size_t nbytes) {
    return nbytes == 0 || find_alloc((const char *)(uintptr_t)p, nbytes, KIND_DEVICE) != NULL;
}

/* a unified-address range: device memory or pinned host memory */
static int any_range_ok(CUdeviceptr p, size_t nbytes) {
    const char *c = (const char *)(uintptr_t)p;
    return nbytes == 0 || find_alloc(c, nbytes, KIND_DEVICE) != NULL || find_alloc(c, nbytes, KIND_PINNED) != NULL;
}

static int is_pinned(const void *p, size_t nbytes) {
    return find_alloc((const char *)p, nbytes, KIND_PINNED) != NULL;
}

static struct emu_stream *valid_stream(CUstream s) {
    uintptr_t handle = (uintptr_t)s;
    if (handle <= 2) return &default_stream; /* NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD */
    for (struct emu_stream *it = streams; it; it = it->next)
        if (it == s && it->magic == STREAM_MAGIC) return it;
    return NULL;
}

static int push_op(struct emu_stream *s, struct op op) {
    if (s->head == s->num_ops) s->head = s->num_ops = 0; /* empty: reuse the buffer from the start */
    if (s->num_ops == s->cap_ops) {
        size_t cap = s->cap_ops ? 2 * s->cap_ops : 64;
        struct op *ops = realloc(s->ops, cap * sizeof(struct op));
        if (!ops) return 0;
        s->ops = ops;
        s->cap_ops = cap;
    }
    s->ops[s->num_ops++] = op;
    s->issued++;
    return 1;
}

static void drain_until(struct emu_stream *s, unsigned long long position);

static void run_op(struct op *op) {
    if (op->kind == OP_COPY)
        memmove(op->dst, op->src, op->nbytes);
    else if (op->kind == OP_SET)
        memset(op->dst, op->value, op->nbytes);
    else
        drain_until(op->wait_for, op->wait_until);
    free(op->owned);
}

/* Run `s`'s ops until `position` of them have ever run (a wait that would need `s` while it is
 * already being drained further up is a cycle, which a GPU would deadlock on: it is skipped). */
static void drain_until(struct emu_stream *s, unsigned long long position) {
    if (s->draining) return;
    s->draining = 1;
    while (s->done < position && s->head < s->num_ops) {
        struct op op = s->ops[s->head++];
        run_op(&op);
        s->done++;
    }
    s->draining = 0;
}

static void drain(struct emu_stream *s) { drain_until(s, s->issued); }

static void drain_all(void) {
    drain(&default_stream);
    for (struct emu_stream *it = streams; it; it = it->next) drain(it);
}

static size_t pending_ops(void) {
    size_t n = default_stream.num_ops - default_stream.head;
    for (struct emu_stream *it = streams; it; it = it->next) n += it->num_ops - it->head;
    return n;
}

static CUresult new_allocation(void **out, size_t nbytes, int kind) {
    if (num_allocs == cap_allocs) {
        size_t cap = cap_allocs ? 2 * cap_allocs : 64;
        struct allocation *a = realloc(allocs, cap * sizeof(struct allocation));
        if (!a) return CUDA_ERROR_OUT_OF_MEMORY;
        allocs = a;
        cap_allocs = cap;
    }
    size_t rounded = (nbytes + 255) & ~(size_t)255;
    char *p = aligned_alloc(256, rounded);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    memset(p, 0xCD, nbytes);
    allocs[num_allocs++] = (struct allocation){p, nbytes, kind};
    if (kind == KIND_DEVICE) device_bytes += (long long)nbytes;
    *out = p;
    return CUDA_SUCCESS;
}

static CUresult drop_allocation(void *p, int kind) {
    for (size_t i = 0; i < num_allocs; i++) {
        if (allocs[i].ptr == p && allocs[i].kind == kind) {
            drain_all(); /* freeing waits for the work that may still use the memory */
            if (kind == KIND_DEVICE) device_bytes -= (long long)allocs[i].size;
            free(allocs[i].ptr);
            allocs[i] = allocs[--num_allocs];
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_VALUE;
}

/* ---------------------------------------------------------------------------------------------- */
/* errors and versions (never counted, never failed: they must work to report a failure)          */

EXPORT CUresult cuGetErrorName(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof error_table / sizeof error_table[0]; i++)
        if (error_table[i].code == error) {
            *pStr = error_table[i].name;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof error_table / sizeof error_table[0]; i++)
        if (error_table[i].code == error) {
            *pStr = error_table[i].text;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    load_config();
    *version = driver_version;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------- */
/* init, devices, contexts                                                                         */

EXPORT CUresult cuInit(unsigned int flags) {
    ENTER("cuInit");
    if (flags != 0) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (device_count == 0) LEAVE(CUDA_ERROR_NO_DEVICE);
    if (!initialized) init_pid = getpid();
    initialized = 1;
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGetCount(int *count) {
    ENTER("cuDeviceGetCount");
    if (!initialized) LEAVE(CUDA_ERROR_NOT_INITIALIZED);
    if (!count) LEAVE(CUDA_ERROR_INVALID_VALUE);
    *count = device_count;
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    ENTER("cuDeviceGet");
    if (!initialized) LEAVE(CUDA_ERROR_NOT_INITIALIZED);
    if (!device) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (ordinal < 0 || ordinal >= device_count) LEAVE(CUDA_ERROR_INVALID_DEVICE);
    *device = ordinal;
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    ENTER("cuDeviceGetName");
    if (!initialized) LEAVE(CUDA_ERROR_NOT_INITIALIZED);
    if (!name || len <= 0) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (dev < 0 || dev >= device_count) LEAVE(CUDA_ERROR_INVALID_DEVICE);
    snprintf(name, (size_t)len, "Emulated CUDA device %d (host memory)", dev);
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    ENTER("cuDeviceTotalMem");
    if (!initialized) LEAVE(CUDA_ERROR_NOT_INITIALIZED);
    if (!bytes) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (dev < 0 || dev >= device_count) LEAVE(CUDA_ERROR_INVALID_DEVICE);
    *bytes = (size_t)total_mem;
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    ENTER("cuDevicePrimaryCtxRetain");
    if (!initialized) LEAVE(CUDA_ERROR_NOT_INITIALIZED);
    if (!pctx) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (dev < 0 || dev >= device_count) LEAVE(CUDA_ERROR_INVALID_DEVICE);
    primary[dev].magic = CTX_MAGIC;
    primary[dev].device = dev;
    primary[dev].refcount++;
    *pctx = &primary[dev];
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    ENTER("cuDevicePrimaryCtxRelease");
    if (!initialized) LEAVE(CUDA_ERROR_NOT_INITIALIZED);
    if (dev < 0 || dev >= device_count) LEAVE(CUDA_ERROR_INVALID_DEVICE);
    if (primary[dev].refcount <= 0) LEAVE(CUDA_ERROR_INVALID_CONTEXT);
    primary[dev].refcount--;
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    ENTER("cuCtxSetCurrent");
    if (!initialized) LEAVE(CUDA_ERROR_NOT_INITIALIZED);
    if (ctx != NULL && (ctx->magic != CTX_MAGIC || ctx->refcount <= 0)) LEAVE(CUDA_ERROR_INVALID_CONTEXT);
    current_ctx = ctx;
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx) {
    ENTER("cuCtxGetCurrent");
    if (!initialized) LEAVE(CUDA_ERROR_NOT_INITIALIZED);
    if (!pctx) LEAVE(CUDA_ERROR_INVALID_VALUE);
    *pctx = current_ctx;
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxSynchronize(void) {
    ENTER("cuCtxSynchronize");
    NEED_CTX();
    SYNC_POINT();
    drain_all();
    LEAVE(CUDA_SUCCESS);
}

/* ---------------------------------------------------------------------------------------------- */
/* memory                                                                                          */

EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    ENTER("cuMemGetInfo");
    NEED_CTX();
    if (!free_bytes || !total_bytes) LEAVE(CUDA_ERROR_INVALID_VALUE);
    long long cap = total_mem;
    if (alloc_budget >= 0 && alloc_budget < cap) cap = alloc_budget;
    *total_bytes = (size_t)total_mem;
    *free_bytes = device_bytes >= cap ? 0 : (size_t)(cap - device_bytes);
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    ENTER("cuMemAlloc");
    NEED_CTX();
    if (!dptr || bytesize == 0) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (device_bytes + (long long)bytesize > total_mem) LEAVE(CUDA_ERROR_OUT_OF_MEMORY);
    if (alloc_budget >= 0 && device_bytes + (long long)bytesize > alloc_budget) LEAVE(CUDA_ERROR_OUT_OF_MEMORY);
    void *p = NULL;
    CUresult rc = new_allocation(&p, bytesize, KIND_DEVICE);
    if (rc == CUDA_SUCCESS) *dptr = (CUdeviceptr)(uintptr_t)p;
    LEAVE(rc);
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    ENTER("cuMemFree");
    NEED_CTX();
    SYNC_POINT();
    LEAVE(drop_allocation((void *)(uintptr_t)dptr, KIND_DEVICE));
}

EXPORT CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int flags) {
    ENTER("cuMemHostAlloc");
    NEED_CTX();
    (void)flags;
    if (!pp || bytesize == 0) LEAVE(CUDA_ERROR_INVALID_VALUE);
    LEAVE(new_allocation(pp, bytesize, KIND_PINNED));
}

EXPORT CUresult cuMemFreeHost(void *p) {
    ENTER("cuMemFreeHost");
    NEED_CTX();
    SYNC_POINT();
    LEAVE(drop_allocation(p, KIND_PINNED));
}

/* ---------------------------------------------------------------------------------------------- */
/* streams, events and async work                                                                  */

EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int flags) {
    ENTER("cuStreamCreate");
    NEED_CTX();
    if (!phStream || flags > 1) LEAVE(CUDA_ERROR_INVALID_VALUE);
    struct emu_stream *s = calloc(1, sizeof *s);
    if (!s) LEAVE(CUDA_ERROR_OUT_OF_MEMORY);
    s->magic = STREAM_MAGIC;
    s->next = streams;
    streams = s;
    *phStream = s;
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamDestroy_v2(CUstream hStream) {
    ENTER("cuStreamDestroy");
    NEED_CTX();
    struct emu_stream *s = valid_stream(hStream);
    if (!s || s == &default_stream) LEAVE(CUDA_ERROR_INVALID_HANDLE);
    SYNC_POINT();
    drain(s); /* work already issued completes, as on a GPU */
    for (struct emu_stream **it = &streams; *it; it = &(*it)->next)
        if (*it == s) {
            *it = s->next;
            break;
        }
    /* poisoned, never freed: a stale handle can never name a newer stream */
    s->magic = DEAD_MAGIC;
    free(s->ops);
    s->ops = NULL;
    s->head = s->num_ops = s->cap_ops = 0;
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamSynchronize(CUstream hStream) {
    ENTER("cuStreamSynchronize");
    NEED_CTX();
    struct emu_stream *s = valid_stream(hStream);
    if (!s) LEAVE(CUDA_ERROR_INVALID_HANDLE);
    SYNC_POINT();
    drain(s);
    LEAVE(CUDA_SUCCESS);
}

static struct emu_event *valid_event(CUevent e) {
    return e != NULL && e->magic == EVENT_MAGIC ? e : NULL;
}

EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int flags) {
    ENTER("cuEventCreate");
    NEED_CTX();
    if (!phEvent || (flags & ~0x7u)) LEAVE(CUDA_ERROR_INVALID_VALUE);
    struct emu_event *e = calloc(1, sizeof *e);
    if (!e) LEAVE(CUDA_ERROR_OUT_OF_MEMORY);
    e->magic = EVENT_MAGIC;
    *phEvent = e;
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuEventDestroy_v2(CUevent hEvent) {
    ENTER("cuEventDestroy");
    NEED_CTX();
    struct emu_event *e = valid_event(hEvent);
    if (!e) LEAVE(CUDA_ERROR_INVALID_HANDLE);
    e->magic = DEAD_MAGIC; /* poisoned, never freed */
    LEAVE(CUDA_SUCCESS);
}

/* the event completes once the ops queued on the stream so far have run */
EXPORT CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
    ENTER("cuEventRecord");
    NEED_CTX();
    struct emu_event *e = valid_event(hEvent);
    struct emu_stream *s = valid_stream(hStream);
    if (!e || !s) LEAVE(CUDA_ERROR_INVALID_HANDLE);
    e->stream = s;
    e->position = s->issued;
    LEAVE(CUDA_SUCCESS);
}

/* later work on the stream waits for the event's ops (an event never recorded: nothing to wait for) */
EXPORT CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int flags) {
    ENTER("cuStreamWaitEvent");
    NEED_CTX();
    struct emu_stream *s = valid_stream(hStream);
    struct emu_event *e = valid_event(hEvent);
    if (!s || !e) LEAVE(CUDA_ERROR_INVALID_HANDLE);
    if (flags & ~0x1u) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (e->stream == NULL || e->stream == s) LEAVE(CUDA_SUCCESS);
    struct op op = {OP_WAIT, NULL, NULL, 0, 0, NULL, e->stream, e->position};
    LEAVE(push_op(s, op) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY);
}

/* the caller waits until the event's ops have run (an event never recorded: at once) */
EXPORT CUresult cuEventSynchronize(CUevent hEvent) {
    ENTER("cuEventSynchronize");
    struct emu_event *e = valid_event(hEvent);
    if (!e) LEAVE(CUDA_ERROR_INVALID_HANDLE);
    SYNC_POINT();
    if (e->stream) drain_until(e->stream, e->position);
    LEAVE(CUDA_SUCCESS);
}

/* Checks shared by the async calls: a valid stream. */
#define NEED_STREAM(var, h)                              \
    struct emu_stream *var = valid_stream(h);            \
    if (!var) LEAVE(CUDA_ERROR_INVALID_HANDLE)

static CUresult queue_copy(struct emu_stream *s, char *dst, const char *src, size_t n) {
    struct op op = {OP_COPY, dst, src, n, 0, NULL, NULL, 0};
    return push_op(s, op) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

/* a copy whose source is snapshotted now (pageable memory staged by the driver, an engine write) */
static CUresult queue_staged_copy(struct emu_stream *s, char *dst, const void *src, size_t n) {
    void *owned = malloc(n);
    if (!owned) return CUDA_ERROR_OUT_OF_MEMORY;
    memcpy(owned, src, n);
    struct op op = {OP_COPY, dst, owned, n, 0, owned, NULL, 0};
    if (!push_op(s, op)) {
        free(owned);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream hStream) {
    ENTER("cuMemcpyDtoDAsync");
    NEED_CTX();
    NEED_STREAM(s, hStream);
    if (!device_range_ok(dst, n) || !device_range_ok(src, n)) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (n == 0) LEAVE(CUDA_SUCCESS);
    LEAVE(queue_copy(s, (char *)(uintptr_t)dst, (const char *)(uintptr_t)src, n));
}

/* unified addressing: either side may be device or pinned host memory */
EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream hStream) {
    ENTER("cuMemcpyAsync");
    NEED_CTX();
    NEED_STREAM(s, hStream);
    if (!any_range_ok(dst, n) || !any_range_ok(src, n)) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (n == 0) LEAVE(CUDA_SUCCESS);
    LEAVE(queue_copy(s, (char *)(uintptr_t)dst, (const char *)(uintptr_t)src, n));
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream hStream) {
    ENTER("cuMemcpyHtoDAsync");
    NEED_CTX();
    NEED_STREAM(s, hStream);
    if (!device_range_ok(dst, n) || (n && !src)) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (n == 0) LEAVE(CUDA_SUCCESS);
    if (is_pinned(src, n)) LEAVE(queue_copy(s, (char *)(uintptr_t)dst, (const char *)src, n));
    /* pageable source: staged at the call, so the caller may reuse it at once */
    LEAVE(queue_staged_copy(s, (char *)(uintptr_t)dst, src, n));
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream hStream) {
    ENTER("cuMemcpyDtoHAsync");
    NEED_CTX();
    NEED_STREAM(s, hStream);
    if (!device_range_ok(src, n) || (n && !dst)) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (n == 0) LEAVE(CUDA_SUCCESS);
    LEAVE(queue_copy(s, (char *)dst, (const char *)(uintptr_t)src, n));
}

EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, CUstream hStream) {
    ENTER("cuMemsetD8Async");
    NEED_CTX();
    NEED_STREAM(s, hStream);
    if (!device_range_ok(dst, n)) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (n == 0) LEAVE(CUDA_SUCCESS);
    struct op op = {OP_SET, (char *)(uintptr_t)dst, NULL, n, value, NULL, NULL, 0};
    LEAVE(push_op(s, op) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY);
}

/* CUpointer_attribute and CUmemorytype values */
enum { ATTR_MEMORY_TYPE = 2, ATTR_DEVICE_ORDINAL = 9, ATTR_RANGE_START_ADDR = 11, ATTR_RANGE_SIZE = 12 };
enum { MEMORYTYPE_HOST = 1, MEMORYTYPE_DEVICE = 2 };

/* the live allocation (device or pinned) holding the byte at `p`, or NULL */
static struct allocation *allocation_at(uintptr_t p) {
    for (size_t i = 0; i < num_allocs; i++) {
        uintptr_t start = (uintptr_t)allocs[i].ptr;
        if (p >= start && p - start < allocs[i].size) return &allocs[i];
    }
    return NULL;
}

EXPORT CUresult cuPointerGetAttributes(unsigned int numAttributes, const int *attributes, void **data,
                                       CUdeviceptr ptr) {
    ENTER("cuPointerGetAttributes");
    NEED_CTX();
    if (numAttributes == 0 || !attributes || !data) LEAVE(CUDA_ERROR_INVALID_VALUE);
    for (unsigned int k = 0; k < numAttributes; k++) {
        int a = attributes[k];
        if (!data[k] || (a != ATTR_MEMORY_TYPE && a != ATTR_DEVICE_ORDINAL && a != ATTR_RANGE_START_ADDR &&
                         a != ATTR_RANGE_SIZE))
            LEAVE(CUDA_ERROR_INVALID_VALUE);
    }
    struct allocation *found = allocation_at((uintptr_t)ptr);
    for (unsigned int k = 0; k < numAttributes; k++) {
        switch (attributes[k]) {
        case ATTR_MEMORY_TYPE:
            *(unsigned int *)data[k] = !found ? 0u : found->kind == KIND_DEVICE ? MEMORYTYPE_DEVICE : MEMORYTYPE_HOST;
            break;
        case ATTR_DEVICE_ORDINAL:
            *(int *)data[k] = found ? current_ctx->device : -2;
            break;
        case ATTR_RANGE_START_ADDR:
            *(CUdeviceptr *)data[k] = found ? (CUdeviceptr)(uintptr_t)found->ptr : 0;
            break;
        default: /* ATTR_RANGE_SIZE */
            *(size_t *)data[k] = found ? found->size : 0;
            break;
        }
    }
    LEAVE(CUDA_SUCCESS);
}

/* CUmemcpyAttributes (v1): {srcAccessOrder, srcLocHint {type, id}, dstLocHint {type, id}, flags} */
struct memcpy_attributes {
    int src_access_order;
    int src_hint_type, src_hint_id;
    int dst_hint_type, dst_hint_id;
    unsigned int flags;
};

struct span {
    uintptr_t start, end;
    size_t copy;
    int is_dst;
};

static int by_start(const void *a, const void *b) {
    const struct span *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

/* 1 if some destination overlaps another copy's destination or any source (its own included) */
static int batch_overlaps(const CUdeviceptr *dsts, const CUdeviceptr *srcs, const size_t *sizes, size_t count,
                          int *failed) {
    struct span *spans = malloc(2 * count * sizeof *spans);
    if (!spans) {
        *failed = 1;
        return 0;
    }
    size_t n = 0;
    for (size_t i = 0; i < count; i++) {
        if (sizes[i] == 0) continue;
        spans[n++] = (struct span){(uintptr_t)dsts[i], (uintptr_t)dsts[i] + sizes[i], i, 1};
        spans[n++] = (struct span){(uintptr_t)srcs[i], (uintptr_t)srcs[i] + sizes[i], i, 0};
    }
    qsort(spans, n, sizeof *spans, by_start);
    uintptr_t any_end = 0, dst_end = 0; /* furthest end of the spans seen so far, of every kind / of destinations */
    int overlap = 0;
    for (size_t k = 0; k < n && !overlap; k++) {
        if (spans[k].start < (spans[k].is_dst ? any_end : dst_end)) overlap = 1;
        if (spans[k].end > any_end) any_end = spans[k].end;
        if (spans[k].is_dst && spans[k].end > dst_end) dst_end = spans[k].end;
    }
    free(spans);
    *failed = 0;
    return overlap;
}

static int attributes_ok(const struct memcpy_attributes *attrs, const size_t *attrsIdxs, size_t numAttrs,
                         size_t count) {
    if (numAttrs == 0 || numAttrs > count || attrsIdxs[0] != 0) return 0;
    for (size_t k = 0; k < numAttrs; k++) {
        if (k > 0 && attrsIdxs[k] <= attrsIdxs[k - 1]) return 0;
        if (attrsIdxs[k] >= count) return 0;
        int order = attrs[k].src_access_order;
        if (order < ORDER_STREAM || order > ORDER_ANY) return 0;
        if (attrs[k].flags & ~(unsigned)MEMCPY_FLAGS_KNOWN) return 0;
    }
    return 1;
}

static CUresult batch(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, const void *attrs,
                      size_t *attrsIdxs, size_t numAttrs, size_t *failIdx, CUstream hStream) {
    NEED_CTX();
    NEED_STREAM(s, hStream);
    if (failIdx) *failIdx = (size_t)-1;
    if (count == 0 || !dsts || !srcs || !sizes || !attrs || !attrsIdxs) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (!attributes_ok(attrs, attrsIdxs, numAttrs, count)) LEAVE(CUDA_ERROR_INVALID_VALUE);
    for (size_t i = 0; i < count; i++) {
        if (!any_range_ok(dsts[i], sizes[i]) || !any_range_ok(srcs[i], sizes[i])) {
            if (failIdx) *failIdx = i;
            LEAVE(CUDA_ERROR_INVALID_VALUE);
        }
    }
    int failed = 0;
    if (batch_overlaps(dsts, srcs, sizes, count, &failed)) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (failed) LEAVE(CUDA_ERROR_OUT_OF_MEMORY);
    size_t first = s->num_ops;
    unsigned long long issued = s->issued;
    for (size_t k = count; k-- > 0;) { /* reverse issue order: nothing may depend on the order */
        if (sizes[k] == 0) continue;
        if (queue_copy(s, (char *)(uintptr_t)dsts[k], (const char *)(uintptr_t)srcs[k], sizes[k]) != CUDA_SUCCESS) {
            s->num_ops = first; /* all or nothing */
            s->issued = issued;
            LEAVE(CUDA_ERROR_OUT_OF_MEMORY);
        }
    }
    LEAVE(CUDA_SUCCESS);
}

/* CUDA 13 form (no failIdx) */
EXPORT CUresult cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                                      const void *attrs, size_t *attrsIdxs, size_t numAttrs, CUstream hStream) {
    ENTER("cuMemcpyBatchAsync");
    return batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, NULL, hStream);
}

/* CUDA 12.8/12.9 form, with failIdx */
EXPORT CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                                   const void *attrs, size_t *attrsIdxs, size_t numAttrs, size_t *failIdx,
                                   CUstream hStream) {
    ENTER("cuMemcpyBatchAsync");
    return batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, hStream);
}

/* ---------------------------------------------------------------------------------------------- */
/* symbol lookup: the path cuda-bindings loads the driver through                                  */

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    int *symbolStatus);

static const struct {
    const char *name;
    int version; /* the CUDA version that introduced this ABI of the entry point */
    void *fn;
} symbols[] = {
    {"cuGetErrorName", 6000, (void *)cuGetErrorName},
    {"cuGetErrorString", 6000, (void *)cuGetErrorString},
    {"cuDriverGetVersion", 2020, (void *)cuDriverGetVersion},
    {"cuGetProcAddress", 12000, (void *)cuGetProcAddress_v2},
    {"cuInit", 2000, (void *)cuInit},
    {"cuDeviceGetCount", 2000, (void *)cuDeviceGetCount},
    {"cuDeviceGet", 2000, (void *)cuDeviceGet},
    {"cuDeviceGetName", 2000, (void *)cuDeviceGetName},
    {"cuDeviceTotalMem", 3020, (void *)cuDeviceTotalMem_v2},
    {"cuDevicePrimaryCtxRetain", 7000, (void *)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", 11000, (void *)cuDevicePrimaryCtxRelease_v2},
    {"cuCtxSetCurrent", 4000, (void *)cuCtxSetCurrent},
    {"cuCtxGetCurrent", 4000, (void *)cuCtxGetCurrent},
    {"cuCtxSynchronize", 2000, (void *)cuCtxSynchronize},
    {"cuMemGetInfo", 3020, (void *)cuMemGetInfo_v2},
    {"cuMemAlloc", 3020, (void *)cuMemAlloc_v2},
    {"cuMemFree", 3020, (void *)cuMemFree_v2},
    {"cuMemHostAlloc", 2020, (void *)cuMemHostAlloc},
    {"cuMemFreeHost", 2000, (void *)cuMemFreeHost},
    {"cuStreamCreate", 2000, (void *)cuStreamCreate},
    {"cuStreamDestroy", 4000, (void *)cuStreamDestroy_v2},
    {"cuStreamSynchronize", 2000, (void *)cuStreamSynchronize},
    {"cuStreamWaitEvent", 3020, (void *)cuStreamWaitEvent},
    {"cuEventCreate", 2000, (void *)cuEventCreate},
    {"cuEventDestroy", 4000, (void *)cuEventDestroy_v2},
    {"cuEventRecord", 2000, (void *)cuEventRecord},
    {"cuEventSynchronize", 2000, (void *)cuEventSynchronize},
    {"cuPointerGetAttributes", 7000, (void *)cuPointerGetAttributes},
    {"cuMemcpyAsync", 4000, (void *)cuMemcpyAsync},
    {"cuMemcpyDtoDAsync", 3020, (void *)cuMemcpyDtoDAsync_v2},
    {"cuMemcpyHtoDAsync", 3020, (void *)cuMemcpyHtoDAsync_v2},
    {"cuMemcpyDtoHAsync", 3020, (void *)cuMemcpyDtoHAsync_v2},
    {"cuMemsetD8Async", 3020, (void *)cuMemsetD8Async},
    {"cuMemcpyBatchAsync", 13000, (void *)cuMemcpyBatchAsync_v2},
    {"cuMemcpyBatchAsync", 12080, (void *)cuMemcpyBatchAsync},
};

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    int *symbolStatus) {
    (void)flags;
    pthread_mutex_lock(&lock);
    load_config();
    int trace = trace_lookups, version = driver_version;
    pthread_mutex_unlock(&lock);
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    if (trace) fprintf(stderr, "emu_cuda: cuGetProcAddress(%s, %d)\n", symbol, cudaVersion);
    *pfn = NULL;
    if (cudaVersion > version) return CUDA_ERROR_INVALID_VALUE;
    int status = PROC_SYMBOL_NOT_FOUND, best = -1;
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
        if (strcmp(symbols[i].name, symbol) != 0 || symbols[i].version > version) continue;
        if (symbols[i].version > cudaVersion) { /* this driver has it, but only in a newer ABI */
            status = PROC_VERSION_NOT_SUFFICIENT;
            continue;
        }
        if (best < 0 || symbols[i].version > symbols[best].version) best = (int)i;
    }
    if (best >= 0) {
        *pfn = symbols[best].fn;
        status = PROC_SUCCESS;
    }
    if (symbolStatus) *symbolStatus = status;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}

/* ---------------------------------------------------------------------------------------------- */
/* fault injection and introspection (for tests)                                                  */

EXPORT void emu_set_alloc_budget(long long bytes) {
    pthread_mutex_lock(&lock);
    alloc_budget = bytes;
    pthread_mutex_unlock(&lock);
}

EXPORT void emu_fail_from_call(unsigned long long n, int code) {
    pthread_mutex_lock(&lock);
    sticky_from = n == 0 ? 0 : call_count + n;
    sticky_code = code;
    pthread_mutex_unlock(&lock);
}

EXPORT void emu_fail_call(const char *name, int code, int times) {
    pthread_mutex_lock(&lock);
    snprintf(named_fault, sizeof named_fault, "%s", name ? name : "");
    named_code = code;
    named_times = times;
    pthread_mutex_unlock(&lock);
}

EXPORT void emu_fail_at_sync(int code) {
    pthread_mutex_lock(&lock);
    deferred_code = code;
    pthread_mutex_unlock(&lock);
}

EXPORT CUresult emu_engine_write(CUstream hStream, CUdeviceptr dst, const void *src, size_t n) {
    pthread_mutex_lock(&lock);
    struct emu_stream *s = valid_stream(hStream);
    CUresult rc = CUDA_SUCCESS;
    if (!s)
        rc = CUDA_ERROR_INVALID_HANDLE;
    else if (!device_range_ok(dst, n) || (n && !src))
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (n)
        rc = queue_staged_copy(s, (char *)(uintptr_t)dst, src, n);
    pthread_mutex_unlock(&lock);
    return rc;
}

EXPORT void emu_hold_call(const char *name) {
    pthread_mutex_lock(&lock);
    snprintf(hold_name, sizeof hold_name, "%s", name ? name : "");
    hold_armed = 1;
    calls_during_hold = 0;
    pthread_mutex_unlock(&lock);
}

EXPORT void emu_release_hold(void) {
    pthread_mutex_lock(&lock);
    hold_released = 1;
    hold_armed = 0;
    pthread_mutex_unlock(&lock);
}

EXPORT int emu_holding(void) {
    pthread_mutex_lock(&lock);
    int h = holding;
    pthread_mutex_unlock(&lock);
    return h;
}

EXPORT long long emu_calls_during_hold(void) {
    pthread_mutex_lock(&lock);
    long long n = calls_during_hold;
    pthread_mutex_unlock(&lock);
    return n;
}

EXPORT void emu_count_calls(const char *name) {
    pthread_mutex_lock(&lock);
    snprintf(counted_name, sizeof counted_name, "%s", name ? name : "");
    counted_calls = 0;
    pthread_mutex_unlock(&lock);
}

EXPORT long long emu_counted_calls(void) {
    pthread_mutex_lock(&lock);
    long long n = counted_calls;
    pthread_mutex_unlock(&lock);
    return n;
}

EXPORT void emu_reset(void) {
    pthread_mutex_lock(&lock);
    alloc_budget = -1;
    sticky_from = 0;
    sticky_code = 0;
    named_fault[0] = '\0';
    named_times = 0;
    deferred_code = 0;
    hold_armed = 0;
    hold_released = 1;
    counted_name[0] = '\0';
    counted_calls = 0;
    pthread_mutex_unlock(&lock);
}

EXPORT long long emu_live_allocations(void) {
    pthread_mutex_lock(&lock);
    long long n = (long long)num_allocs;
    pthread_mutex_unlock(&lock);
    return n;
}

EXPORT long long emu_live_bytes(void) {
    pthread_mutex_lock(&lock);
    long long n = 0;
    for (size_t i = 0; i < num_allocs; i++) n += (long long)allocs[i].size;
    pthread_mutex_unlock(&lock);
    return n;
}

EXPORT long long emu_pending_ops(void) {
    pthread_mutex_lock(&lock);
    long long n = (long long)pending_ops();
    pthread_mutex_unlock(&lock);
    return n;
}

EXPORT unsigned long long emu_call_count(void) {
    pthread_mutex_lock(&lock);
    unsigned long long n = call_count;
    pthread_mutex_unlock(&lock);
    return n;
}

EXPORT void emu_set_device_count(int n) {
    pthread_mutex_lock(&lock);
    load_config();
    device_count = n < 0 ? 0 : (n > MAX_DEVICES ? MAX_DEVICES : n);
    pthread_mutex_unlock(&lock);
}

EXPORT int emu_is_emulator(void) { return 1; }
