/* s2moe._cpu.ae_predict, reuse_bias and greedy_pick: a draft's and a verification's decisions in C (see predict.c). */
#ifndef S2MOE_PREDICT_H
#define S2MOE_PREDICT_H

#include <Python.h>

/* Adds ae_predict(), reuse_bias() and greedy_pick() to the module; -1 with an exception set on failure. */
int predict_register(PyObject *module);

#endif
