/* s2moe._cpu.ae_predict: a draft token's two expert predictions in one call (decoding/speculative.py
 * `_predictions`): the experts verification would route it to (what the draft prefetches), and the
 * same under reuse-aware gating given the batch's experts so far (what AE prices).
 *
 * The NumPy path took about 40 array calls on [layers, E] rows, 130 µs of a 900 µs draft pass on the
 * embedded model (docs/performance/s2moe-targets.md). Each step below is the NumPy path's arithmetic
 * in the same order, in doubles, so both give the same experts (tests/test_ae_predict.py). */
#include "pybuf.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dot.h"
#include "predict.h"
#include "simd.h"

#define MAX_E 4096

/* a ranks above b: higher, NaN last (as a stable argsort of -x puts it) */
static inline int above(double a, double b) { return a > b || (isnan(b) && !isnan(a)); }

/* the k best of x[0..n), highest first, ties to the lower index (routing.py `top_k_indices`) */
static void top_k(const double *x, int n, int k, long long *out, unsigned char *taken) {
    memset(taken, 0, (size_t)n);
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n; e++)
            if (!taken[e] && (best < 0 || above(x[e], x[best]))) best = e;
        taken[best] = 1;
        out[j] = best;
    }
}

static int descending(const void *pa, const void *pb) {
    double a = *(const double *)pa, b = *(const double *)pb;
    return above(a, b) ? -1 : above(b, a) ? 1 : 0;
}

/* (layer, expert) pairs of each row's k picks, into a new set */
static PyObject *as_set(PyObject *layers, const long long *picks, int L, int k) {
    PyObject *set = PySet_New(NULL);
    for (int r = 0; set && r < L; r++)
        for (int j = 0; set && j < k; j++) {
            PyObject *e = PyLong_FromLongLong(picks[(size_t)r * k + j]);
            PyObject *key = e ? PyTuple_Pack(2, PyList_GET_ITEM(layers, r), e) : NULL;
            Py_XDECREF(e);
            if (!key || PySet_Add(set, key) < 0) Py_CLEAR(set);
            Py_XDECREF(key);
        }
    return set;
}

/* the batch's (layer, expert) pairs as a [L, E] mask, rows in `layers` order; other layers left out */
static int batch_mask(PyObject *batch, const long *ids, int L, int E, unsigned char *fav) {
    memset(fav, 0, (size_t)L * E);
    PyObject *it = PyObject_GetIter(batch), *item;
    if (!it) return -1;
    while ((item = PyIter_Next(it))) {
        long layer = -1, e = -1;
        int ok = PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2;
        if (ok) layer = PyLong_AsLong(PyTuple_GET_ITEM(item, 0));
        if (ok && !PyErr_Occurred()) e = PyLong_AsLong(PyTuple_GET_ITEM(item, 1));
        Py_DECREF(item);
        int mine = 0; /* a key of another layer is left out, whatever its expert (as the NumPy path does) */
        for (int r = 0; r < L; r++) mine |= ids[r] == layer;
        if (!ok || PyErr_Occurred() || (mine && (e < 0 || e >= E))) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "ae_predict: the batch holds a key that is not (layer, expert)");
            Py_DECREF(it);
            return -1;
        }
        for (int r = 0; r < L; r++)
            if (ids[r] == layer) fav[(size_t)r * E + e] = 1;
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

/* ae_predict(rows, layers, E, k, batch, strength, avail, rho, size) -> (plain, gated), or None where a
 * row is not a C-contiguous float32 buffer of at least E values: rows a list of float32 router-logit
 * arrays, one per entry of `layers` (a list of layer ids), each read from its first E values. plain: each row's top-k as a set of (layer, expert); gated (None
 * when batch is None): the top-k of each row raised by strength × (top-1 − (k+1)-th) where the batch
 * (a set of (layer, expert)) holds the expert, or where avail (uint8 [L, E], or None) marks it and
 * it is in the top `size` of the row scaled to [0, 1] plus rho where available ("resident" reuse
 * gating's E*). */
static PyObject *py_ae_predict(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *rows, *layers, *batch, *o_avail;
    int E, k, size;
    double strength, rho;
    if (!PyArg_ParseTuple(args, "O!O!iiOdOdi", &PyList_Type, &rows, &PyList_Type, &layers, &E, &k, &batch, &strength,
                          &o_avail, &rho, &size))
        return NULL;
    const int L = (int)PyList_GET_SIZE(rows);
    if (L < 1 || L > MAX_E || PyList_GET_SIZE(layers) != L || E < 1 || E > MAX_E || k < 1 || k > E ||
        (o_avail != Py_None && (size < 1 || size > E))) {
        PyErr_SetString(PyExc_ValueError, "ae_predict: one row per layer; E, k or size out of range");
        return NULL;
    }
    PyObject *result = NULL, *plain_set = NULL, *gated_set = NULL;
    Py_buffer va = {0};
    double *x = NULL;
    long long *picks = NULL;
    unsigned char *fav = NULL;
    long ids[MAX_E];
    for (int r = 0; r < L; r++) {
        ids[r] = PyLong_AsLong(PyList_GET_ITEM(layers, r));
        if (ids[r] == -1 && PyErr_Occurred()) return NULL;
    }
    if (o_avail != Py_None && (get_buf(o_avail, &va, 'B', 0, "avail") < 0 || check_len(&va, (Py_ssize_t)L * E, "avail") < 0))
        goto done;
    x = malloc(sizeof(double) * 4 * (size_t)E + (size_t)(2 * E));
    picks = malloc(sizeof(long long) * ((size_t)2 * L * k + (size_t)E));
    fav = batch != Py_None ? malloc((size_t)L * E) : NULL;
    if (!x || !picks || (batch != Py_None && !fav)) {
        PyErr_NoMemory();
        goto done;
    }
    if (fav && batch_mask(batch, ids, L, E, fav) < 0) goto done;
    double *s = x + E, *g = x + 2 * E, *y = x + 3 * E;
    unsigned char *taken = (unsigned char *)(x + 4 * E), *star = taken + E;
    const unsigned char *avail = va.buf;
    long long *plain = picks, *gated = picks + (size_t)L * k, *pick = picks + (size_t)2 * L * k;
    for (int r = 0; r < L; r++) {
        Py_buffer v = {0};
        if (get_buf(PyList_GET_ITEM(rows, r), &v, 'f', 0, "rows") < 0 || v.len < (Py_ssize_t)E * 4) {
            if (v.obj) PyBuffer_Release(&v);
            PyErr_Clear(); /* not a C-contiguous float32 row of E values: the NumPy path decides */
            Py_INCREF(Py_None);
            result = Py_None;
            goto done;
        }
        const float *row = v.buf;
        for (int e = 0; e < E; e++) x[e] = (double)row[e];
        PyBuffer_Release(&v);
        top_k(x, E, k, plain + (size_t)r * k, taken);
        if (!fav) continue;
        memcpy(s, x, sizeof(double) * (size_t)E);
        qsort(s, (size_t)E, sizeof(double), descending);
        memset(star, 0, (size_t)E);
        if (avail) { /* E*: (x − low) / spread + ρ·avail, its top `size`, where available */
            const unsigned char *a = avail + (size_t)r * E;
            double low = s[E - 1], spread = s[0] - low, div = spread > 0 ? spread : 1.0;
            for (int e = 0; e < E; e++) g[e] = (x[e] - low) / div + rho * (a[e] ? 1.0 : 0.0);
            top_k(g, E, size, pick, taken);
            for (int j = 0; j < size; j++) star[pick[j]] = a[pick[j]] != 0;
        }
        double add = strength * (s[0] - s[k < E - 1 ? k : E - 1]);
        const unsigned char *f = fav + (size_t)r * E;
        for (int e = 0; e < E; e++) y[e] = x[e] + add * ((f[e] || star[e]) ? 1.0 : 0.0);
        top_k(y, E, k, gated + (size_t)r * k, taken);
    }
    plain_set = as_set(layers, plain, L, k);
    if (!plain_set) goto done;
    if (fav) {
        gated_set = as_set(layers, gated, L, k);
        if (!gated_set) goto done;
    } else {
        Py_INCREF(Py_None);
        gated_set = Py_None;
    }
    result = PyTuple_Pack(2, plain_set, gated_set);
done:
    Py_XDECREF(plain_set);
    Py_XDECREF(gated_set);
    free(x);
    free(picks);
    free(fav);
    if (va.obj) PyBuffer_Release(&va);
    return result;
}

/* reuse_bias(logits, w, k, size, strength, rho, avail, out) -> bool: reuse-aware gating's bias for one
 * layer of a verification batch (decoding/gating.py `ReuseGating.bias`, variants "paper" and
 * "resident"), the NumPy path's arithmetic in its order and types: g = Σ_b w_b·ℓ_b in doubles, row by
 * row; E* the top `size` of g (scaled to [0, 1] plus rho where avail, uint8 [E], marks an expert, when
 * avail is given); λ_b = float32(strength) × (ℓ_b,(1) − ℓ_b,(k+1)) in float32. Writes out [B, E]
 * float32 (λ_b on E*'s columns, else 0) and returns True; False where NumPy returns None (no w_b > 0,
 * no λ_b > 0). In the verification of a 5-token batch this replaced about 15 NumPy calls a layer,
 * 12 % of a verification's time on the embedded model. */
static PyObject *py_reuse_bias(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_logits, *o_w, *o_avail, *o_out;
    int k, size;
    double strength, rho;
    if (!PyArg_ParseTuple(args, "OOiiddOO", &o_logits, &o_w, &k, &size, &strength, &rho, &o_avail, &o_out))
        return NULL;
    Py_buffer vl = {0}, vw = {0}, va = {0}, vo = {0};
    PyObject *result = NULL;
    double *g = NULL;
    if (get_buf(o_logits, &vl, 'f', 0, "logits") < 0 || get_buf(o_w, &vw, 'd', 0, "w") < 0 ||
        get_buf(o_out, &vo, 'f', 1, "out") < 0)
        goto done;
    const Py_ssize_t B = vw.len / 8;
    const Py_ssize_t E = B > 0 ? vl.len / 4 / B : 0;
    if (B < 1 || E < 1 || E > MAX_E || vl.len != B * E * 4 || k < 1 || k >= E || size < 1 || size > E) {
        PyErr_SetString(PyExc_ValueError, "reuse_bias: logits [B, E] float32 with w [B]; 1 <= k < E; 1 <= size <= E");
        goto done;
    }
    if (check_len(&vo, B * E * 4, "out") < 0) goto done;
    if (o_avail != Py_None && (get_buf(o_avail, &va, 'B', 0, "avail") < 0 || check_len(&va, E, "avail") < 0)) goto done;
    const float *lg = vl.buf;
    const double *w = vw.buf;
    float *out = vo.buf;
    int any = 0;
    for (Py_ssize_t b = 0; b < B; b++) any |= w[b] > 0;
    if (!any) {
        result = Py_False;
        goto done;
    }
    g = malloc(sizeof(double) * (size_t)E + sizeof(long long) * (size_t)(E + k + 1) + sizeof(float) * (size_t)B + (size_t)E);
    if (!g) {
        PyErr_NoMemory();
        goto done;
    }
    long long *star = (long long *)(g + E), *kth = star + E;
    float *lam = (float *)(kth + k + 1);
    unsigned char *taken = (unsigned char *)(lam + B);
    for (Py_ssize_t e = 0; e < E; e++) g[e] = w[0] * (double)lg[e];
    for (Py_ssize_t b = 1; b < B; b++)
        for (Py_ssize_t e = 0; e < E; e++) g[e] += w[b] * (double)lg[b * E + e];
    if (va.obj) { /* "resident": (g − min) / spread + ρ·avail (NumPy's max and min: NaN wins) */
        const unsigned char *a = va.buf;
        double low = g[0], high = g[0];
        for (Py_ssize_t e = 1; e < E; e++) {
            if (isnan(low) || isnan(g[e])) low = high = NAN;
            else {
                low = g[e] < low ? g[e] : low;
                high = g[e] > high ? g[e] : high;
            }
        }
        double spread = high - low, div = spread > 0 ? spread : 1.0;
        for (Py_ssize_t e = 0; e < E; e++) g[e] = (g[e] - low) / div + rho * (a[e] ? 1.0 : 0.0);
    }
    top_k(g, (int)E, size, star, taken);
    const float sf = (float)strength; /* NumPy casts the Python float to the array's float32 */
    any = 0;
    for (Py_ssize_t b = 0; b < B; b++) { /* the row's top-1 and (k+1)-th, NaN last, as -sort(-x) orders it */
        const float *row = lg + b * E;
        for (Py_ssize_t e = 0; e < E; e++) g[e] = (double)row[e];
        top_k(g, (int)E, k + 1, kth, taken);
        const float d = row[kth[0]] - row[kth[k]];
        lam[b] = sf * d;
        any |= lam[b] > 0;
    }
    if (!any) {
        result = Py_False;
        goto done;
    }
    memset(out, 0, (size_t)(B * E) * 4);
    for (Py_ssize_t b = 0; b < B; b++)
        for (int j = 0; j < size; j++) out[b * E + star[j]] = lam[b];
    result = Py_True;
done:
    free(g);
    if (vl.obj) PyBuffer_Release(&vl);
    if (vw.obj) PyBuffer_Release(&vw);
    if (va.obj) PyBuffer_Release(&va);
    if (vo.obj) PyBuffer_Release(&vo);
    Py_XINCREF(result);
    return result;
}

/* greedy_pick(logits) -> (token, p): a greedy draft token, the first maximum of float32 logits [V] (a
 * NaN, the first one, as NumPy's argmax), and its softmax probability 1 / Σ_v exp(x_v − max)
 * (speculative.py `_pick`). NumPy's path allocates and runs five passes over the row, 55–70 µs of a
 * 700 µs draft pass inside runs on the embedded model. This is a pass for the maximum, a scan for
 * its first place and a pass for the sum, whose exps are float32 (AVX2: simd.h `exp_neg8`, relative
 * error about 1e-7) summed in float32 over short runs and in doubles across them, so p matches
 * NumPy's to about 1e-6 (tests/test_greedy_pick.py). p is NaN where NumPy's is: a NaN logit, or a
 * maximum that is ±inf. */
#ifdef HAVE_AVX2_PATH
/* the largest of x[0..V) into *m; 1 if x holds a NaN (then *m is meaningless) */
AVX2 static int max_avx2(const float *x, Py_ssize_t V, float *m) {
    __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    Py_ssize_t v = 0;
    for (; v + 8 <= V; v += 8) {
        __m256 a = _mm256_loadu_ps(x + v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        top = _mm256_max_ps(top, a);
    }
    float lanes[8], best = -INFINITY;
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; i++) best = lanes[i] > best ? lanes[i] : best;
    int has_nan = _mm256_movemask_ps(nan) != 0;
    for (; v < V; v++) {
        has_nan |= isnan(x[v]);
        best = x[v] > best ? x[v] : best;
    }
    *m = best;
    return has_nan;
}

/* Σ exp(x_v − m) for x ≤ m: float32 exps, summed in float32 over 256 values at a time (each lane
 * adds 32), then in doubles */
AVX2 static double exp_sum_avx2(const float *x, Py_ssize_t V, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    double total = 0.0;
    Py_ssize_t v = 0;
    while (v + 16 <= V) {
        __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
        const Py_ssize_t end = v + 256 <= V ? v + 256 : V - (V - v) % 16;
        for (; v < end; v += 16) { /* two chains of additions: one would wait on its own latency */
            a = _mm256_add_ps(a, exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(x + v), vm)));
            b = _mm256_add_ps(b, exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(x + v + 8), vm)));
        }
        __m256 s = _mm256_add_ps(a, b);
        __m256d d = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(s)), _mm256_cvtps_pd(_mm256_extractf128_ps(s, 1)));
        double part[4];
        _mm256_storeu_pd(part, d);
        total += (part[0] + part[1]) + (part[2] + part[3]);
    }
    for (; v < V; v++) total += exp((double)x[v] - (double)m);
    return total;
}

/* the first v with x[v] == m (m is in x) */
AVX2 static Py_ssize_t first_avx2(const float *x, Py_ssize_t V, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    Py_ssize_t v = 0;
    for (; v + 8 <= V; v += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + v), vm, _CMP_EQ_OQ));
        if (hit) return v + __builtin_ctz((unsigned)hit);
    }
    while (x[v] != m) v++;
    return v;
}
#endif

static PyObject *py_greedy_pick(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_logits;
    if (!PyArg_ParseTuple(args, "O", &o_logits)) return NULL;
    Py_buffer vl = {0};
    if (get_buf(o_logits, &vl, 'f', 0, "logits") < 0) return NULL;
    const Py_ssize_t V = vl.len / 4;
    if (V < 1) {
        PyBuffer_Release(&vl);
        PyErr_SetString(PyExc_ValueError, "greedy_pick: logits must hold at least one float32");
        return NULL;
    }
    const float *x = vl.buf;
    const int simd = dot_simd();
    float m = x[0];
    int has_nan = 0;
#ifdef HAVE_AVX2_PATH
    if (simd) has_nan = max_avx2(x, V, &m);
    else
#endif
        for (Py_ssize_t v = 0; v < V; v++) {
            has_nan |= isnan(x[v]);
            m = x[v] > m ? x[v] : m;
        }
    Py_ssize_t best = 0;
    double p = NAN;
    if (has_nan) { /* NumPy's argmax: the first NaN; its p is NaN */
        while (!isnan(x[best])) best++;
    } else {
#ifdef HAVE_AVX2_PATH
        if (simd) best = first_avx2(x, V, m);
        else
#endif
            while (x[best] != m) best++;
        if (isfinite(m)) {
            double total = 0.0;
#ifdef HAVE_AVX2_PATH
            if (simd) total = exp_sum_avx2(x, V, m);
            else
#endif
                for (Py_ssize_t v = 0; v < V; v++) total += exp((double)x[v] - (double)m);
            p = 1.0 / total;
        }
    }
    PyBuffer_Release(&vl);
    return Py_BuildValue("nd", best, p);
}

static PyMethodDef predict_methods[] = {
    {"ae_predict", py_ae_predict, METH_VARARGS,
     "ae_predict(rows, layers, E, k, batch, strength, avail, rho, size) -> (plain, gated): each row's top-k as a "
     "set of (layer, expert), and (batch not None) the top-k under reuse-aware gating; None for rows it cannot read"},
    {"reuse_bias", py_reuse_bias, METH_VARARGS,
     "reuse_bias(logits, w, k, size, strength, rho, avail, out) -> bool: reuse-aware gating's bias for one layer "
     "of a verification batch into out; False where there is none"},
    {"greedy_pick", py_greedy_pick, METH_VARARGS,
     "greedy_pick(logits) -> (token, p): the first maximum of float32 logits and its softmax probability"},
    {NULL, NULL, 0, NULL},
};

int predict_register(PyObject *module) { return PyModule_AddFunctions(module, predict_methods); }
