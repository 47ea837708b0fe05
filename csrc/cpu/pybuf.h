/* Buffer-protocol helpers shared by the extension's Python faces (module.c, step.c): every size is
 * checked against the buffers before a kernel reads them, so a wrong call raises ValueError. */
#ifndef S2MOE_PYBUF_H
#define S2MOE_PYBUF_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "ops.h"
#include "quant.h"

/* A buffer with its element size checked: 'f' float32, 'd' float64, 'i' int32, 'q' int64, 'B' raw bytes. */
static inline int get_buf(PyObject *obj, Py_buffer *view, char kind, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Format(PyExc_ValueError, "%s: needs a C-contiguous%s buffer", what, writable ? " writable" : "");
        return -1;
    }
    if (kind != 'B') {
        const char *f = view->format ? view->format : "B";
        if (*f == '<' || *f == '=' || *f == '@') f++;
        int ok = (kind == 'f' && f[0] == 'f' && view->itemsize == 4) || (kind == 'd' && f[0] == 'd' && view->itemsize == 8) ||
                 (kind == 'i' && (f[0] == 'i' || f[0] == 'l') && view->itemsize == 4) ||
                 (kind == 'q' && (f[0] == 'q' || f[0] == 'l') && view->itemsize == 8);
        if (!ok) {
            PyErr_Format(PyExc_ValueError, "%s: wrong element type (format %s, itemsize %zd)", what,
                         view->format ? view->format : "?", view->itemsize);
            PyBuffer_Release(view);
            return -1;
        }
    }
    return 0;
}

static inline int check_len(Py_buffer *v, Py_ssize_t want, const char *what) {
    if (v->len != want) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", what, v->len, want);
        return -1;
    }
    return 0;
}

static inline int check_weights(Py_buffer *w, int type, long N, long K, const char *what) {
    size_t rb = row_bytes(type, K);
    if (!rb) {
        PyErr_Format(PyExc_ValueError, "%s: type %d cannot hold rows of %ld values", what, type, K);
        return -1;
    }
    return check_len(w, (Py_ssize_t)(rb * (size_t)N), what);
}

/* A KV cache buffer, writable: float32 (KV_F32), float16 (KV_F16) or bytes (KV_Q8_0 rows). */
static inline int get_kv_buf(PyObject *obj, Py_buffer *view, const char *what, int *kv_type) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyErr_Format(PyExc_ValueError, "%s: needs a C-contiguous writable buffer", what);
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    *kv_type = f[0] == 'f' && view->itemsize == 4 ? KV_F32 : f[0] == 'e' && view->itemsize == 2 ? KV_F16 :
               f[0] == 'B' && view->itemsize == 1 ? KV_Q8_0 : -1;
    if (*kv_type < 0) {
        PyErr_Format(PyExc_ValueError, "%s: a KV cache is float32, float16 or uint8 (q8_0) (format %s)", what,
                     view->format ? view->format : "?");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The cache's positions (cap) from its length: both caches of one type, whole rows of nkv heads. */
static inline int check_kv(Py_buffer *kc, Py_buffer *vc, int kt, int vt, long nkv, long D, long *cap) {
    const long rb = kv_row_bytes(kt, D);
    if (kt != vt || rb <= 0 || kc->len % ((Py_ssize_t)nkv * rb) || vc->len != kc->len) {
        PyErr_SetString(PyExc_ValueError, "kcache, vcache: not one type, or not [nkv, cap, row] of this head width");
        return -1;
    }
    *cap = (long)(kc->len / ((Py_ssize_t)nkv * rb));
    return 0;
}

#endif
