/* tiermem's allocator for torch.cuda.memory.CUDAPluggableAllocator: PyTorch's own CUDA
 * allocations in CUDA managed memory, advised by role, under a hard cap.
 *
 * tiermem/_torch_alloc.py builds this file into a shared library and loads it with ctypes.
 * torch calls tm_alloc / tm_free for the segments of one torch.cuda.MemPool; everything else
 * here is for Python: the advice and role of the next allocations (per device), the cap, the
 * counters, and the registry of live allocations (a later budget enforcer reads it to pick
 * cold allocations to evict).
 *
 * Rules: nothing here may crash the process or unwind into torch.
 * A failure is counted, logged to stderr once per kind, and tm_alloc returns NULL, which torch
 * turns into its own OutOfMemoryError. A failed advice or prefetch is only a hint lost: it is
 * counted and logged, and the memory is still returned. Every failed CUDA call is followed by
 * cudaGetLastError(), so that torch's next kernel-launch check does not pick up our error.
 *
 * Thread safety: one mutex guards the settings, the counters and the registry. It is never
 * held across a CUDA call, so a slow cudaMallocManaged does not stall the setters. torch calls
 * tm_alloc and tm_free under its own allocator mutex.
 *
 * Why cudaFree's implicit synchronisation is acceptable in tm_free: torch returns a segment
 * to its allocator only from empty_cache(), from its out-of-memory retry, or when a pool is
 * destroyed. Each of those already waits for the segment's pending work (torch synchronises the
 * events recorded on its blocks first), and none is on a hot path. A segment torch frees is
 * therefore idle on every stream, and cudaFree waiting for the device costs one sync in a
 * path that already synchronises.
 */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#define TM_ABI_VERSION 1
#define TM_MAX_DEVICES 64

/* CUDA 13 dropped the _v2 names: cudaMemAdvise and cudaMemPrefetchAsync themselves take a
 * cudaMemLocation (and the prefetch a flags word). CUDA 12.2-12.x has them as _v2. */
#if CUDART_VERSION >= 13000
#define TM_ADVISE(p, n, a, loc) cudaMemAdvise((p), (n), (a), (loc))
#define TM_PREFETCH(p, n, loc, s) cudaMemPrefetchAsync((p), (n), (loc), 0, (s))
#elif CUDART_VERSION >= 12020
#define TM_ADVISE(p, n, a, loc) cudaMemAdvise_v2((p), (n), (a), (loc))
#define TM_PREFETCH(p, n, loc, s) cudaMemPrefetchAsync_v2((p), (n), (loc), 0, (s))
#else
#error "tiermem's torch allocator needs the CUDA 12.2 or newer headers (cudaMemLocation advice)"
#endif

/* Preferred location values for tm_set_advice. */
enum { TM_PREFER_NONE = 0, TM_PREFER_HOST = 1, TM_PREFER_DEVICE = 2 };

typedef struct {
    int role;               /* tiermem's role id (index in tiermem.Role), stored per allocation */
    int preferred;          /* TM_PREFER_* */
    int read_mostly;
    int accessed_by_device;
    int accessed_by_host;
    int prefetch;           /* prefetch fresh allocations to the device, on the allocating stream */
} tm_advice;

typedef struct {
    void* ptr;
    size_t size;
    int role;
    int device;
} tm_entry;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static tm_advice g_advice[TM_MAX_DEVICES];     /* zero: no advice, role 0, no prefetch */
static tm_entry* g_entries = NULL;
static size_t g_n = 0, g_capacity = 0;
/* The cap starts at 0, so nothing is allocated until Python has set one (NOTE [managed cap]
 * in tiermem/_limits.py: oversubscribed managed memory can hang a shared GPU). */
static long long g_cap = 0;
static long long g_live = 0, g_peak = 0;
static long long g_allocs = 0, g_frees = 0, g_refused = 0, g_failed = 0, g_hint_failed = 0;
static int g_last_error = 0;

/* The counters, in the order tm_get_stats writes them. Python reads the names from here. */
static const char k_stat_names[] =
    "live_bytes,peak_bytes,allocations,frees,refused,failed,hints_failed,live_allocations,cap_bytes";
#define TM_NSTATS 9

enum { LOG_CAP, LOG_MALLOC, LOG_ADVISE, LOG_PREFETCH, LOG_FREE, LOG_UNKNOWN, LOG_ARGS, LOG_REGISTRY };
static atomic_uint g_logged = 0;

static void log_once(int kind, const char* fmt, ...) {
    unsigned bit = 1u << kind;
    if (atomic_fetch_or(&g_logged, bit) & bit) return;
    va_list ap;
    va_start(ap, fmt);
    fputs("tiermem allocator: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputs(" (logged once)\n", stderr);
    va_end(ap);
}

static void note_cuda_error(cudaError_t err) {
    (void)cudaGetLastError();   /* clear it, so torch's next launch check does not see it */
    pthread_mutex_lock(&g_lock);
    g_last_error = (int)err;
    pthread_mutex_unlock(&g_lock);
}

static struct cudaMemLocation location(int host, int device) {
    struct cudaMemLocation loc;
    memset(&loc, 0, sizeof loc);
    loc.type = host ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
    loc.id = host ? 0 : device;
    return loc;
}

static int advise(void* p, size_t n, enum cudaMemoryAdvise what, int host, int device) {
    cudaError_t err = TM_ADVISE(p, n, what, location(host, device));
    if (err == cudaSuccess) return 0;
    note_cuda_error(err);
    log_once(LOG_ADVISE, "cudaMemAdvise(%d) failed: %s; the memory is used without that advice",
             (int)what, cudaGetErrorName(err));
    return 1;
}

/* A fresh allocation has no advice, so only the settings that are on need a call. */
static int apply_advice(void* p, size_t n, int device, const tm_advice* a) {
    int failed = 0;
    if (a->preferred == TM_PREFER_HOST || a->preferred == TM_PREFER_DEVICE)
        failed += advise(p, n, cudaMemAdviseSetPreferredLocation, a->preferred == TM_PREFER_HOST, device);
    if (a->read_mostly) failed += advise(p, n, cudaMemAdviseSetReadMostly, 0, device);
    if (a->accessed_by_device) failed += advise(p, n, cudaMemAdviseSetAccessedBy, 0, device);
    if (a->accessed_by_host) failed += advise(p, n, cudaMemAdviseSetAccessedBy, 1, device);
    return failed;
}

/* Caller holds g_lock. Returns 0, or -1 when the registry cannot grow. */
static int registry_add(void* p, size_t n, int role, int device) {
    if (g_n == g_capacity) {
        size_t cap = g_capacity ? 2 * g_capacity : 256;
        tm_entry* grown = (tm_entry*)realloc(g_entries, cap * sizeof *grown);
        if (!grown) return -1;
        g_entries = grown;
        g_capacity = cap;
    }
    g_entries[g_n].ptr = p;
    g_entries[g_n].size = n;
    g_entries[g_n].role = role;
    g_entries[g_n].device = device;
    g_n++;
    return 0;
}

/* Caller holds g_lock. Removes p; returns its size, or 0 when p is not registered. */
static size_t registry_remove(void* p) {
    for (size_t i = g_n; i-- > 0;) {   /* newest first: short-lived segments are freed first */
        if (g_entries[i].ptr == p) {
            size_t n = g_entries[i].size;
            g_entries[i] = g_entries[--g_n];
            return n;
        }
    }
    return 0;
}

void* tm_alloc(ssize_t size, int device, cudaStream_t stream) {
    if (size <= 0 || device < 0 || device >= TM_MAX_DEVICES) {
        pthread_mutex_lock(&g_lock);
        g_failed++;
        pthread_mutex_unlock(&g_lock);
        log_once(LOG_ARGS, "tm_alloc(size=%lld, device=%d): bad arguments, returning NULL", (long long)size, device);
        return NULL;
    }
    const size_t n = (size_t)size;

    pthread_mutex_lock(&g_lock);
    if ((long long)n > g_cap - g_live) {   /* no overflow: both are >= 0 */
        long long live = g_live, cap = g_cap;
        g_refused++;
        pthread_mutex_unlock(&g_lock);
        log_once(LOG_CAP, "refused %lld bytes: %lld in use, the cap is %lld bytes (tiermem's managed "
                 "cap; torch will raise OutOfMemoryError)", (long long)n, live, cap);
        return NULL;
    }
    g_live += (long long)n;               /* reserved now, so concurrent calls cannot pass the cap */
    const tm_advice adv = g_advice[device];
    pthread_mutex_unlock(&g_lock);

    void* p = NULL;
    cudaError_t err = cudaMallocManaged(&p, n, cudaMemAttachGlobal);
    if (err != cudaSuccess || p == NULL) {
        note_cuda_error(err);
        pthread_mutex_lock(&g_lock);
        g_live -= (long long)n;
        g_failed++;
        pthread_mutex_unlock(&g_lock);
        log_once(LOG_MALLOC, "cudaMallocManaged(%zu) failed: %s", n, cudaGetErrorName(err));
        return NULL;
    }

    int hints_failed = apply_advice(p, n, device, &adv);
    if (adv.prefetch) {
        err = TM_PREFETCH(p, n, location(0, device), stream);
        if (err != cudaSuccess) {
            note_cuda_error(err);
            hints_failed++;
            log_once(LOG_PREFETCH, "cudaMemPrefetchAsync(%zu bytes to device %d) failed: %s; pages "
                     "will be populated on first touch", n, device, cudaGetErrorName(err));
        }
    }

    pthread_mutex_lock(&g_lock);
    int added = registry_add(p, n, adv.role, device);
    if (added == 0) {
        g_allocs++;
        g_hint_failed += hints_failed;
        if (g_live > g_peak) g_peak = g_live;
    } else {
        g_live -= (long long)n;
        g_failed++;
    }
    pthread_mutex_unlock(&g_lock);
    if (added != 0) {
        /* An allocation we cannot account for would slip past the cap: give it back. */
        log_once(LOG_REGISTRY, "out of host memory for the allocation registry; returning NULL");
        if (cudaFree(p) != cudaSuccess) (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

void tm_free(void* ptr, ssize_t size, int device, cudaStream_t stream) {
    (void)size; (void)device; (void)stream;   /* the registry has the size this pointer was given */
    if (ptr == NULL) return;
    pthread_mutex_lock(&g_lock);
    size_t n = registry_remove(ptr);
    if (n) {
        g_live -= (long long)n;
        g_frees++;
    }
    pthread_mutex_unlock(&g_lock);
    if (n == 0) {
        log_once(LOG_UNKNOWN, "tm_free(%p): not an allocation of this allocator; left alone", ptr);
        return;
    }
    cudaError_t err = cudaFree(ptr);   /* synchronises; see the note at the top of this file */
    if (err != cudaSuccess) {
        note_cuda_error(err);
        pthread_mutex_lock(&g_lock);
        g_live += (long long)n;        /* still held by the driver: keep it under the cap */
        g_failed++;
        pthread_mutex_unlock(&g_lock);
        log_once(LOG_FREE, "cudaFree(%p) failed: %s; its %zu bytes stay counted", ptr, cudaGetErrorName(err), n);
    }
}

/* ---- Settings, for Python (ctypes). All return 0 on success, -1 on a bad argument. ---- */

int tm_abi_version(void) { return TM_ABI_VERSION; }

int tm_cudart_version(void) { return CUDART_VERSION; }

int tm_max_devices(void) { return TM_MAX_DEVICES; }

/* The advice and role id given to allocations made from now on for `device`. */
int tm_set_advice(int device, int role, int preferred, int read_mostly, int accessed_by_device,
                  int accessed_by_host, int prefetch) {
    if (device < 0 || device >= TM_MAX_DEVICES || preferred < TM_PREFER_NONE || preferred > TM_PREFER_DEVICE)
        return -1;
    tm_advice a = {role, preferred, read_mostly != 0, accessed_by_device != 0, accessed_by_host != 0, prefetch != 0};
    pthread_mutex_lock(&g_lock);
    g_advice[device] = a;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

/* Fills out[0..6] with the advice set for `device` (role first, as tm_set_advice takes them). */
int tm_get_advice(int device, int* out) {
    if (device < 0 || device >= TM_MAX_DEVICES || out == NULL) return -1;
    pthread_mutex_lock(&g_lock);
    tm_advice a = g_advice[device];
    pthread_mutex_unlock(&g_lock);
    out[0] = a.role; out[1] = a.preferred; out[2] = a.read_mostly; out[3] = a.accessed_by_device;
    out[4] = a.accessed_by_host; out[5] = a.prefetch;
    return 0;
}

/* The cap on live bytes, over all devices. Lowering it below the live bytes frees nothing; it
 * refuses every allocation until enough is freed. */
int tm_set_cap(long long bytes) {
    if (bytes < 0) return -1;
    pthread_mutex_lock(&g_lock);
    g_cap = bytes;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

const char* tm_stat_names(void) { return k_stat_names; }

/* Writes up to n counters, in the order of tm_stat_names; returns how many there are. */
int tm_get_stats(long long* out, int n) {
    long long v[TM_NSTATS];
    pthread_mutex_lock(&g_lock);
    v[0] = g_live; v[1] = g_peak; v[2] = g_allocs; v[3] = g_frees; v[4] = g_refused;
    v[5] = g_failed; v[6] = g_hint_failed; v[7] = (long long)g_n; v[8] = g_cap;
    pthread_mutex_unlock(&g_lock);
    for (int i = 0; i < n && i < TM_NSTATS && out != NULL; i++) out[i] = v[i];
    return TM_NSTATS;
}

void tm_reset_peak(void) {
    pthread_mutex_lock(&g_lock);
    g_peak = g_live;
    pthread_mutex_unlock(&g_lock);
}

/* The last CUDA error this allocator saw (a cudaError_t), or 0. */
int tm_last_error(void) {
    pthread_mutex_lock(&g_lock);
    int e = g_last_error;
    pthread_mutex_unlock(&g_lock);
    return e;
}

/* Copies up to `max` live allocations (oldest first, except where frees reordered them) and
 * returns how many are live; call again with a larger buffer if that is more than `max`. */
long long tm_live_allocations(uint64_t* ptrs, uint64_t* sizes, int* roles, int* devices, long long max) {
    pthread_mutex_lock(&g_lock);
    long long count = (long long)g_n;
    for (long long i = 0; i < count && i < max; i++) {
        if (ptrs) ptrs[i] = (uint64_t)(uintptr_t)g_entries[i].ptr;
        if (sizes) sizes[i] = (uint64_t)g_entries[i].size;
        if (roles) roles[i] = g_entries[i].role;
        if (devices) devices[i] = g_entries[i].device;
    }
    pthread_mutex_unlock(&g_lock);
    return count;
}

/* cudaDevAttrConcurrentManagedAccess of `device` (1 or 0), or -1 when it cannot be read.
 * Without it advice and prefetch to a GPU do nothing useful (tiermem/_cuda.py). */
int tm_concurrent_managed_access(int device) {
    int value = 0;
    cudaError_t err = cudaDeviceGetAttribute(&value, cudaDevAttrConcurrentManagedAccess, device);
    if (err != cudaSuccess) {
        note_cuda_error(err);
        return -1;
    }
    return value;
}

/* cudaPointerGetAttributes' memory type: 0 unregistered, 1 host, 2 device, 3 managed; -1 on error. */
int tm_pointer_type(const void* ptr) {
    struct cudaPointerAttributes attrs;
    cudaError_t err = cudaPointerGetAttributes(&attrs, ptr);
    if (err != cudaSuccess) {
        note_cuda_error(err);
        return -1;
    }
    return (int)attrs.type;
}
