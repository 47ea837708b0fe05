/* A small persistent thread pool for the CPU kernels.
 *
 * One job at a time: the caller publishes fn/ctx, bumps a generation counter and works as thread 0;
 * workers spin briefly on the counter (kernel calls come every 50-500 us during a pass, and waking a
 * sleeping thread costs tens of us), then sleep on a condition variable. Phases inside a job
 * synchronise with pool_barrier().
 */
#ifndef S2MOE_POOL_H
#define S2MOE_POOL_H

typedef void (*pool_fn)(void *ctx, int ith, int nth);

/* Start (or resize to) n threads in all, the caller included; n <= 1 runs jobs inline. */
int pool_set_threads(int n);
int pool_threads(void);
/* Run fn(ctx, i, n) for i in 0..n-1, the caller as i = 0; returns when all are done. */
void pool_run(pool_fn fn, void *ctx);
/* Inside a job: wait until every thread of the job reaches this point. */
void pool_barrier(int nth);

#endif
