// The CPU stand-in's shim for running CUDA source on the host (tests/fake_cupy.py prepends it).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>
struct s2_dim3 { unsigned x, y, z; };
static s2_dim3 threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __shared__ static
namespace emu {
enum { READY, AT_WARP, AT_BLOCK, DONE };
const int SLOTS = 64;  // values one lane adds in one s2_warp_sum
const size_t STACK = 128 << 10;
static std::function<void()> body;
static int cur;
[[noreturn]] static void fail(const char* what) {
    std::fprintf(stderr, "fake_cupy emulation: %s (block %u, thread %d)\n", what, blockIdx.x, cur);
    std::abort();
}
}  // namespace emu
#if defined(__x86_64__)
// A fiber switch: push the callee-saved registers, swap stacks, pop (ucontext's switch makes a
// system call for the signal mask each time: ~50x slower, and decoding runs millions of them).
extern "C" void emu_switch(void** save_sp, void* next_sp);
asm(".text\n.p2align 4\n.globl emu_switch\n.hidden emu_switch\n.type emu_switch,@function\nemu_switch:\n"
    "pushq %rbp\npushq %rbx\npushq %r12\npushq %r13\npushq %r14\npushq %r15\nmovq %rsp, (%rdi)\nmovq %rsi, %rsp\n"
    "popq %r15\npopq %r14\npopq %r13\npopq %r12\npopq %rbx\npopq %rbp\nret\n");
namespace emu {
struct Fiber { void* sp; int state; };
static void* sched;
static std::vector<Fiber> fibers;
static void start();
static void prepare(unsigned t, char* top) {  // the first switch to the fiber "returns" into start()
    void** sp = (void**)(((unsigned long)top & ~15UL) - 64);
    for (int i = 0; i < 6; ++i) sp[i] = nullptr;
    sp[6] = (void*)&start;
    sp[7] = nullptr;
    fibers[t].sp = sp;
}
static inline void resume(unsigned t) { emu_switch(&sched, fibers[t].sp); }
static inline void yield() { emu_switch(&fibers[cur].sp, sched); }
}  // namespace emu
#else
#include <ucontext.h>
namespace emu {
struct Fiber { ucontext_t ctx; int state; };
static ucontext_t sched;
static std::vector<Fiber> fibers;
static void start();
static void prepare(unsigned t, char* top) {
    getcontext(&fibers[t].ctx);
    fibers[t].ctx.uc_stack.ss_sp = top - STACK;
    fibers[t].ctx.uc_stack.ss_size = STACK;
    fibers[t].ctx.uc_link = nullptr;
    makecontext(&fibers[t].ctx, start, 0);
}
static inline void resume(unsigned t) { swapcontext(&sched, &fibers[t].ctx); }
static inline void yield() { swapcontext(&fibers[cur].ctx, &sched); }
}  // namespace emu
#endif
namespace emu {
static std::vector<char> stacks;
static std::vector<float> slots, sums;
static std::vector<int> reads;  // per warp: lanes that have read the current sums
static void start() {
    body();
    fibers[cur].state = DONE;
    yield();  // never resumed
    fail("a finished fiber resumed");
}
static void wait(int kind) {
    fibers[cur].state = kind;
    yield();
}
static void launch(unsigned gx, unsigned bx) {
    gridDim = {gx, 1, 1}; blockDim = {bx, 1, 1};
    fibers.resize(bx);
    if (stacks.size() < bx * STACK) stacks.resize(bx * STACK);
    slots.resize((size_t)bx * SLOTS);
    sums.resize((size_t)bx * SLOTS);
    reads.assign((bx + 31) / 32, 0);
    for (unsigned b = 0; b < gx; ++b) {
        blockIdx = {b, 0, 0};
        for (unsigned t = 0; t < bx; ++t) {
            prepare(t, stacks.data() + (t + 1) * STACK);
            fibers[t].state = READY;
        }
        for (;;) {
            for (unsigned t = 0; t < bx; ++t)
                if (fibers[t].state == READY) {
                    cur = (int)t; threadIdx = {t, 0, 0};
                    resume(t);
                }
            bool live = false, released = false, block = true;
            for (unsigned w = 0; w < bx; w += 32) {  // a warp whose live lanes all wait at its sum goes on
                bool all = true, any = false;
                for (unsigned t = w; t < w + 32 && t < bx; ++t) {
                    int st = fibers[t].state;
                    if (st == DONE) continue;
                    any = true; all &= st == AT_WARP;
                }
                if (any && all)
                    for (unsigned t = w; t < w + 32 && t < bx; ++t)
                        if (fibers[t].state == AT_WARP) fibers[t].state = READY, released = true;
            }
            for (unsigned t = 0; t < bx; ++t) {
                if (fibers[t].state != DONE) live = true;
                if (fibers[t].state != DONE && fibers[t].state != AT_BLOCK) block = false;
            }
            if (!live) break;
            if (block)
                for (unsigned t = 0; t < bx; ++t)
                    if (fibers[t].state == AT_BLOCK) fibers[t].state = READY, released = true;
            if (!released) fail("deadlock: threads wait at barriers that can never open");
        }
    }
}
}  // namespace emu
static inline void __syncthreads() { emu::wait(emu::AT_BLOCK); }
// The butterfly of __shfl_xor_sync (offsets 16, 8, 4, 2, 1) in the order CUDA adds, each lane's
// own result; the warp's first reader computes all 32, the others read theirs.
void s2_warp_sum(float* v, int n) {
    using namespace emu;
    if (n > SLOTS) fail("s2_warp_sum of more values than the stand-in holds");
    if (blockDim.x % 32) fail("s2_warp_sum in a block that is not whole warps");
    int lane = cur % 32, base = cur - lane;
    for (int i = 0; i < n; ++i) slots[(size_t)cur * SLOTS + i] = v[i];
    wait(AT_WARP);
    int& r = reads[base / 32];
    if (r == 0) {
        for (int l = 0; l < 32; ++l)
            if (fibers[base + l].state == DONE) fail("s2_warp_sum with a lane that has returned");
        for (int i = 0; i < n; ++i) {
            float x[32], y[32];
            for (int l = 0; l < 32; ++l) x[l] = slots[(size_t)(base + l) * SLOTS + i];
            for (int off = 16; off > 0; off >>= 1) {
                for (int l = 0; l < 32; ++l) y[l] = x[l] + x[l ^ off];
                for (int l = 0; l < 32; ++l) x[l] = y[l];
            }
            for (int l = 0; l < 32; ++l) sums[(size_t)(base + l) * SLOTS + i] = x[l];
        }
    }
    for (int i = 0; i < n; ++i) v[i] = sums[(size_t)cur * SLOTS + i];
    if (++r == 32) r = 0;
    wait(AT_WARP);  // no lane writes its next values before every lane has read these
}
