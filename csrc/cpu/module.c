/* s2moe._cpu: the CPython face of the CPU kernels.
 *
 * Arrays arrive through the buffer protocol (no NumPy headers at build time); every size is checked
 * against the buffers before the GIL is released, so a wrong call raises ValueError instead of
 * reading out of bounds. The GIL is released while a kernel runs: expert fetches on other Python
 * threads (pread releases it too) overlap with compute.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "aio.h"
#include "pybuf.h"
#include "dot.h"
#include "kquant.h"
#include "ops.h"
#include "pool.h"
#include "quant.h"
#include "predict.h"
#include "pass.h"
#include "step.h"

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    PyObject *wo, *xo, *yo, *bo = Py_None;
    int type;
    long N, K;
    if (!PyArg_ParseTuple(args, "OillOO|O", &wo, &type, &N, &K, &xo, &yo, &bo)) return NULL;
    Py_buffer w, x, y, b = {0};
    if (get_buf(wo, &w, 'B', 0, "weights") < 0) return NULL;
    if (get_buf(xo, &x, 'f', 0, "x") < 0) goto fail_w;
    if (get_buf(yo, &y, 'f', 1, "out") < 0) goto fail_x;
    if (bo != Py_None && get_buf(bo, &b, 'f', 0, "bias") < 0) goto fail_y;
    long T = K > 0 ? (long)(x.len / 4 / K) : 0;
    if (check_weights(&w, type, N, K, "weights") < 0 || K <= 0 || check_len(&x, (Py_ssize_t)T * K * 4, "x") < 0 ||
        check_len(&y, (Py_ssize_t)T * N * 4, "out") < 0 || (b.buf && check_len(&b, N * 4, "bias") < 0))
        goto fail_b;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = op_matmul(type, w.buf, N, K, x.buf, (int)T, y.buf, b.buf);
    Py_END_ALLOW_THREADS if (rc == -2) {
        PyErr_NoMemory();
        goto fail_b;
    }
    if (b.buf) PyBuffer_Release(&b);
    PyBuffer_Release(&y);
    PyBuffer_Release(&x);
    PyBuffer_Release(&w);
    Py_RETURN_NONE;
fail_b:
    if (b.buf) PyBuffer_Release(&b);
fail_y:
    PyBuffer_Release(&y);
fail_x:
    PyBuffer_Release(&x);
fail_w:
    PyBuffer_Release(&w);
    return NULL;
}

static PyObject *py_dequant_rows(PyObject *self, PyObject *args) {
    PyObject *wo, *io, *oo;
    int type;
    long N, K;
    if (!PyArg_ParseTuple(args, "OillOO", &wo, &type, &N, &K, &io, &oo)) return NULL;
    Py_buffer w, ids, out;
    if (get_buf(wo, &w, 'B', 0, "weights") < 0) return NULL;
    if (get_buf(io, &ids, 'q', 0, "ids") < 0) {
        PyBuffer_Release(&w);
        return NULL;
    }
    if (get_buf(oo, &out, 'f', 1, "out") < 0) {
        PyBuffer_Release(&ids);
        PyBuffer_Release(&w);
        return NULL;
    }
    long n = (long)(ids.len / 8);
    int rc = -4;
    if (check_weights(&w, type, N, K, "weights") == 0 && check_len(&out, (Py_ssize_t)n * K * 4, "out") == 0) {
        Py_BEGIN_ALLOW_THREADS rc = op_dequant_rows(type, w.buf, N, K, ids.buf, n, out.buf);
        Py_END_ALLOW_THREADS if (rc == -3) PyErr_SetString(PyExc_IndexError, "row id outside the matrix");
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&w);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

/* experts: a sequence of (gate, up, down, gtype, utype, dtype, gate_bias, up_bias, down_bias, tok, weight) */
#define EX_BUFS 8
static PyObject *py_moe(PyObject *self, PyObject *args) {
    PyObject *seq, *xo, *oo;
    long I, H;
    int act = 0;
    float alpha = 1.702f, limit = 7.0f;
    if (!PyArg_ParseTuple(args, "OllOO|iff", &seq, &I, &H, &xo, &oo, &act, &alpha, &limit)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "experts must be a sequence");
    if (!fast) return NULL;
    Py_ssize_t n_ex = PySequence_Fast_GET_SIZE(fast);
    moe_expert *ex = calloc((size_t)n_ex + 1, sizeof(moe_expert));
    Py_buffer *views = calloc((size_t)n_ex * EX_BUFS + 1, sizeof(Py_buffer));
    Py_buffer x = {0}, out = {0};
    PyObject *result = NULL;
    if (!ex || !views) {
        PyErr_NoMemory();
        goto done;
    }
    if (get_buf(xo, &x, 'f', 0, "x") < 0) goto done;
    if (get_buf(oo, &out, 'f', 1, "out") < 0) goto done;
    if (H <= 0 || I <= 0 || x.len % (H * 4) || check_len(&out, x.len, "out") < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "x: not a whole number of rows of H floats");
        goto done;
    }
    long T = (long)(x.len / 4 / H);
    for (Py_ssize_t e = 0; e < n_ex; e++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, e), *o[EX_BUFS];
        moe_expert *m = &ex[e];
        if (!PyArg_ParseTuple(item, "OOOiiiOOOOO", &o[0], &o[1], &o[2], &m->gtype, &m->utype, &m->dtype, &o[3],
                              &o[4], &o[5], &o[6], &o[7]))
            goto done;
        Py_buffer *v = views + e * EX_BUFS;
        static const char kinds[EX_BUFS] = {'B', 'B', 'B', 'f', 'f', 'f', 'i', 'f'};
        static const char *names[EX_BUFS] = {"gate", "up", "down", "gate_bias", "up_bias", "down_bias", "tok",
                                             "weight"};
        for (int i = 0; i < EX_BUFS; i++)
            if (o[i] != Py_None && get_buf(o[i], &v[i], kinds[i], 0, names[i]) < 0) goto done;
        if (!v[0].buf || !v[1].buf || !v[2].buf || !v[6].buf || !v[7].buf) {
            PyErr_SetString(PyExc_ValueError, "expert: gate, up, down, tok and weight are required");
            goto done;
        }
        m->n = (int)(v[6].len / 4);
        if (check_weights(&v[0], m->gtype, I, H, "gate") < 0 || check_weights(&v[1], m->utype, I, H, "up") < 0 ||
            check_weights(&v[2], m->dtype, H, I, "down") < 0 || check_len(&v[7], (Py_ssize_t)m->n * 4, "weight") < 0 ||
            (v[3].buf && check_len(&v[3], I * 4, "gate_bias") < 0) ||
            (v[4].buf && check_len(&v[4], I * 4, "up_bias") < 0) ||
            (v[5].buf && check_len(&v[5], H * 4, "down_bias") < 0))
            goto done;
        m->gate = v[0].buf, m->up = v[1].buf, m->down = v[2].buf;
        m->gate_bias = v[3].buf, m->up_bias = v[4].buf, m->down_bias = v[5].buf;
        m->tok = v[6].buf, m->weight = v[7].buf;
        for (int j = 0; j < m->n; j++)
            if (m->tok[j] < 0 || m->tok[j] >= T) {
                PyErr_Format(PyExc_IndexError, "expert %zd: token row %d outside 0..%ld", e, m->tok[j], T - 1);
                goto done;
            }
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = op_moe(ex, (int)n_ex, I, H, x.buf, out.buf, act, alpha, limit);
    Py_END_ALLOW_THREADS if (rc == -2) PyErr_NoMemory();
    else if (rc) PyErr_SetString(PyExc_ValueError, "expert widths do not fill whole blocks");
    else {
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    if (views)
        for (Py_ssize_t i = 0; i < n_ex * EX_BUFS; i++)
            if (views[i].obj) PyBuffer_Release(&views[i]);
    if (x.obj) PyBuffer_Release(&x);
    if (out.obj) PyBuffer_Release(&out);
    free(views);
    free(ex);
    Py_DECREF(fast);
    return result;
}

/* attend(q, k, v, kcache, vcache, cos, sin, allowed, sinks|None, out, nh, nkv, D, start, scale, rope, interleave) */
static PyObject *py_attend(PyObject *self, PyObject *args) {
    PyObject *o[10];
    long nh, nkv, D, start;
    float scale;
    int rope, interleave;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOllllfpp", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8],
                          &o[9], &nh, &nkv, &D, &start, &scale, &rope, &interleave))
        return NULL;
    static const char kinds[10] = {'f', 'f', 'f', 'f', 'f', 'f', 'f', 'B', 'f', 'f'};
    static const int writable[10] = {0, 0, 0, 1, 1, 0, 0, 0, 0, 1};
    static const char *names[10] = {"q", "k", "v", "kcache", "vcache", "cos", "sin", "allowed", "sinks", "out"};
    Py_buffer b[10];
    memset(b, 0, sizeof(b));
    PyObject *result = NULL;
    int kt = -1, vt = -1;
    for (int i = 0; i < 10; i++) {
        if (i == 3 || i == 4) {
            if (get_kv_buf(o[i], &b[i], names[i], i == 3 ? &kt : &vt) < 0) goto done;
        } else if (o[i] != Py_None && get_buf(o[i], &b[i], kinds[i], writable[i], names[i]) < 0)
            goto done;
    }
    if (nh <= 0 || nkv <= 0 || D <= 0 || D % 2 || nh % nkv || start < 0 || !b[0].buf) {
        PyErr_SetString(PyExc_ValueError, "attend: bad head counts or head width");
        goto done;
    }
    long T = (long)(b[0].len / 4 / (nh * D)), cap = 0, S = start + T;
    if (check_kv(&b[3], &b[4], kt, vt, nkv, D, &cap) < 0) goto done;
    if (T <= 0 || b[0].len != (Py_ssize_t)T * nh * D * 4 || check_len(&b[1], (Py_ssize_t)T * nkv * D * 4, "k") < 0 ||
        check_len(&b[2], (Py_ssize_t)T * nkv * D * 4, "v") < 0 || S > cap ||
        check_len(&b[5], (Py_ssize_t)T * (D / 2) * 4, "cos") < 0 || check_len(&b[6], b[5].len, "sin") < 0 ||
        check_len(&b[7], (Py_ssize_t)T * S, "allowed") < 0 || (b[8].buf && check_len(&b[8], nh * 4, "sinks") < 0) ||
        check_len(&b[9], b[0].len, "out") < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "attend: sizes do not match");
        goto done;
    }
    attn_args a = {b[0].buf, b[1].buf, b[2].buf, b[3].buf, b[4].buf, b[5].buf, b[6].buf, b[7].buf,
                   b[8].buf, b[9].buf, T, nh, nkv, D, cap, start, scale, rope, interleave, kt};
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = op_attend(&a);
    Py_END_ALLOW_THREADS if (rc) PyErr_NoMemory();
    else {
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    for (int i = 0; i < 10; i++)
        if (b[i].obj) PyBuffer_Release(&b[i]);
    return result;
}

/* attn_block(h, norm, eps, qkv, qkv_type, qkv_bias|None, o, o_type, o_bias|None, qk_norm, q_norm|None,
 *            k_norm|None, kcache, vcache, cos, sin, allowed, sinks|None, out, nh, nkv, D, start, scale,
 *            interleave): out = h + the layer's attention block (ops.h op_attn_block) */
static PyObject *py_attn_block(PyObject *self, PyObject *args) {
    enum { H_, NORM, QKV, QKVB, O, OB, QN, KN, KC, VC, COS, SIN, ALLOWED, SINKS, OUT, NB };
    PyObject *o[NB];
    float eps, scale;
    int qkv_type, o_type, qk_norm, interleave;
    long nh, nkv, D, start;
    if (!PyArg_ParseTuple(args, "OOfOiOOiOiOOOOOOOOOllllfp", &o[H_], &o[NORM], &eps, &o[QKV], &qkv_type, &o[QKVB],
                          &o[O], &o_type, &o[OB], &qk_norm, &o[QN], &o[KN], &o[KC], &o[VC], &o[COS], &o[SIN],
                          &o[ALLOWED], &o[SINKS], &o[OUT], &nh, &nkv, &D, &start, &scale, &interleave))
        return NULL;
    static const char kinds[NB] = {'f', 'f', 'B', 'f', 'B', 'f', 'f', 'f', 'f', 'f', 'f', 'f', 'B', 'f', 'f'};
    static const char *names[NB] = {"h", "norm", "qkv", "qkv_bias", "o", "o_bias", "q_norm", "k_norm", "kcache",
                                    "vcache", "cos", "sin", "allowed", "sinks", "out"};
    Py_buffer b[NB];
    memset(b, 0, sizeof(b));
    PyObject *result = NULL;
    int kt = -1, vt = -1;
    for (int i = 0; i < NB; i++) {
        if (i == KC || i == VC) {
            if (get_kv_buf(o[i], &b[i], names[i], i == KC ? &kt : &vt) < 0) goto done;
        } else if (o[i] != Py_None && get_buf(o[i], &b[i], kinds[i], i == OUT, names[i]) < 0)
            goto done;
    }
    if (nh <= 0 || nkv <= 0 || D <= 0 || D % 2 || nh % nkv || start < 0 || qk_norm < 0 || qk_norm > 2 ||
        !b[H_].buf || !b[NORM].buf || !b[QKV].buf || !b[O].buf || !b[KC].buf || !b[VC].buf || !b[OUT].buf ||
        (qk_norm && (!b[QN].buf || !b[KN].buf))) {
        PyErr_SetString(PyExc_ValueError, "attn_block: bad head counts, head width or missing arrays");
        goto done;
    }
    long H = (long)(b[NORM].len / 4), T = H > 0 ? (long)(b[H_].len / 4 / H) : 0, nq = nh * D, N = nq + 2 * nkv * D;
    long cap = 0, S = start + T;
    if (check_kv(&b[KC], &b[VC], kt, vt, nkv, D, &cap) < 0) goto done;
    long qn = qk_norm == 1 ? nq : D, kn = qk_norm == 1 ? nkv * D : D;
    if (T <= 0 || b[H_].len != (Py_ssize_t)T * H * 4 || check_weights(&b[QKV], qkv_type, N, H, "qkv") < 0 ||
        check_weights(&b[O], o_type, H, nq, "o") < 0 || (b[QKVB].buf && check_len(&b[QKVB], N * 4, "qkv_bias") < 0) ||
        (b[OB].buf && check_len(&b[OB], H * 4, "o_bias") < 0) ||
        (qk_norm && (check_len(&b[QN], qn * 4, "q_norm") < 0 || check_len(&b[KN], kn * 4, "k_norm") < 0)) ||
        S > cap ||
        check_len(&b[COS], (Py_ssize_t)T * (D / 2) * 4, "cos") < 0 || check_len(&b[SIN], b[COS].len, "sin") < 0 ||
        check_len(&b[ALLOWED], (Py_ssize_t)T * S, "allowed") < 0 ||
        (b[SINKS].buf && check_len(&b[SINKS], nh * 4, "sinks") < 0) || check_len(&b[OUT], b[H_].len, "out") < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "attn_block: sizes do not match");
        goto done;
    }
    attn_block_args a = {b[H_].buf, b[NORM].buf, eps, qkv_type, o_type, b[QKV].buf, b[O].buf, b[QKVB].buf,
                         b[OB].buf, qk_norm, b[QN].buf, b[KN].buf, b[OUT].buf, T, H, nh, nkv, D,
                         {NULL, NULL, NULL, b[KC].buf, b[VC].buf, b[COS].buf, b[SIN].buf, b[ALLOWED].buf,
                          b[SINKS].buf, NULL, T, nh, nkv, D, cap, start, scale, 1, interleave, kt}};
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = op_attn_block(&a);
    Py_END_ALLOW_THREADS if (rc == -2) PyErr_NoMemory();
    else if (rc) PyErr_SetString(PyExc_ValueError, "attn_block: a weight type cannot hold these rows");
    else {
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    for (int i = 0; i < NB; i++)
        if (b[i].obj) PyBuffer_Release(&b[i]);
    return result;
}

/* route(logits, select, k, kind, norm, scale, experts int64 [T, k], weights [T, k]) */
static PyObject *py_route(PyObject *self, PyObject *args) {
    PyObject *o[4];
    int k, kind, norm;
    float scale;
    if (!PyArg_ParseTuple(args, "OOiipfOO", &o[0], &o[1], &k, &kind, &norm, &scale, &o[2], &o[3])) return NULL;
    static const char kinds[4] = {'f', 'f', 'q', 'f'};
    static const char *names[4] = {"logits", "select", "experts", "weights"};
    Py_buffer b[4];
    memset(b, 0, sizeof(b));
    PyObject *result = NULL;
    for (int i = 0; i < 4; i++)
        if (get_buf(o[i], &b[i], kinds[i], i >= 2, names[i]) < 0) goto done;
    long T = b[2].len / 8 / (k > 0 ? k : 1), E = T > 0 ? (long)(b[0].len / 4 / T) : 0;
    if (k <= 0 || T <= 0 || E < k || b[2].len != (Py_ssize_t)T * k * 8 || b[0].len != (Py_ssize_t)T * E * 4 ||
        check_len(&b[1], b[0].len, "select") < 0 || check_len(&b[3], (Py_ssize_t)T * k * 4, "weights") < 0 ||
        (kind != 0 && kind != 1)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "route: sizes or kind do not match");
        goto done;
    }
    int rc = op_route(b[0].buf, b[1].buf, T, E, k, kind, norm, scale, b[2].buf, b[3].buf); /* tiny: keeps the GIL */
    if (rc == -3) PyErr_SetString(PyExc_ValueError, "route: NaN in the selection scores");
    else if (rc) PyErr_SetString(PyExc_ValueError, "route: k outside 1..64");
    else {
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    for (int i = 0; i < 4; i++)
        if (b[i].obj) PyBuffer_Release(&b[i]);
    return result;
}

static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    PyObject *xo, *wo, *oo;
    float eps;
    if (!PyArg_ParseTuple(args, "OOfO", &xo, &wo, &eps, &oo)) return NULL;
    Py_buffer x, w, out;
    if (get_buf(xo, &x, 'f', 0, "x") < 0) return NULL;
    if (get_buf(wo, &w, 'f', 0, "weight") < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    if (get_buf(oo, &out, 'f', 1, "out") < 0) {
        PyBuffer_Release(&w);
        PyBuffer_Release(&x);
        return NULL;
    }
    long n = (long)(w.len / 4), rows = n > 0 ? (long)(x.len / 4 / n) : 0;
    int ok = n > 0 && x.len == (Py_ssize_t)rows * n * 4 && check_len(&out, x.len, "out") == 0;
    if (ok) op_rms_norm(x.buf, w.buf, rows, n, eps, out.buf); /* tiny: no GIL release */
    else if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "x: not a whole number of rows of len(weight)");
    PyBuffer_Release(&out);
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_set_threads(PyObject *self, PyObject *args) {
    int n;
    if (!PyArg_ParseTuple(args, "i", &n)) return NULL;
    int got;
    Py_BEGIN_ALLOW_THREADS got = pool_set_threads(n);
    Py_END_ALLOW_THREADS return PyLong_FromLong(got);
}

static PyObject *py_threads(PyObject *self, PyObject *noargs) { return PyLong_FromLong(pool_threads()); }

static PyObject *py_pool_spin_us(PyObject *self, PyObject *args) {
    long us = -1;
    if (!PyArg_ParseTuple(args, "|l", &us)) return NULL;
    if (us >= 0) pool_spin_ns = us * 1000L;
    return PyLong_FromLong(pool_spin_ns / 1000L);
}

static PyObject *py_pool_min_work(PyObject *self, PyObject *args) {
    long n = -1;
    if (!PyArg_ParseTuple(args, "|l", &n)) return NULL;
    if (n >= 0) pool_min_work = n;
    return PyLong_FromLong(pool_min_work);
}

static PyObject *py_hold_workers(PyObject *self, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    pool_hold_workers(on);
    Py_RETURN_NONE;
}

static PyObject *py_use_simd(PyObject *self, PyObject *args) {
    int want;
    if (!PyArg_ParseTuple(args, "p", &want)) return NULL;
    return PyBool_FromLong(dot_use_simd(want));
}

static PyObject *py_use_vnni(PyObject *self, PyObject *args) {
    (void)self;
    int want;
    if (!PyArg_ParseTuple(args, "i", &want)) return NULL;
    return PyLong_FromLong(dot_use_vnni(want));
}

static PyObject *py_use_avx512(PyObject *self, PyObject *args) {
    (void)self;
    int want = -1;
    if (!PyArg_ParseTuple(args, "|i", &want)) return NULL;
    return PyBool_FromLong(dot_use_avx512(want < 0 ? -1 : want != 0));
}

static PyObject *py_use_amx(PyObject *self, PyObject *args) {
    (void)self;
    int want = -1, min = -1;
    if (!PyArg_ParseTuple(args, "|ii", &want, &min)) return NULL;
    if (min > 0) kq_amx_min = min;
    return PyBool_FromLong(kq_use_amx(want < 0 ? -1 : want != 0));
}

static PyObject *py_rows4(PyObject *self, PyObject *args) {
    (void)self;
    int on = -1;
    if (!PyArg_ParseTuple(args, "|i", &on)) return NULL;
    return PyBool_FromLong(dot_rows4(on < 0 ? -1 : on != 0));
}

static PyObject *py_act_q8(PyObject *self, PyObject *args) {
    int on = -1;
    if (!PyArg_ParseTuple(args, "|i", &on)) return NULL;
    return PyBool_FromLong(dot_act_q8(on < 0 ? -1 : on != 0));
}

static PyObject *py_act_once(PyObject *self, PyObject *args) {
    int on = -1;
    if (!PyArg_ParseTuple(args, "|i", &on)) return NULL;
    return PyBool_FromLong(op_act_once(on < 0 ? -1 : on != 0));
}

static PyObject *py_moe_balance(PyObject *self, PyObject *args) {
    int on = -1;
    if (!PyArg_ParseTuple(args, "|i", &on)) return NULL;
    return PyBool_FromLong(op_moe_balance(on < 0 ? -1 : on != 0));
}

static PyObject *py_path(PyObject *self, PyObject *noargs) { return PyUnicode_FromString(dot_path()); }

static PyObject *py_row_bytes(PyObject *self, PyObject *args) {
    int type;
    long K;
    if (!PyArg_ParseTuple(args, "il", &type, &K)) return NULL;
    return PyLong_FromSize_t(row_bytes(type, K));
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS, "matmul(W, type, N, K, x, out, bias=None): out[T,N] = x[T,K] @ W.T (+bias)"},
    {"dequant_rows", py_dequant_rows, METH_VARARGS, "dequant_rows(W, type, N, K, ids int64, out): out = W[ids]"},
    {"moe", py_moe, METH_VARARGS, "moe(experts, I, H, x, out, act=0, alpha=1.702, limit=7): one layer's experts"},
    {"attend", py_attend, METH_VARARGS, "attend(q, k, v, kcache, vcache, cos, sin, allowed, sinks, out, nh, nkv, D, start, scale, rope, interleave)"},
    {"attn_block", py_attn_block, METH_VARARGS, "attn_block(h, norm, eps, qkv, qkv_type, qkv_bias, o, o_type, o_bias, qk_norm, q_norm, k_norm, kcache, vcache, cos, sin, allowed, sinks, out, nh, nkv, D, start, scale, interleave)"},
    {"route", py_route, METH_VARARGS, "route(logits, select, k, kind, norm, scale, experts, weights): top-k and mixture weights"},
    {"rms_norm", py_rms_norm, METH_VARARGS, "rms_norm(x, w, eps, out): RMSNorm over rows of len(w)"},
    {"set_threads", py_set_threads, METH_VARARGS, "set_threads(n) -> threads in use (the caller included)"},
    {"threads", py_threads, METH_NOARGS, "threads in use"},
    {"pool_spin_us", py_pool_spin_us, METH_VARARGS, "pool_spin_us([us]) -> how long a worker polls for the next job before sleeping"},
    {"pool_min_work", py_pool_min_work, METH_VARARGS, "pool_min_work([n]) -> multiply-adds below which a job runs on the caller"},
    {"hold_workers", py_hold_workers, METH_VARARGS, "hold_workers(on): tests; workers wait before joining a job while on"},
    {"use_simd", py_use_simd, METH_VARARGS, "use_simd(want) -> whether the SIMD path is used"},
    {"use_vnni", py_use_vnni, METH_VARARGS, "use_vnni(want: 0 off, 1 best, 2 AVX-512 only) -> the int8 rows' VNNI products: 0 none, 1 AVX-VNNI, 2 AVX-512 VNNI (same bits)"},
    {"use_amx", py_use_amx, METH_VARARGS, "use_amx([want[, min_tokens]]) -> whether a batch of at least min_tokens (16) takes AMX tiles on the K-quants (same bits; on where the CPU and OS allow)"},
    {"use_avx512", py_use_avx512, METH_VARARGS, "use_avx512([want]) -> whether plain rows (F32, F16, BF16) take AVX-512 (the default where the CPU has it)"},
    {"rows4", py_rows4, METH_VARARGS, "rows4([on]) -> whether one token takes plain rows four at a time (the default; the same bits)"},
    {"act_q8", py_act_q8, METH_VARARGS, "act_q8([on]) -> whether Q8_0 / Q4_0 rows meet int8 activations (the default)"},
    {"act_once", py_act_once, METH_VARARGS, "act_once([on]) -> whether matmul and moe quantise int8 activations once per call (the default) or per pool chunk"},
    {"moe_balance", py_moe_balance, METH_VARARGS, "moe_balance([on]) -> whether moe splits gate/up rows by their tokens (the default) or evenly"},
    {"path", py_path, METH_NOARGS, "the code path in use: portable, or avx2+fma+f16c with +avx512 (plain rows) and a VNNI form"},
    {"row_bytes", py_row_bytes, METH_VARARGS, "row_bytes(type, K): bytes of one stored row (0: not whole blocks)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu", "s2moe CPU kernels on stored weight blocks", -1,
                                    methods};

PyMODINIT_FUNC PyInit__cpu(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (aio_register(m) < 0 || step_register(m) < 0 || predict_register(m) < 0 || pass_register(m) < 0 ||
              PyModule_AddIntConstant(m, "vnni_built", dot_vnni_built()) < 0 ||
              PyModule_AddIntConstant(m, "amx_built", kq_amx_built()) < 0))
        Py_CLEAR(m);
    return m;
}
