/* A small persistent thread pool for the CPU kernels.
 *
 * One job at a time. A job is a number of chunks; the caller publishes it, bumps a generation
 * counter and takes chunks itself. Workers that are awake join the job and take chunks too, until
 * none are left. Nobody waits for a worker that has not joined: a worker asleep when the job starts
 * (waking one costs ~300 us on a VM, more than a whole small kernel call) simply finds it done.
 * Workers spin briefly for the next job (the gaps between kernel calls inside a pass), then sleep
 * on a condition variable.
 */
#ifndef S2MOE_POOL_H
#define S2MOE_POOL_H

#include <stddef.h>

/* Process chunk i of n (callers split their rows with the same span() as a static split would). */
typedef void (*pool_fn)(void *ctx, int i, int n);

/* Start (or resize to) n threads in all, the caller included; n <= 1 runs jobs inline. */
int pool_set_threads(int n);
int pool_threads(void);
/* The chunks a job of the pool's width is cut into: enough for a late worker to take a share. */
int pool_chunks(void);
/* Run fn(ctx, i, n) once for every i in 0..n-1, on the caller and on any worker that joins;
 * returns when all are done and no worker touches ctx any more. */
void pool_run(pool_fn fn, void *ctx, int n);
/* Below this many multiply-adds a job runs on the calling thread: handing it over costs more than
 * it saves (routers, a tiny test model's products). With workers that sleep 50 us after a job, a
 * threshold of 512K (the embedded model's decode experts inline) was best; with workers awake through
 * a pass (SPIN_NS_DEFAULT in pool.c) 64K is (docs/performance/kernels.md, "Reads off the GIL").
 * Settable (`_cpu.pool_min_work`) for benchmarks and tests. */
#define POOL_MIN_WORK_DEFAULT (64L * 1024L)
extern long pool_min_work;
/* How long a worker polls for the next job before sleeping, in ns (see pool.c). */
extern long pool_spin_ns;
#define POOL_MIN_WORK pool_min_work

/* Chunk ith of nth of n items: [*a, *b). */
static inline void pool_span(long n, int ith, int nth, long *a, long *b) {
    *a = n * ith / nth;
    *b = n * (ith + 1) / nth;
}

/* Scratch of the calling thread kept between calls, at least `bytes` (NULL: out of memory). A
 * prompt's layer calls asked malloc for tens of MB each; with glibc's mmap threshold fixed at
 * 128 KiB (offload/memory.py) every one was a fresh mapping whose pages faulted in again, 1.4-3.4 s
 * of system time in an 8 s pass at OLMoE-1B-7B's shape. It never shrinks: a thread keeps its
 * largest pass's scratch, which the memory plan's workspace counts. One slot per caller that may
 * nest in another: ARENA_MOE (op_moe), ARENA_BLOCK (op_attn_block), ARENA_ATTEND (op_attend), ARENA_AMX (a
 * panel of kquant_amx.c's rows). */
enum { ARENA_MOE, ARENA_BLOCK, ARENA_ATTEND, ARENA_AMX, ARENA_SLOTS };
void *arena_get(int slot, size_t bytes);

/* Tests: while on, workers wait before joining a job, as if the OS had not woken them yet. */
void pool_hold_workers(int on);

#endif
