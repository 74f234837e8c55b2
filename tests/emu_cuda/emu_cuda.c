/*
 * An emulated CUDA driver (libcuda.so.1) over host memory, for testing CudaDevice without a GPU.
 *
 * It implements the driver entry points lifecycle's CudaDevice uses, and the path through which
 * cuda-bindings loads a driver: dlopen("libcuda.so.1"), dlsym("cuGetProcAddress_v2"), then one
 * cuGetProcAddress_v2 per entry point. Unknown entry points resolve to NULL with
 * CUDA_ERROR_NOT_FOUND, which cuda-bindings turns into a Python exception when (and only when)
 * such a function is called.
 *
 * Behaviour worth knowing in tests:
 *  - Device and pinned allocations are host memory, 256-byte aligned, filled with 0xCD (memory from
 *    cuMemAlloc is not zeroed on a GPU either).
 *  - Async copies and memsets are queued on their stream and run at cuStreamSynchronize (or
 *    cuCtxSynchronize, cuStreamDestroy, cuMemFree/cuMemFreeHost, which synchronise on a GPU too):
 *    a missing synchronize shows up as stale data. A host->device copy from pageable memory
 *    snapshots the source at the call, as the real driver stages it before returning.
 *  - Every device range a call names must lie inside one live device allocation (for cuMemcpyAsync
 *    and cuMemcpyBatchAsync, which take unified addresses: a device or pinned allocation),
 *    otherwise the call fails with CUDA_ERROR_INVALID_VALUE and nothing is queued.
 *  - Allocation, copy and stream calls need a current context (cuCtxSetCurrent), per thread.
 *
 * Fault injection (C functions, called through ctypes; never counted as driver calls):
 *  emu_set_alloc_budget(bytes)       cuMemAlloc fails with CUDA_ERROR_OUT_OF_MEMORY past this many
 *                                    live device bytes (-1: no budget)
 *  emu_fail_from_call(n, code)       the n-th driver call from now (1 = the next) and every later
 *                                    one fail with `code`: a sticky error
 *  emu_fail_call(name, code, times)  the next `times` calls (-1: all) of entry point `name`
 *                                    (e.g. "cuMemcpyDtoDAsync") fail with `code`
 *  emu_reset()                       clear every fault and the budget (allocations stay)
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

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
typedef struct emu_ctx *CUcontext;
typedef struct emu_stream *CUstream;

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

enum { OP_COPY = 0, OP_SET = 1 };

struct op {
    int kind;
    char *dst;
    const char *src;
    size_t nbytes;
    int value;
    void *owned; /* snapshot of a pageable source, freed once the op ran */
};

struct emu_stream {
    unsigned magic;
    struct op *ops;
    size_t num_ops, cap_ops;
    struct emu_stream *next;
};

struct emu_ctx {
    unsigned magic;
    int device;
    int refcount;
};

#define STREAM_MAGIC 0x5354524du
#define CTX_MAGIC 0x43545821u
#define MAX_DEVICES 8

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized = 0;
static int device_count = -1;
static long long total_mem = -1;
static int driver_version = -1;
static int trace_lookups = 0;
static struct emu_ctx primary[MAX_DEVICES];
static __thread struct emu_ctx *current_ctx = NULL;
static struct emu_stream *streams = NULL;

static struct allocation *allocs = NULL;
static size_t num_allocs = 0, cap_allocs = 0;
static long long device_bytes = 0;

/* faults */
static long long alloc_budget = -1;
static unsigned long long call_count = 0;
static unsigned long long sticky_from = 0; /* 0: none; else the call number from which calls fail */
static int sticky_code = 0;
static char named_fault[128];
static int named_code = 0;
static int named_times = 0;

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

/* Every counted entry point starts with ENTER(name): it takes the lock, counts the call and returns
 * an injected fault if one applies. LEAVE(rc) releases the lock. */
static CUresult enter(const char *name) {
    pthread_mutex_lock(&lock);
    load_config();
    call_count++;
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
    for (struct emu_stream *it = streams; it; it = it->next)
        if (it == s && it->magic == STREAM_MAGIC) return it;
    return NULL;
}

static int push_op(struct emu_stream *s, struct op op) {
    if (s->num_ops == s->cap_ops) {
        size_t cap = s->cap_ops ? 2 * s->cap_ops : 64;
        struct op *ops = realloc(s->ops, cap * sizeof(struct op));
        if (!ops) return 0;
        s->ops = ops;
        s->cap_ops = cap;
    }
    s->ops[s->num_ops++] = op;
    return 1;
}

static void drain(struct emu_stream *s) {
    for (size_t i = 0; i < s->num_ops; i++) {
        struct op *op = &s->ops[i];
        if (op->kind == OP_COPY)
            memmove(op->dst, op->src, op->nbytes);
        else
            memset(op->dst, op->value, op->nbytes);
        free(op->owned);
    }
    s->num_ops = 0;
}

static void drain_all(void) {
    for (struct emu_stream *it = streams; it; it = it->next) drain(it);
}

static size_t pending_ops(void) {
    size_t n = 0;
    for (struct emu_stream *it = streams; it; it = it->next) n += it->num_ops;
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
    LEAVE(drop_allocation(p, KIND_PINNED));
}

/* ---------------------------------------------------------------------------------------------- */
/* streams and async work                                                                          */

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
    if (!s) LEAVE(CUDA_ERROR_INVALID_HANDLE);
    drain(s); /* work already issued completes, as on a GPU */
    for (struct emu_stream **it = &streams; *it; it = &(*it)->next)
        if (*it == s) {
            *it = s->next;
            break;
        }
    s->magic = 0;
    free(s->ops);
    free(s);
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamSynchronize(CUstream hStream) {
    ENTER("cuStreamSynchronize");
    NEED_CTX();
    struct emu_stream *s = valid_stream(hStream);
    if (!s) LEAVE(CUDA_ERROR_INVALID_HANDLE);
    drain(s);
    LEAVE(CUDA_SUCCESS);
}

/* Checks shared by the async calls: a valid stream of ours (the legacy NULL stream is not
 * emulated: CudaDevice never uses it). */
#define NEED_STREAM(var, h)                              \
    struct emu_stream *var = valid_stream(h);            \
    if (!var) LEAVE(CUDA_ERROR_INVALID_HANDLE)

EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream hStream) {
    ENTER("cuMemcpyDtoDAsync");
    NEED_CTX();
    NEED_STREAM(s, hStream);
    if (!device_range_ok(dst, n) || !device_range_ok(src, n)) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (n == 0) LEAVE(CUDA_SUCCESS);
    struct op op = {OP_COPY, (char *)(uintptr_t)dst, (const char *)(uintptr_t)src, n, 0, NULL};
    LEAVE(push_op(s, op) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY);
}

/* unified addressing: either side may be device or pinned host memory */
EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream hStream) {
    ENTER("cuMemcpyAsync");
    NEED_CTX();
    NEED_STREAM(s, hStream);
    if (!any_range_ok(dst, n) || !any_range_ok(src, n)) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (n == 0) LEAVE(CUDA_SUCCESS);
    struct op op = {OP_COPY, (char *)(uintptr_t)dst, (const char *)(uintptr_t)src, n, 0, NULL};
    LEAVE(push_op(s, op) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY);
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream hStream) {
    ENTER("cuMemcpyHtoDAsync");
    NEED_CTX();
    NEED_STREAM(s, hStream);
    if (!device_range_ok(dst, n) || (n && !src)) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (n == 0) LEAVE(CUDA_SUCCESS);
    struct op op = {OP_COPY, (char *)(uintptr_t)dst, (const char *)src, n, 0, NULL};
    if (!is_pinned(src, n)) {
        /* pageable source: staged at the call, so the caller may reuse it at once */
        op.owned = malloc(n);
        if (!op.owned) LEAVE(CUDA_ERROR_OUT_OF_MEMORY);
        memcpy(op.owned, src, n);
        op.src = op.owned;
    }
    if (!push_op(s, op)) {
        free(op.owned);
        LEAVE(CUDA_ERROR_OUT_OF_MEMORY);
    }
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream hStream) {
    ENTER("cuMemcpyDtoHAsync");
    NEED_CTX();
    NEED_STREAM(s, hStream);
    if (!device_range_ok(src, n) || (n && !dst)) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (n == 0) LEAVE(CUDA_SUCCESS);
    struct op op = {OP_COPY, (char *)dst, (const char *)(uintptr_t)src, n, 0, NULL};
    LEAVE(push_op(s, op) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY);
}

EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, CUstream hStream) {
    ENTER("cuMemsetD8Async");
    NEED_CTX();
    NEED_STREAM(s, hStream);
    if (!device_range_ok(dst, n)) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (n == 0) LEAVE(CUDA_SUCCESS);
    struct op op = {OP_SET, (char *)(uintptr_t)dst, NULL, n, value, NULL};
    LEAVE(push_op(s, op) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY);
}

/* cuMemcpyBatchAsync: CUDA 13 form (no failIdx). The attributes are accepted but not interpreted
 * beyond the rules the real driver checks: at least one, the first applying from copy 0. */
static CUresult batch(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, const void *attrs,
                      size_t *attrsIdxs, size_t numAttrs, size_t *failIdx, CUstream hStream) {
    NEED_CTX();
    NEED_STREAM(s, hStream);
    if (failIdx) *failIdx = (size_t)-1;
    if (count == 0 || !dsts || !srcs || !sizes || !attrs || !attrsIdxs || numAttrs == 0 || numAttrs > count ||
        attrsIdxs[0] != 0)
        LEAVE(CUDA_ERROR_INVALID_VALUE);
    for (size_t i = 0; i < count; i++) {
        if (!any_range_ok(dsts[i], sizes[i]) || !any_range_ok(srcs[i], sizes[i])) {
            if (failIdx) *failIdx = i;
            LEAVE(CUDA_ERROR_INVALID_VALUE);
        }
    }
    size_t first = s->num_ops;
    for (size_t i = 0; i < count; i++) {
        if (sizes[i] == 0) continue;
        struct op op = {OP_COPY, (char *)(uintptr_t)dsts[i], (const char *)(uintptr_t)srcs[i], sizes[i], 0, NULL};
        if (!push_op(s, op)) {
            s->num_ops = first; /* all or nothing */
            LEAVE(CUDA_ERROR_OUT_OF_MEMORY);
        }
    }
    LEAVE(CUDA_SUCCESS);
}

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
    int min_version; /* the entry applies to requests for this CUDA version and later */
    void *fn;
} symbols[] = {
    {"cuGetErrorName", 0, (void *)cuGetErrorName},
    {"cuGetErrorString", 0, (void *)cuGetErrorString},
    {"cuDriverGetVersion", 0, (void *)cuDriverGetVersion},
    {"cuGetProcAddress", 0, (void *)cuGetProcAddress_v2},
    {"cuInit", 0, (void *)cuInit},
    {"cuDeviceGetCount", 0, (void *)cuDeviceGetCount},
    {"cuDeviceGet", 0, (void *)cuDeviceGet},
    {"cuDeviceGetName", 0, (void *)cuDeviceGetName},
    {"cuDeviceTotalMem", 0, (void *)cuDeviceTotalMem_v2},
    {"cuDevicePrimaryCtxRetain", 0, (void *)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", 0, (void *)cuDevicePrimaryCtxRelease_v2},
    {"cuCtxSetCurrent", 0, (void *)cuCtxSetCurrent},
    {"cuCtxGetCurrent", 0, (void *)cuCtxGetCurrent},
    {"cuCtxSynchronize", 0, (void *)cuCtxSynchronize},
    {"cuMemGetInfo", 0, (void *)cuMemGetInfo_v2},
    {"cuMemAlloc", 0, (void *)cuMemAlloc_v2},
    {"cuMemFree", 0, (void *)cuMemFree_v2},
    {"cuMemHostAlloc", 0, (void *)cuMemHostAlloc},
    {"cuMemFreeHost", 0, (void *)cuMemFreeHost},
    {"cuStreamCreate", 0, (void *)cuStreamCreate},
    {"cuStreamDestroy", 0, (void *)cuStreamDestroy_v2},
    {"cuStreamSynchronize", 0, (void *)cuStreamSynchronize},
    {"cuMemcpyAsync", 0, (void *)cuMemcpyAsync},
    {"cuMemcpyDtoDAsync", 0, (void *)cuMemcpyDtoDAsync_v2},
    {"cuMemcpyHtoDAsync", 0, (void *)cuMemcpyHtoDAsync_v2},
    {"cuMemcpyDtoHAsync", 0, (void *)cuMemcpyDtoHAsync_v2},
    {"cuMemsetD8Async", 0, (void *)cuMemsetD8Async},
    {"cuMemcpyBatchAsync", 13000, (void *)cuMemcpyBatchAsync_v2},
    {"cuMemcpyBatchAsync", 12080, (void *)cuMemcpyBatchAsync},
};

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    int *symbolStatus) {
    (void)flags;
    pthread_mutex_lock(&lock);
    load_config();
    int trace = trace_lookups;
    pthread_mutex_unlock(&lock);
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    if (trace) fprintf(stderr, "emu_cuda: cuGetProcAddress(%s, %d)\n", symbol, cudaVersion);
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
        if (strcmp(symbols[i].name, symbol) == 0 && cudaVersion >= symbols[i].min_version) {
            *pfn = symbols[i].fn;
            if (symbolStatus) *symbolStatus = 0; /* CU_GET_PROC_ADDRESS_SUCCESS */
            return CUDA_SUCCESS;
        }
    }
    *pfn = NULL;
    if (symbolStatus) *symbolStatus = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return CUDA_ERROR_NOT_FOUND;
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

EXPORT void emu_reset(void) {
    pthread_mutex_lock(&lock);
    alloc_budget = -1;
    sticky_from = 0;
    sticky_code = 0;
    named_fault[0] = '\0';
    named_times = 0;
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
