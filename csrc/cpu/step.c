/* s2moe._cpu.moe_step: one decode token's MoE layer in one call (runtime/kernels/cpu.py `moe_step`,
 * called by model/forward.py `_moe`): routing, the restriction of a draft to allowed experts and,
 * when every chosen expert is in the layer's resident table, those experts and their sum.
 *
 * A decode layer took about ten Python steps around four kernel calls, and half of an
 * embedded-model pass was that Python (docs/performance/kernels.md). Each step here gives the bits
 * of the step-by-step path (tests/test_decode_step.py). */
#include "pybuf.h"

#include <string.h>

#include "ops.h"
#include "step.h"

enum { X, LOGITS, ALLOWED, EXPERTS, WEIGHTS, TOTAL, NB };
enum { GATE, UP, DOWN, GB, UB, DB };

/* (step.h) */
int parse_expert(PyObject *item, moe_expert *m, Py_buffer *v, long H, long *I) {
    PyObject *o[EX_BUFS];
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 9 ||
        !PyArg_ParseTuple(item, "OOOiiiOOO", &o[GATE], &o[UP], &o[DOWN], &m->gtype, &m->utype, &m->dtype, &o[GB],
                          &o[UB], &o[DB])) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "moe_step: a table entry is not an expert's tuple");
        return -1;
    }
    static const char *names[EX_BUFS] = {"gate", "up", "down", "gate_bias", "up_bias", "down_bias"};
    for (int i = 0; i < EX_BUFS; i++)
        if ((i < GB || o[i] != Py_None) && get_buf(o[i], &v[i], i < GB ? 'B' : 'f', 0, names[i]) < 0) return -1;
    size_t rb = row_bytes(m->gtype, H);
    long rows = rb ? (long)(v[GATE].len / (Py_ssize_t)rb) : 0;
    if (rows <= 0 || (*I && rows != *I)) {
        PyErr_SetString(PyExc_ValueError, "moe_step: an expert's gate rows do not match the layer's");
        return -1;
    }
    *I = rows;
    if (check_weights(&v[GATE], m->gtype, rows, H, "gate") < 0 || check_weights(&v[UP], m->utype, rows, H, "up") < 0 ||
        check_weights(&v[DOWN], m->dtype, H, rows, "down") < 0 ||
        (v[GB].buf && check_len(&v[GB], rows * 4, "gate_bias") < 0) ||
        (v[UB].buf && check_len(&v[UB], rows * 4, "up_bias") < 0) ||
        (v[DB].buf && check_len(&v[DB], H * 4, "down_bias") < 0))
        return -1;
    m->gate = v[GATE].buf, m->up = v[UP].buf, m->down = v[DOWN].buf;
    m->gate_bias = v[GB].buf, m->up_bias = v[UB].buf, m->down_bias = v[DB].buf;
    return 0;
}

/* (step.h) */
int moe_token_step(const float *scores, long E, int k, int kind, int norm, float scale, const uint8_t *allowed,
                   int best, PyObject *table, long H, const float *x, int act, float alpha, float limit,
                   int64_t *experts, float *weights, float *total) {
    if (op_route(scores, scores, 1, E, k, kind, norm, scale, experts, weights) == -3) return 2;
    if (allowed) op_restrict(scores, E, k, allowed, best, experts, weights);
    Py_buffer views[MAX_K * EX_BUFS];
    moe_expert chosen[MAX_K];
    memset(views, 0, sizeof(Py_buffer) * (size_t)(k * EX_BUFS)); /* only k choices' worth is used */
    memset(chosen, 0, sizeof(moe_expert) * (size_t)k);
    int status = -1;
    long I = 0;
    for (int j = 0; j < k; j++) {
        if (experts[j] < 0) continue;
        PyObject *item = PyList_GET_ITEM(table, experts[j]);
        if (item == Py_None) { /* not resident: the caller streams the layer */
            status = 1;
            goto done;
        }
        if (parse_expert(item, &chosen[j], views + j * EX_BUFS, H, &I) < 0) goto done;
        chosen[j].weight = &weights[j];
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = op_moe_token(chosen, k, I, H, x, total, act, alpha, limit);
    Py_END_ALLOW_THREADS if (rc == -2) PyErr_NoMemory();
    else if (rc) PyErr_SetString(PyExc_ValueError, "moe step: expert widths do not fill whole blocks");
    else status = 0;
done:
    for (int i = 0; i < k * EX_BUFS; i++)
        if (views[i].obj) PyBuffer_Release(&views[i]);
    return status;
}

/* moe_step(x [H], logits [E], k, kind, norm, scale, allowed [E] bool | None, best, table (E entries:
 *          an expert's tuple or None), act, alpha, limit, experts int64 [k], weights [k], total [H])
 * -> 0: total written; 1: a chosen expert is not in the table (experts and weights written, total
 * not: the caller streams it); 2: a NaN among the scores (nothing meaningful written) */
static PyObject *py_moe_step(PyObject *self, PyObject *args) {
    PyObject *o[NB], *table;
    int k, kind, norm, best, act;
    float scale, alpha, limit;
    if (!PyArg_ParseTuple(args, "OOiipfOpOiffOOO", &o[X], &o[LOGITS], &k, &kind, &norm, &scale, &o[ALLOWED], &best,
                          &table, &act, &alpha, &limit, &o[EXPERTS], &o[WEIGHTS], &o[TOTAL]))
        return NULL;
    if (k <= 0 || k > MAX_K) {
        PyErr_SetString(PyExc_ValueError, "moe_step: k outside 1..64");
        return NULL;
    }
    static const char kinds[NB] = {'f', 'f', 'B', 'q', 'f', 'f'};
    static const char *names[NB] = {"x", "logits", "allowed", "experts", "weights", "total"};
    Py_buffer b[NB];
    memset(b, 0, sizeof(b));
    PyObject *result = NULL;
    for (int i = 0; i < NB; i++)
        if ((i != ALLOWED || o[i] != Py_None) && get_buf(o[i], &b[i], kinds[i], i >= EXPERTS, names[i]) < 0)
            goto done;
    long H = (long)(b[X].len / 4), E = (long)(b[LOGITS].len / 4);
    if (H <= 0 || k > E || (kind != 0 && kind != 1) || !PyList_Check(table) ||
        PyList_GET_SIZE(table) != E || check_len(&b[EXPERTS], (Py_ssize_t)k * 8, "experts") < 0 ||
        check_len(&b[WEIGHTS], (Py_ssize_t)k * 4, "weights") < 0 || check_len(&b[TOTAL], b[X].len, "total") < 0 ||
        (b[ALLOWED].buf && check_len(&b[ALLOWED], E, "allowed") < 0)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "moe_step: sizes, k, kind or the table do not match");
        goto done;
    }
    int rc = moe_token_step(b[LOGITS].buf, E, k, kind, norm, scale, b[ALLOWED].buf, best, table, H, b[X].buf, act,
                            alpha, limit, b[EXPERTS].buf, b[WEIGHTS].buf, b[TOTAL].buf);
    if (rc >= 0) result = PyLong_FromLong(rc);
done:
    for (int i = 0; i < NB; i++)
        if (b[i].obj) PyBuffer_Release(&b[i]);
    return result;
}

static PyMethodDef step_methods[] = {
    {"moe_step", py_moe_step, METH_VARARGS,
     "moe_step(x, logits, k, kind, norm, scale, allowed, best, table, act, alpha, limit, experts, weights, total) "
     "-> 0 computed, 1 a chosen expert not in the table, 2 a NaN score"},
    {NULL, NULL, 0, NULL},
};

int step_register(PyObject *module) { return PyModule_AddFunctions(module, step_methods); }
