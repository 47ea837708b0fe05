/* Persistent thread pool: see pool.h. */
#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#define MAX_THREADS 64
/* A worker polls this long for the next job before sleeping. It was 50 us (the gaps between kernel
 * calls inside a pass), because a spinning worker held a core that Python fetch threads needed. Since
 * reads run on the extension's I/O threads (aio.c), which need the GIL and little CPU, a worker that
 * stays awake through a whole pass pays: 5 ms with the threshold at 64K ran AR 1.17-1.50x faster
 * than 50 us at 512K (embedded model at 25 % and full, widened model at 25 %; one process, taking
 * turns: docs/performance/kernels.md, "Reads off the GIL"). A worker asleep when a job starts still
 * costs only its help with that job (waking one takes ~300 us here). */
#define SPIN_NS_DEFAULT 5000000L
long pool_spin_ns = SPIN_NS_DEFAULT; /* settable: `_cpu.pool_spin_us` (benchmarks) */

#define CHUNKS_PER_THREAD 4

long pool_min_work = POOL_MIN_WORK_DEFAULT;

static struct {
    pthread_t tid[MAX_THREADS];
    int n;                       /* threads in all, the caller included */
    pool_fn fn;
    void *ctx;
    int chunks;                  /* the current job's chunk count */
    /* each counter on a cache line of its own: spinning readers of one do not slow writers of another */
    _Alignas(64) atomic_int next; /* the next chunk to take */
    _Alignas(64) atomic_int done; /* chunks finished */
    /* OPEN while workers may join the current job; the low bits count the workers in it. A worker
     * joins with a compare-and-swap that needs OPEN, so once the caller clears OPEN and sees no
     * workers, none can touch the job's ctx again (the caller may free it on return). */
    _Alignas(64) atomic_uint state;
    _Alignas(64) atomic_uint gen; /* bumped once per job */
    char pad_gen[60];
    unsigned start_gen;          /* gen when the workers were created: their first "seen" */
    atomic_int stop;
    atomic_int held;             /* tests: workers wait before joining, as if not woken yet */
    atomic_int sleepers;
    pthread_mutex_t mu;
    pthread_cond_t cv;
} P = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .n = 1};

#define OPEN 0x80000000u

/* One job at a time: kernels run with the GIL released, so two Python threads may call in. */
static pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER;

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Take and run chunks of the current job until none are left. */
static void take_chunks(void) {
    int i;
    while ((i = atomic_fetch_add_explicit(&P.next, 1, memory_order_relaxed)) < P.chunks) {
        P.fn(P.ctx, i, P.chunks);
        atomic_fetch_add_explicit(&P.done, 1, memory_order_release);
    }
}

static void *worker(void *arg) {
    (void)arg;
    /* not the current gen: a job may already have been published before this thread first runs */
    unsigned seen = P.start_gen;
    for (;;) {
        long t0 = now_ns();
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&P.gen, memory_order_acquire)) == seen && !atomic_load(&P.stop)) {
            CPU_RELAX();
            if (++spins % 256 == 0 && now_ns() - t0 > pool_spin_ns) {
                pthread_mutex_lock(&P.mu);
                atomic_fetch_add(&P.sleepers, 1);
                while (atomic_load(&P.gen) == seen && !atomic_load(&P.stop))
                    pthread_cond_wait(&P.cv, &P.mu);
                atomic_fetch_sub(&P.sleepers, 1);
                pthread_mutex_unlock(&P.mu);
            }
        }
        if (atomic_load(&P.stop)) return NULL;
        seen = g;
        while (atomic_load_explicit(&P.held, memory_order_relaxed) && !atomic_load(&P.stop)) {
            struct timespec nap = {0, 100000}; /* held (tests): as if the OS had not woken us yet */
            nanosleep(&nap, NULL);
        }
        /* join whatever job is open now (perhaps a later one than g: fn/ctx are read after the join,
         * so they are that job's), or skip a job that has already closed */
        unsigned s = atomic_load_explicit(&P.state, memory_order_relaxed);
        while (s & OPEN)
            if (atomic_compare_exchange_weak_explicit(&P.state, &s, s + 1, memory_order_acquire, memory_order_relaxed))
                break;
        if (!(s & OPEN)) continue;
        take_chunks();
        atomic_fetch_sub_explicit(&P.state, 1, memory_order_release);
    }
}

static void stop_all(void) {
    int workers = P.n - 1;
    if (workers <= 0) return;
    pthread_mutex_lock(&P.mu);
    atomic_store(&P.stop, 1);
    pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    for (int i = 1; i <= workers; i++) pthread_join(P.tid[i], NULL);
    atomic_store(&P.stop, 0);
    P.n = 1;
}

int pool_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    pthread_mutex_lock(&run_mu); /* not while a job runs */
    if (n == P.n) {
        pthread_mutex_unlock(&run_mu);
        return n;
    }
    stop_all();
    P.n = n;
    P.start_gen = atomic_load(&P.gen); /* pthread_create orders this write before the thread runs */
    for (int i = 1; i < n; i++) {
        if (pthread_create(&P.tid[i], NULL, worker, (void *)(long)i) != 0) {
            P.n = i; /* run with what started */
            break;
        }
    }
    pthread_mutex_unlock(&run_mu);
    return P.n;
}

int pool_threads(void) { return P.n; }

int pool_chunks(void) { return P.n * CHUNKS_PER_THREAD; }

void pool_hold_workers(int on) { atomic_store(&P.held, on != 0); }

void pool_run(pool_fn fn, void *ctx, int n) {
    if (n <= 0) return;
    pthread_mutex_lock(&run_mu);
    if (P.n <= 1 || n == 1) {
        for (int i = 0; i < n; i++) fn(ctx, i, n);
        pthread_mutex_unlock(&run_mu);
        return;
    }
    P.fn = fn;
    P.ctx = ctx;
    P.chunks = n;
    atomic_store_explicit(&P.next, 0, memory_order_relaxed);
    atomic_store_explicit(&P.done, 0, memory_order_relaxed);
    atomic_store_explicit(&P.state, OPEN, memory_order_release); /* the job above, then open */
    atomic_fetch_add(&P.gen, 1); /* seq_cst: ordered before the sleepers check */
    if (atomic_load(&P.sleepers) > 0) { /* wake them for the calls to come; this one need not wait */
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.cv);
        pthread_mutex_unlock(&P.mu);
    }
    take_chunks();
    int spins = 0;
    /* chunks a worker took are finished by it; then close, and wait for joined workers to leave */
    while (atomic_load_explicit(&P.done, memory_order_acquire) < n) {
        CPU_RELAX();
        if (++spins > 4096) sched_yield(); /* a descheduled worker: give it the core */
    }
    atomic_fetch_and_explicit(&P.state, ~OPEN, memory_order_acq_rel);
    while (atomic_load_explicit(&P.state, memory_order_acquire) != 0) {
        CPU_RELAX();
        if (++spins > 4096) sched_yield();
    }
    pthread_mutex_unlock(&run_mu);
}

typedef struct {
    void *buf[ARENA_SLOTS];
    size_t len[ARENA_SLOTS];
} arena;

static pthread_key_t arena_key;
static pthread_once_t arena_once = PTHREAD_ONCE_INIT;

static void arena_free(void *p) { /* a thread's scratch goes with the thread */
    arena *a = p;
    for (int i = 0; i < ARENA_SLOTS; i++) free(a->buf[i]);
    free(a);
}

static void arena_init(void) { pthread_key_create(&arena_key, arena_free); }

void *arena_get(int slot, size_t bytes) {
    pthread_once(&arena_once, arena_init);
    arena *a = pthread_getspecific(arena_key);
    if (!a) {
        a = calloc(1, sizeof(arena));
        if (!a || pthread_setspecific(arena_key, a)) {
            free(a);
            return NULL;
        }
    }
    if (bytes > a->len[slot]) {
        free(a->buf[slot]);
        a->buf[slot] = malloc(bytes);
        a->len[slot] = a->buf[slot] ? bytes : 0;
    }
    return a->buf[slot];
}
