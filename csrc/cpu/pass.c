/* s2moe._cpu.decode_pass: a decode token's whole pass in one call (model/forward.py `_one_call`): per
 * layer the attention block, the norm, the router product, routing, a draft's restriction to allowed
 * experts and the chosen experts; then the final norm and the head.
 *
 * With a decode layer and the attention block each one call, a draft pass on the embedded model was
 * still about 200 us of Python around 270 us of kernels (docs/performance/kernels.md). Each step
 * here is the kernel the step-by-step path calls, on the same inputs, so both give the same bits
 * (tests/test_decode_pass.py). It stops before a layer whose choices are not all in that layer's
 * resident table, or whose scores hold a NaN: the caller goes on from there, step by step. */
#include "pybuf.h"

#include <stdlib.h>
#include <string.h>

#include "ops.h"
#include "pass.h"
#include "step.h"

/* a layer's buffers, in the order of its tuple (kernels/cpu.py `decode_pass`) */
enum { ANORM, QKV, QKVB, O, OB, QN, KN, SINKS, FNORM, ROUTER, RBIAS, KC, VC, ALLOWED, LB };
static const char lkinds[LB] = {'f', 'B', 'f', 'B', 'f', 'f', 'f', 'f', 'f', 'f', 'f', 'f', 'f', 'B'};
static const char *lnames[LB] = {"attn_norm", "qkv", "qkv_bias", "o", "o_bias", "q_norm", "k_norm", "sinks",
                                 "ffn_norm", "router", "router_bias", "kcache", "vcache", "allowed"};

typedef struct {
    long H, nh, nkv, D, start, E; /* E: the router's rows, the same in every layer */
    int k, interleave, kind, norm, best, act;
    float eps, attn_scale, scale, alpha, limit;
    const float *cos, *sin;
    const uint8_t *vis; /* [start + 1]: which slots the token sees */
    float *att, *x, *total; /* [H] scratch */
} pass_args;

enum { STOPPED = 0, DONE = 1, FAILED = -1 };

/* a layer's buffers checked against the pass's sizes (py_attn_block's checks, at one token) */
static int check_layer(Py_buffer *b, int qkv_type, int o_type, int qk_norm, PyObject *table, const pass_args *p,
                       int kt, int vt, long *cap) {
    const long H = p->H, D = p->D, nq = p->nh * D, N = nq + 2 * p->nkv * D;
    const long qn = qk_norm == 1 ? nq : D, kn = qk_norm == 1 ? p->nkv * D : D;
    if (!b[ANORM].buf || !b[QKV].buf || !b[O].buf || !b[FNORM].buf || !b[ROUTER].buf || !b[KC].buf || !b[VC].buf ||
        qk_norm < 0 || qk_norm > 2 || (qk_norm && (!b[QN].buf || !b[KN].buf)) || !PyList_Check(table) ||
        PyList_GET_SIZE(table) != p->E) {
        PyErr_SetString(PyExc_ValueError, "decode_pass: a layer lacks arrays, or its table is not E entries");
        return -1;
    }
    if (check_len(&b[ANORM], H * 4, "attn_norm") < 0 || check_len(&b[FNORM], H * 4, "ffn_norm") < 0 ||
        check_weights(&b[QKV], qkv_type, N, H, "qkv") < 0 || check_weights(&b[O], o_type, H, nq, "o") < 0 ||
        (b[QKVB].buf && check_len(&b[QKVB], N * 4, "qkv_bias") < 0) ||
        (b[OB].buf && check_len(&b[OB], H * 4, "o_bias") < 0) ||
        (qk_norm && (check_len(&b[QN], qn * 4, "q_norm") < 0 || check_len(&b[KN], kn * 4, "k_norm") < 0)) ||
        (b[SINKS].buf && check_len(&b[SINKS], p->nh * 4, "sinks") < 0) ||
        check_len(&b[ROUTER], p->E * H * 4, "router") < 0 || (b[RBIAS].buf && check_len(&b[RBIAS], p->E * 4, "router_bias") < 0) ||
        (b[ALLOWED].buf && check_len(&b[ALLOWED], p->E, "allowed") < 0) ||
        check_kv(&b[KC], &b[VC], kt, vt, p->nkv, D, cap) < 0)
        return -1;
    if (p->start + 1 > *cap) {
        PyErr_SetString(PyExc_ValueError, "decode_pass: the KV cache has no slot at start, or is not [nkv, cap, D]");
        return -1;
    }
    return 0;
}

/* One layer on h: DONE (h is the layer's output; its scores, experts and weights written), STOPPED
 * before its experts (h as it was: a choice not in the table, or a NaN score), FAILED (exception). */
static int layer(PyObject *item, const pass_args *p, float *h, float *scores, int64_t *experts, float *weights) {
    PyObject *o[LB], *table;
    int qkv_type, o_type, qk_norm;
    if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "OOiOOiOiOOOOOOOOOO", &o[ANORM], &o[QKV], &qkv_type, &o[QKVB],
                                                  &o[O], &o_type, &o[OB], &qk_norm, &o[QN], &o[KN], &o[SINKS],
                                                  &o[FNORM], &o[ROUTER], &o[RBIAS], &o[KC], &o[VC], &table,
                                                  &o[ALLOWED])) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "decode_pass: a layer is not a tuple of its 18 arguments");
        return FAILED;
    }
    Py_buffer b[LB];
    memset(b, 0, sizeof(b));
    int status = FAILED, rc;
    int kt = -1, vt = -1;
    long cap = 0;
    for (int i = 0; i < LB; i++) {
        if (i == KC || i == VC) {
            if (get_kv_buf(o[i], &b[i], lnames[i], i == KC ? &kt : &vt) < 0) goto done;
        } else if (o[i] != Py_None && get_buf(o[i], &b[i], lkinds[i], 0, lnames[i]) < 0)
            goto done;
    }
    if (check_layer(b, qkv_type, o_type, qk_norm, table, p, kt, vt, &cap) < 0) goto done;
    const long H = p->H;
    attn_block_args a = {h, b[ANORM].buf, p->eps, qkv_type, o_type, b[QKV].buf, b[O].buf, b[QKVB].buf, b[OB].buf,
                         qk_norm, b[QN].buf, b[KN].buf, p->att, 1, H, p->nh, p->nkv, p->D,
                         {NULL, NULL, NULL, b[KC].buf, b[VC].buf, p->cos, p->sin, p->vis, b[SINKS].buf, NULL, 1, p->nh,
                          p->nkv, p->D, cap, p->start, p->attn_scale, 1, p->interleave, kt}};
    Py_BEGIN_ALLOW_THREADS rc = op_attn_block(&a);
    if (!rc) {
        op_rms_norm(p->att, b[FNORM].buf, 1, H, p->eps, p->x);
        op_router(b[ROUTER].buf, p->E, H, p->x, b[RBIAS].buf, scores);
    }
    Py_END_ALLOW_THREADS if (rc == -2) PyErr_NoMemory();
    else if (rc) PyErr_SetString(PyExc_ValueError, "decode_pass: a weight type cannot hold these rows");
    if (rc) goto done;
    /* the MoE layer as moe_step computes it; a choice not resident or a NaN score: the caller goes on */
    rc = moe_token_step(scores, p->E, p->k, p->kind, p->norm, p->scale, b[ALLOWED].buf, p->best, table, H, p->x,
                        p->act, p->alpha, p->limit, experts, weights, p->total);
    if (rc == 1 || rc == 2) status = STOPPED;
    if (rc != 0) goto done;
    for (long i = 0; i < H; i++) h[i] = p->att[i] + p->total[i]; /* forward.py: h + the experts */
    status = DONE;
done:
    for (int i = 0; i < LB; i++)
        if (b[i].obj) PyBuffer_Release(&b[i]);
    return status;
}

/* decode_pass(h [H], layers (a list of layer tuples), cos, sin [D/2], vis bool [start + 1], start, eps, nh,
 *             nkv, D, attn_scale, interleave, k, kind, norm, scale, best, act, alpha, limit, final_norm [H],
 *             head, head_type, logits [V], scores [layers, E], experts int64 [layers, k], weights [layers, k])
 * -> the layers done. All of them: h is the last layer's output and logits the head's. Fewer: h is
 * the input of the layer it stopped before, and the rows of the layers done are written. */
static PyObject *py_decode_pass(PyObject *self, PyObject *args) {
    enum { H_, COS, SIN, VIS, FN, HEAD, LOGITS, SCORES, EXPERTS, WEIGHTS, NB };
    PyObject *o[NB], *layers;
    pass_args p;
    memset(&p, 0, sizeof(p));
    int head_type;
    if (!PyArg_ParseTuple(args, "OOOOOlflllfpiipfpiffOOiOOOO", &o[H_], &layers, &o[COS], &o[SIN], &o[VIS], &p.start,
                          &p.eps, &p.nh, &p.nkv, &p.D, &p.attn_scale, &p.interleave, &p.k, &p.kind, &p.norm, &p.scale,
                          &p.best, &p.act, &p.alpha, &p.limit, &o[FN], &o[HEAD], &head_type, &o[LOGITS], &o[SCORES],
                          &o[EXPERTS], &o[WEIGHTS]))
        return NULL;
    static const char kinds[NB] = {'f', 'f', 'f', 'B', 'f', 'B', 'f', 'f', 'q', 'f'};
    static const char *names[NB] = {"h", "cos", "sin", "vis", "final_norm", "head", "logits", "scores", "experts",
                                    "weights"};
    Py_buffer b[NB];
    memset(b, 0, sizeof(b));
    PyObject *result = NULL;
    float *scratch = NULL;
    for (int i = 0; i < NB; i++)
        if (get_buf(o[i], &b[i], kinds[i], i == H_ || i >= LOGITS, names[i]) < 0) goto done;
    const long H = (long)(b[H_].len / 4), nl = PyList_Check(layers) ? (long)PyList_GET_SIZE(layers) : 0;
    const long V = (long)(b[LOGITS].len / 4);
    if (H <= 0 || nl <= 0 || p.k <= 0 || p.k > MAX_K || p.nh <= 0 || p.nkv <= 0 || p.D <= 0 || p.D % 2 ||
        p.nh % p.nkv || p.start < 0 || (p.kind != 0 && p.kind != 1) || b[EXPERTS].len != (Py_ssize_t)nl * p.k * 8) {
        PyErr_SetString(PyExc_ValueError, "decode_pass: bad layers, k, kind, head counts or experts' size");
        goto done;
    }
    p.E = (long)(b[SCORES].len / 4 / nl);
    if (p.E < p.k || check_len(&b[SCORES], (Py_ssize_t)nl * p.E * 4, "scores") < 0 ||
        check_len(&b[WEIGHTS], (Py_ssize_t)nl * p.k * 4, "weights") < 0 ||
        check_len(&b[COS], p.D / 2 * 4, "cos") < 0 || check_len(&b[SIN], p.D / 2 * 4, "sin") < 0 ||
        check_len(&b[VIS], p.start + 1, "vis") < 0 || check_len(&b[FN], H * 4, "final_norm") < 0 ||
        check_weights(&b[HEAD], head_type, V, H, "head") < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "decode_pass: scores are not [layers, E >= k]");
        goto done;
    }
    p.H = H, p.cos = b[COS].buf, p.sin = b[SIN].buf, p.vis = b[VIS].buf;
    scratch = malloc(sizeof(float) * (size_t)(3 * H));
    if (!scratch) {
        PyErr_NoMemory();
        goto done;
    }
    p.att = scratch, p.x = scratch + H, p.total = scratch + 2 * H;
    float *h = b[H_].buf;
    long L = 0;
    for (; L < nl; L++) {
        int s = layer(PyList_GET_ITEM(layers, L), &p, h, (float *)b[SCORES].buf + L * p.E,
                      (int64_t *)b[EXPERTS].buf + L * p.k, (float *)b[WEIGHTS].buf + L * p.k);
        if (s == FAILED) goto done;
        if (s == STOPPED) break;
    }
    if (L == nl) { /* the head: forward.py's final norm, then the product */
        int rc;
        Py_BEGIN_ALLOW_THREADS op_rms_norm(h, b[FN].buf, 1, H, p.eps, p.x);
        rc = op_matmul(head_type, b[HEAD].buf, V, H, p.x, 1, b[LOGITS].buf, NULL);
        Py_END_ALLOW_THREADS if (rc) {
            if (rc == -2) PyErr_NoMemory();
            else PyErr_SetString(PyExc_ValueError, "decode_pass: the head's type cannot hold these rows");
            goto done;
        }
    }
    result = PyLong_FromLong(L);
done:
    free(scratch);
    for (int i = 0; i < NB; i++)
        if (b[i].obj) PyBuffer_Release(&b[i]);
    return result;
}

/* router(W [K, N] input-major, x [K], bias [N] | None, y [N]): op_router, a decode token's router
 * scores as decode_pass computes them (kernels/cpu.py `router`) */
static PyObject *py_router(PyObject *self, PyObject *args) {
    PyObject *o[4];
    if (!PyArg_ParseTuple(args, "OOOO", &o[0], &o[1], &o[2], &o[3])) return NULL;
    static const char *names[4] = {"W", "x", "bias", "y"};
    Py_buffer b[4];
    memset(b, 0, sizeof(b));
    PyObject *result = NULL;
    for (int i = 0; i < 4; i++)
        if (o[i] != Py_None && get_buf(o[i], &b[i], 'f', i == 3, names[i]) < 0) goto done;
    long K = (long)(b[1].len / 4), N = (long)(b[3].len / 4);
    if (!b[0].buf || !b[1].buf || !b[3].buf || K <= 0 || N <= 0) {
        PyErr_SetString(PyExc_ValueError, "router: W, x and y are needed");
        goto done;
    }
    if (check_len(&b[0], (Py_ssize_t)K * N * 4, "W") < 0 || (b[2].buf && check_len(&b[2], N * 4, "bias") < 0)) goto done;
    op_router(b[0].buf, N, K, b[1].buf, b[2].buf, b[3].buf); /* tiny: no GIL release */
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (int i = 0; i < 4; i++)
        if (b[i].obj) PyBuffer_Release(&b[i]);
    return result;
}

static PyMethodDef pass_methods[] = {
    {"router", py_router, METH_VARARGS, "router(W, x, bias, y): y = x W + bias for an input-major float32 W [K, N]"},
    {"decode_pass", py_decode_pass, METH_VARARGS,
     "decode_pass(h, layers, cos, sin, vis, start, eps, nh, nkv, D, attn_scale, interleave, k, kind, norm, scale, "
     "best, act, alpha, limit, final_norm, head, head_type, logits, scores, experts, weights) -> layers done"},
    {NULL, NULL, 0, NULL},
};

int pass_register(PyObject *module) { return PyModule_AddFunctions(module, pass_methods); }
