/* A probe, not product code: Q8_0 rows against activations quantised to int8 blocks of 32 (as
 * llama.cpp's CPU backend does), beside the float-activation loop the product's kernel uses
 * (csrc/cpu/dot.c), one thread, T = 1. It measures what the change would buy before anyone builds
 * it (docs/performance/kernels.md, "Quantised rows against int8 activations").
 *
 *   gcc -O2 -mavx2 -mfma -mf16c -o /tmp/q8probe benchmarks/probes/q8_activations.c -lm
 *   /tmp/q8probe N K REPS        # e.g. 1024 1024 300; prints best-of-REPS times and the error
 *
 * Its float loop is simpler than the product's (one accumulator chain per half), so compare the
 * int8 time with the product's own kernel at one thread (_cpu.set_threads(1); _cpu.matmul).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
typedef struct { uint16_t d; int8_t q[32]; } __attribute__((packed)) blk;
static float h2f(uint16_t h){ return _cvtsh_ss(h); }
// x -> int8 blocks of 32 with a float scale each
static void quant_x(const float *x, long K, int8_t *q, float *d) {
  for (long g = 0; g < K/32; g++) {
    __m256 v[4], m = _mm256_setzero_ps(); const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i=0;i<4;i++){ v[i]=_mm256_loadu_ps(x+32*g+8*i); m=_mm256_max_ps(m,_mm256_andnot_ps(sign,v[i])); }
    __m128 s=_mm_max_ps(_mm256_castps256_ps128(m),_mm256_extractf128_ps(m,1)); s=_mm_max_ps(s,_mm_movehl_ps(s,s)); s=_mm_max_ss(s,_mm_movehdup_ps(s));
    float amax=_mm_cvtss_f32(s), dd=amax/127.0f, id=dd?1.0f/dd:0.0f; d[g]=dd;
    __m256 vid=_mm256_set1_ps(id); __m256i iv[4];
    for(int i=0;i<4;i++) iv[i]=_mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i],vid),_MM_FROUND_TO_NEAREST_INT|_MM_FROUND_NO_EXC));
    __m256i a=_mm256_packs_epi32(iv[0],iv[1]), b=_mm256_packs_epi32(iv[2],iv[3]); __m256i c=_mm256_packs_epi16(a,b);
    c=_mm256_permutevar8x32_epi32(c,_mm256_setr_epi32(0,4,1,5,2,6,3,7));
    _mm256_storeu_si256((__m256i*)(q+32*g),c);
  }
}
static float hsum(__m256 v){__m128 s=_mm_add_ps(_mm256_castps256_ps128(v),_mm256_extractf128_ps(v,1));s=_mm_add_ps(s,_mm_movehl_ps(s,s));s=_mm_add_ss(s,_mm_movehdup_ps(s));return _mm_cvtss_f32(s);}
static void rows_q8q8(const blk *W, long N, long K, const int8_t *q, const float *d, float *y){
  long G=K/32; const __m256i ones=_mm256_set1_epi16(1);
  for(long r=0;r<N;r++){ const blk *b=W+r*G; __m256 acc=_mm256_setzero_ps();
    for(long g=0;g<G;g++){ __m256i w=_mm256_loadu_si256((const __m256i*)b[g].q), x=_mm256_loadu_si256((const __m256i*)(q+32*g));
      __m256i p=_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w,w),_mm256_sign_epi8(x,w)),ones);
      acc=_mm256_fmadd_ps(_mm256_set1_ps(h2f(b[g].d)*d[g]),_mm256_cvtepi32_ps(p),acc);}
    y[r]=hsum(acc);} }
// the current design: codes to float, float activations
static void rows_q8f(const blk *W, long N, long K, const float *x, float *y){
  long G=K/32;
  for(long r=0;r<N;r++){ const blk *b=W+r*G; __m256 a0=_mm256_setzero_ps(),a1=a0;
    for(long g=0;g<G;g++){ __m256 w[4]; for(int i=0;i<4;i++) w[i]=_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b[g].q+8*i))));
      const float *xx=x+32*g; __m256 lo=_mm256_mul_ps(w[0],_mm256_loadu_ps(xx)),hi=_mm256_mul_ps(w[1],_mm256_loadu_ps(xx+8));
      lo=_mm256_fmadd_ps(w[2],_mm256_loadu_ps(xx+16),lo); hi=_mm256_fmadd_ps(w[3],_mm256_loadu_ps(xx+24),hi);
      __m256 vs=_mm256_set1_ps(h2f(b[g].d)); a0=_mm256_fmadd_ps(vs,lo,a0); a1=_mm256_fmadd_ps(vs,hi,a1);}
    y[r]=hsum(_mm256_add_ps(a0,a1));} }
int main(int argc,char**argv){ long N=atol(argv[1]),K=atol(argv[2]); int reps=atoi(argv[3]);
  blk *W=aligned_alloc(64,((sizeof(blk)*N*K/32+63)/64)*64); float *x=malloc(4*K),*y1=malloc(4*N),*y2=malloc(4*N),*d=malloc(4*K/32); int8_t *q=aligned_alloc(64,K);
  srand(1); for(long i=0;i<N*K/32;i++){W[i].d=_cvtss_sh(0.001f+(rand()%100)*1e-5f,0); for(int j=0;j<32;j++) W[i].q[j]=(int8_t)(rand()%255-127);}
  for(long k=0;k<K;k++) x[k]=(rand()/(float)RAND_MAX-0.5f)*2;
  double bf=1e9,bq=1e9;
  for(int rep=0;rep<reps;rep++){ double t=now(); rows_q8f(W,N,K,x,y1); t=now()-t; if(t<bf)bf=t;
    t=now(); quant_x(x,K,q,d); rows_q8q8(W,N,K,q,d,y2); t=now()-t; if(t<bq)bq=t; }
  double err=0,mx=0; for(long r=0;r<N;r++){err=fmax(err,fabs(y1[r]-y2[r])); mx=fmax(mx,fabs(y1[r]));}
  double bytes=34.0*N*K/32;
  printf("N=%ld K=%ld  float-activation %.1f us (%.1f GB/s)  int8-activation %.1f us (%.1f GB/s)  speedup %.2fx  max|dy|/max|y| %.2e\n",N,K,bf*1e6,bytes/bf/1e9,bq*1e6,bytes/bq/1e9,bf/bq,err/mx);
}
