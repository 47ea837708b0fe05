/* The K-quants' rows against a prompt's int8 activations on AMX tiles (Sapphire Rapids and later).
 *
 * A prompt is bound by its products, not by memory: on AVX-512 the tiles of kquant_avx2.c ran a
 * 2048 × 2048 Q4_K product at about 105 G int8 products/s on this VM's two cores, where one AMX
 * TDPBSSD (16 × 16 outputs × 64 products) takes ~5 ns: 3 T products/s on a core. The K-quants
 * scale each run of 16 or 32 codes by its own integer, which a tile product cannot: scaling each
 * run's sums afterwards (a first version) left the vector units most of the work, 1.6× the AVX-512
 * tiles on a whole 512-token pass. Here a panel of 16 rows is unpacked once per call into int8
 * planes that carry the scales (panel_unpack), so a super-block is three tile products a step and
 * two float steps per (row, token): S and M are the integers every other path sums, and the float
 * steps are kq_step's, so the bits are every other path's, whatever the batch.
 *
 * The activations are the tiles' first operand as kq_batch_make lays them out (token t's codes at
 * q + t · K, the last tile of 16 padded), so a batch costs no copy. The OS must grant the tile
 * state (Linux 5.16+: arch_prctl ARCH_REQ_XCOMP_PERM); where it does not, or the CPU lacks
 * AMX-INT8, kq_use_amx says 0 and kquant_avx2.c's tiles take the batch. */
#include "kquant.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "dot.h"
#include "kquant_unpack.h"
#include "pool.h"
#include "quant.h"
#include "simd.h"

#ifdef HAVE_AMX_PATH
#include <sys/syscall.h>
#include <unistd.h>

#define AMX __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,amx-tile,amx-int8")))
#define INLINE_AMX static inline __attribute__((always_inline, target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,amx-tile,amx-int8")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_ok;       /* the CPU has AMX-INT8 and the OS granted its state */
static int want_amx = 1; /* `_cpu.use_amx` */
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void amx_probe(void) {
    __builtin_cpu_init();
    unsigned a, b, c, d;
    __asm__ __volatile__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 24) & 1) || !((d >> 25) & 1) || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl"))
        return;
    amx_ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
#endif

int kq_amx_built(void) {
#ifdef HAVE_AMX_PATH
    return 1;
#else
    return 0;
#endif
}

int kq_use_amx(int want) {
#ifdef HAVE_AMX_PATH
    pthread_once(&amx_once, amx_probe);
    if (want >= 0) want_amx = want != 0;
    return want_amx && amx_ok && dot_simd() && dot_use_avx512(-1);
#else
    (void)want;
    return 0;
#endif
}

/* Batches of fewer tokens keep kquant_avx2.c's tiles: a panel's unpack is paid whatever the batch,
 * and at 4-8 tokens AMX gave 0.6-0.9× of them. Settable for benchmarks and tests
 * (`_cpu.use_amx(1, n)`). */
int kq_amx_min = 16;

int kq_amx_type(int type) {
    return type == T_Q2_K || type == T_Q3_K || type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}

#ifdef HAVE_AMX_PATH
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* A panel's rows unpacked: three planes of int8 in the tiles' second-operand layout, each
 * [U][64 groups of 4 codes][16 rows][4]: a weight's integer value w = scale · code in two base-128
 * digits (w = 128 · hi + lo, lo in 0..127), and the Σ q factor of its run less a power of two,
 * mn = mv >> sh (Q6_K 32 · sc, Q3_K 4 · sc, else the min). Then per super-block and token
 *     S = A·lo + 128 · A·hi = Σ scale · Σ code · q,   M = 2^sh · A·mn = Σ mv · Σ q,
 * exact, with no product left for the vector units but the float steps. The float multipliers
 * are [U][16 rows]. */
typedef struct {
    uint8_t *planes;
    float *dsum, *dq;
} amx_panel;

#define AMX_AHEAD 2
#define PLANE(p, k, U, u) ((p)->planes + ((size_t)(k) * (size_t)(U) + (size_t)(u)) * 4096)

/* Eight rows of eight dwords → eight columns (in place). */
INLINE_AMX void transpose8(__m256i *r) {
    __m256i t[8], v[8];
    for (int k = 0; k < 8; k += 2) {
        t[k] = _mm256_unpacklo_epi32(r[k], r[k + 1]);
        t[k + 1] = _mm256_unpackhi_epi32(r[k], r[k + 1]);
    }
    for (int k = 0; k < 8; k += 4) {
        v[k] = _mm256_unpacklo_epi64(t[k], t[k + 2]);
        v[k + 1] = _mm256_unpackhi_epi64(t[k], t[k + 2]);
        v[k + 2] = _mm256_unpacklo_epi64(t[k + 1], t[k + 3]);
        v[k + 3] = _mm256_unpackhi_epi64(t[k + 1], t[k + 3]);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm256_permute2x128_si256(v[j], v[j + 4], 0x20);
        r[j + 4] = _mm256_permute2x128_si256(v[j], v[j + 4], 0x31);
    }
}

/* 16 rows × 8 dwords (rows[i] + 8 · col0) → out[j], the 16 rows' dword j side by side. */
INLINE_AMX void columns16(int32_t (*rows)[64], int col0, __m512i *out) {
    __m256i lo[8], hi[8];
    for (int k = 0; k < 8; k++) {
        lo[k] = _mm256_load_si256((const __m256i *)(rows[k] + col0));
        hi[k] = _mm256_load_si256((const __m256i *)(rows[8 + k] + col0));
    }
    transpose8(lo);
    transpose8(hi);
    for (int j = 0; j < 8; j++) _mm512_store_si512(out + j, _mm512_inserti64x4(_mm512_castsi256_si512(lo[j]), hi[j], 1));
}

INLINE_AMX void panel_unpack(const int TYPE, const uint8_t *W, size_t rb, long U, long r, int nr, amx_panel *p) {
    const int bb = block_bytes(TYPE), sh = TYPE == T_Q6_K ? 5 : TYPE == T_Q3_K ? 2 : 0;
    int32_t lo[16][64] __attribute__((aligned(64))), hi[16][64] __attribute__((aligned(64)));
    int32_t mn[16][64] __attribute__((aligned(64))); /* a row's 16 runs' mn, four times over in a dword */
    for (long u = 0; u < U; u++) {
        for (int i = 0; i < 16; i++) {
            __m256i c[8], sv[8], mv;
            float dsum = 0.0f, dq = 0.0f;
            if (i < nr) {
                const uint8_t *blk = W + (size_t)(r + i) * rb + (size_t)bb * u;
                /* 16 rows are 16 streams: ask for each one's super-block AMX_AHEAD on (a prompt's
                 * expert rows come from memory once) */
                for (int o = 0; o < bb; o += 64) _mm_prefetch((const char *)blk + (size_t)bb * AMX_AHEAD + o, _MM_HINT_T0);
                super_block(TYPE, blk, c, sv, &mv, &dsum, &dq);
            } else { /* a row past the range: zeros (its outputs are not written) */
                for (int g = 0; g < 8; g++) c[g] = sv[g] = _mm256_setzero_si256();
                mv = _mm256_setzero_si256();
            }
            for (int g = 0; g < 8; g++) { /* sv's lane 0 scales codes 0-15 of the 32, lane 8 codes 16-31 */
                const __m256i s0 = _mm256_broadcastw_epi16(_mm256_castsi256_si128(sv[g])),
                              s1 = _mm256_broadcastw_epi16(_mm256_extracti128_si256(sv[g], 1));
                const __m512i w = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(c[g]), _mm512_inserti64x4(_mm512_castsi256_si512(s0), s1, 1));
                _mm256_store_si256((__m256i *)(lo[i] + 8 * g), _mm512_cvtepi16_epi8(_mm512_and_si512(w, _mm512_set1_epi16(127))));
                _mm256_store_si256((__m256i *)(hi[i] + 8 * g), _mm512_cvtepi16_epi8(_mm512_srai_epi16(w, 7)));
            }
            const __m512i m = _mm512_cvtepi16_epi32(_mm256_srai_epi16(mv, sh)); /* exact: mv is a multiple of 2^sh */
            _mm512_store_si512(mn[i], _mm512_mullo_epi32(_mm512_and_si512(m, _mm512_set1_epi32(0xFF)), _mm512_set1_epi32(0x01010101)));
            p->dsum[u * 16 + i] = dsum;
            p->dq[u * 16 + i] = dq;
        }
        __m512i *plo = (__m512i *)PLANE(p, 0, U, u), *phi = (__m512i *)PLANE(p, 1, U, u), *pmn = (__m512i *)PLANE(p, 2, U, u);
        for (int g = 0; g < 8; g++) {
            columns16(lo, 8 * g, plo + 8 * g);
            columns16(hi, 8 * g, phi + 8 * g);
        }
        __m512i runs[16]; /* run j's mn for the 16 rows: its four groups of four codes */
        columns16(mn, 0, runs);
        columns16(mn, 8, runs + 8);
        for (int j = 0; j < 16; j++)
            for (int k = 0; k < 4; k++) _mm512_store_si512(pmn + 4 * j + k, runs[j]);
    }
}

/* Super-block u's three sums for 16 tokens (A: their codes, K apart): C[plane][token][row]. Tiles
 * 0-2 the sums, 3 and 7 the activations, 4-6 the planes. */
INLINE_AMX void planes_product(const int8_t *A, long K, const amx_panel *p, long U, long u, int32_t (*C)[256]) {
    const uint8_t *lo = PLANE(p, 0, U, u), *hi = PLANE(p, 1, U, u), *mn = PLANE(p, 2, U, u);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int c = 0; c < 4; c += 2) { /* 64 codes a step */
        _tile_loadd(3, A + 64 * c, K);
        _tile_loadd(4, lo + 1024 * c, 64);
        _tile_dpbssd(0, 3, 4);
        _tile_loadd(5, hi + 1024 * c, 64);
        _tile_dpbssd(1, 3, 5);
        _tile_loadd(6, mn + 1024 * c, 64);
        _tile_dpbssd(2, 3, 6);
        _tile_loadd(7, A + 64 * (c + 1), K);
        _tile_loadd(4, lo + 1024 * (c + 1), 64);
        _tile_dpbssd(0, 7, 4);
        _tile_loadd(5, hi + 1024 * (c + 1), 64);
        _tile_dpbssd(1, 7, 5);
        _tile_loadd(6, mn + 1024 * (c + 1), 64);
        _tile_dpbssd(2, 7, 6);
    }
    _tile_stored(0, C[0], 64);
    _tile_stored(1, C[1], 64);
    _tile_stored(2, C[2], 64);
}

/* Super-block u's float steps for 16 tokens (from t0), each a vector of the panel's 16 rows. */
INLINE_AMX void planes_steps(int sh, const amx_panel *p, long U, long u, const kq_batch *b, int t0, int32_t (*C)[256],
                             __m512 *acc) {
    const __m512 ds = _mm512_loadu_ps(p->dsum + u * 16), dq = _mm512_loadu_ps(p->dq + u * 16);
    const float *d = b->d + (size_t)t0 * U + u; /* token t's scales at b->d + t · U (kq_batch_make) */
    for (int t = 0; t < 16; t++) {
        const __m512i S = _mm512_add_epi32(_mm512_load_si512(C[0] + 16 * t), _mm512_slli_epi32(_mm512_load_si512(C[1] + 16 * t), 7));
        const __m512i M = _mm512_sll_epi32(_mm512_load_si512(C[2] + 16 * t), _mm_cvtsi32_si128(sh));
        const __m512 dx = _mm512_set1_ps(d[(size_t)t * U]);
        const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), _mm512_mul_ps(ds, dx), acc[t]);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(M), _mm512_mul_ps(dq, dx), v);
    }
}

INLINE_AMX void amx_rows(const int TYPE, const uint8_t *W, size_t rb, long K, long r0, long r1, const kq_batch *b,
                         float *const *ys) {
    const long U = K / 256;
    const int ntt = (b->nb + 15) / 16, sh = TYPE == T_Q6_K ? 5 : TYPE == T_Q3_K ? 2 : 0;
    uint8_t *scratch = arena_get(ARENA_AMX, (size_t)U * (3 * 4096 + 2 * 16 * sizeof(float)) + (size_t)ntt * 1024 + 64);
    if (!scratch) return; /* (callers check inputs; out of memory leaves y unchanged, as kq_batch_make) */
    amx_panel p;
    p.planes = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    __m512 *acc = (__m512 *)(p.planes + (size_t)U * 3 * 4096); /* [token tile][16 tokens] */
    p.dsum = (float *)(acc + (size_t)ntt * 16);
    p.dq = p.dsum + U * 16;
    tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    int32_t C[2][3][256] __attribute__((aligned(64))); /* two super-blocks: one in the tiles, one in steps */
    for (long r = r0; r < r1; r += 16) {
        const int nr = r1 - r < 16 ? (int)(r1 - r) : 16;
        const __mmask16 rows = (__mmask16)((1u << nr) - 1);
        panel_unpack(TYPE, W, rb, U, r, nr, &p);
        for (int t = 0; t < 16 * ntt; t++) acc[t] = _mm512_setzero_ps();
        /* super-block by super-block, so that its planes (12 KB) stay in L1 for every token tile; the
         * next tile's products run beside this one's steps */
        for (long u = 0; u < U; u++) {
            const int8_t *A = b->q + 256 * u; /* token t's codes at A + t · K (padded past nb) */
            planes_product(A, K, &p, U, u, C[0]);
            for (int tt = 0; tt < ntt; tt++) {
                if (tt + 1 < ntt) planes_product(A + (size_t)16 * (tt + 1) * K, K, &p, U, u, C[(tt + 1) & 1]);
                planes_steps(sh, &p, U, u, b, 16 * tt, C[tt & 1], acc + 16 * tt);
            }
        }
        for (int t = 0; t < b->nb; t++) _mm512_mask_storeu_ps(ys[t] + r, rows, acc[t]);
    }
    _tile_release();
}


AMX int kq_rows_amx(int type, const uint8_t *W, size_t rb, long K, long r0, long r1, const kq_batch *b,
                    float *const *ys) {
    if (!b->amx || K % 256 || !kq_amx_type(type) || !kq_use_amx(-1)) return 0;
    switch (type) {
    case T_Q2_K: amx_rows(T_Q2_K, W, rb, K, r0, r1, b, ys); break;
    case T_Q3_K: amx_rows(T_Q3_K, W, rb, K, r0, r1, b, ys); break;
    case T_Q4_K: amx_rows(T_Q4_K, W, rb, K, r0, r1, b, ys); break;
    case T_Q5_K: amx_rows(T_Q5_K, W, rb, K, r0, r1, b, ys); break;
    case T_Q6_K: amx_rows(T_Q6_K, W, rb, K, r0, r1, b, ys); break;
    }
    return 1;
}
#else
int kq_rows_amx(int type, const uint8_t *W, size_t rb, long K, long r0, long r1, const kq_batch *b,
                float *const *ys) {
    (void)type, (void)W, (void)rb, (void)K, (void)r0, (void)r1, (void)b, (void)ys;
    return 0;
}
#endif
