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

#include "predict.h"

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

/* ae_predict(logits, layers, E, k, out, favoured, strength, avail, rho, size): logits float32
 * [layers, E]; out int64 [2, layers, k]: out[0] the top-k of each row, out[1] (when favoured is not
 * None) the top-k of the row raised by strength × (top-1 − (k+1)-th) where favoured, itself raised
 * where avail (uint8 [layers, E], or None) marks an expert in the top `size` of the row scaled to
 * [0, 1] plus rho where available ("resident" reuse gating's E*). */
static PyObject *py_ae_predict(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_logits, *o_out, *o_fav, *o_avail;
    int L, E, k, size;
    double strength, rho;
    if (!PyArg_ParseTuple(args, "OiiiOOdOdi", &o_logits, &L, &E, &k, &o_out, &o_fav, &strength, &o_avail, &rho, &size))
        return NULL;
    if (L < 1 || E < 1 || E > MAX_E || k < 1 || k > E || (o_avail != Py_None && (size < 1 || size > E))) {
        PyErr_SetString(PyExc_ValueError, "ae_predict: sizes out of range");
        return NULL;
    }
    Py_buffer b[4] = {{0}};
    PyObject *result = NULL;
    double *x = NULL;
    if (get_buf(o_logits, &b[0], 'f', 0, "logits") < 0 || check_len(&b[0], (Py_ssize_t)L * E * 4, "logits") < 0 ||
        get_buf(o_out, &b[1], 'q', 1, "out") < 0 || check_len(&b[1], (Py_ssize_t)2 * L * k * 8, "out") < 0)
        goto done;
    if (o_fav != Py_None && (get_buf(o_fav, &b[2], 'B', 0, "favoured") < 0 || check_len(&b[2], (Py_ssize_t)L * E, "favoured") < 0))
        goto done;
    if (o_avail != Py_None && (get_buf(o_avail, &b[3], 'B', 0, "avail") < 0 || check_len(&b[3], (Py_ssize_t)L * E, "avail") < 0))
        goto done;
    x = malloc(sizeof(double) * 4 * (size_t)E + (size_t)(2 * E));
    if (!x) {
        PyErr_NoMemory();
        goto done;
    }
    double *s = x + E, *g = x + 2 * E, *y = x + 3 * E;
    unsigned char *taken = (unsigned char *)(x + 4 * E), *star = taken + E;
    const float *logits = b[0].buf;
    const unsigned char *fav = b[2].buf, *avail = b[3].buf;
    long long *plain = b[1].buf, *gated = plain + (size_t)L * k;
    long long pick[MAX_E];
    for (int r = 0; r < L; r++) {
        for (int e = 0; e < E; e++) x[e] = (double)logits[(size_t)r * E + e];
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
        for (int e = 0; e < E; e++) y[e] = x[e] + add * ((fav[(size_t)r * E + e] || star[e]) ? 1.0 : 0.0);
        top_k(y, E, k, gated + (size_t)r * k, taken);
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    free(x);
    for (int i = 0; i < 4; i++)
        if (b[i].obj) PyBuffer_Release(&b[i]);
    return result;
}

static PyMethodDef predict_methods[] = {
    {"ae_predict", py_ae_predict, METH_VARARGS,
     "ae_predict(logits, layers, E, k, out, favoured, strength, avail, rho, size) -> None: out[0] each row's top-k, "
     "out[1] (favoured not None) the top-k under reuse-aware gating"},
    {NULL, NULL, 0, NULL},
};

int predict_register(PyObject *module) { return PyModule_AddFunctions(module, predict_methods); }
