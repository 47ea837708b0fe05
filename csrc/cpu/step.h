/* s2moe._cpu.moe_step: one decode token's MoE layer in one call (see step.c). */
#ifndef S2MOE_STEP_H
#define S2MOE_STEP_H

#include <Python.h>

#include "ops.h"

#define MAX_K 64 /* choices per token the one-call steps take */
enum { EX_BUFS = 6 }; /* the buffers of an expert's table entry: gate, up, down and their biases */

/* The table entry of a chosen expert: (gate, up, down, gtype, utype, dtype, gate_bias, up_bias,
 * down_bias), kernels/cpu.py `_expert_args`. Its views go to v[EX_BUFS] (the caller releases them),
 * its rows to *I (which must match a nonzero *I). -1 with ValueError set on a bad entry. */
int parse_expert(PyObject *item, moe_expert *m, Py_buffer *v, long H, long *I);

/* One decode token's MoE layer from its router scores [E] (GIL held; released around the kernels):
 * route, restrict to `allowed` [E] (NULL: all), and when every choice is in `table` (a list of E
 * expert tuples or None), total [H] = their weighted sum in choice order. 0 computed; 1 a choice not
 * in the table; 2 a NaN score; -1 an exception. experts [k] and weights [k] are written unless 2. */
int moe_token_step(const float *scores, long E, int k, int kind, int norm, float scale, const uint8_t *allowed,
                   int best, PyObject *table, long H, const float *x, int act, float alpha, float limit,
                   int64_t *experts, float *weights, float *total);

/* Adds moe_step() to the module; -1 with an exception set on failure. */
int step_register(PyObject *module);

#endif
