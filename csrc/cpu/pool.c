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
#define SPIN_NS 200000L /* a worker polls this long for the next job before sleeping */

static struct {
    pthread_t tid[MAX_THREADS];
    int n;                       /* threads in all, the caller included */
    pool_fn fn;
    void *ctx;
    atomic_uint gen;             /* bumped once per job */
    unsigned start_gen;          /* gen when the workers were created: their first "seen" */
    atomic_int pending;          /* workers still running the current job */
    atomic_int stop;
    atomic_int sleepers;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* barrier */
    atomic_int bar_count;
    atomic_uint bar_gen;
} P = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .n = 1};

/* One job at a time: kernels run with the GIL released, so two Python threads may call in. */
static pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER;

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void *worker(void *arg) {
    int ith = (int)(long)arg;
    /* not the current gen: a job may already have been published before this thread first runs */
    unsigned seen = P.start_gen;
    for (;;) {
        long t0 = now_ns();
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&P.gen, memory_order_acquire)) == seen && !atomic_load(&P.stop)) {
            CPU_RELAX();
            if (++spins % 256 == 0 && now_ns() - t0 > SPIN_NS) {
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
        if (ith < P.n) P.fn(P.ctx, ith, P.n);
        atomic_fetch_sub_explicit(&P.pending, 1, memory_order_release);
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

void pool_run(pool_fn fn, void *ctx) {
    pthread_mutex_lock(&run_mu);
    if (P.n <= 1) {
        fn(ctx, 0, 1);
        pthread_mutex_unlock(&run_mu);
        return;
    }
    P.fn = fn;
    P.ctx = ctx;
    atomic_store(&P.bar_count, 0);
    atomic_store(&P.pending, P.n - 1);
    atomic_fetch_add(&P.gen, 1); /* seq_cst: ordered before the sleepers check */
    if (atomic_load(&P.sleepers) > 0) {
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.cv);
        pthread_mutex_unlock(&P.mu);
    }
    fn(ctx, 0, P.n);
    int spins = 0;
    while (atomic_load_explicit(&P.pending, memory_order_acquire) > 0) {
        CPU_RELAX();
        if (++spins > 4096) sched_yield(); /* a descheduled worker: give it the core */
    }
    pthread_mutex_unlock(&run_mu);
}

void pool_barrier(int nth) {
    if (nth <= 1) return;
    unsigned g = atomic_load_explicit(&P.bar_gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&P.bar_count, 1, memory_order_acq_rel) == nth - 1) {
        atomic_store(&P.bar_count, 0);
        atomic_fetch_add_explicit(&P.bar_gen, 1, memory_order_release);
        return;
    }
    int spins = 0;
    while (atomic_load_explicit(&P.bar_gen, memory_order_acquire) == g) {
        CPU_RELAX();
        if (++spins > 4096) sched_yield();
    }
}
