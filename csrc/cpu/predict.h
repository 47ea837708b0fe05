/* s2moe._cpu.ae_predict: a draft token's expert predictions in one call (see predict.c). */
#ifndef S2MOE_PREDICT_H
#define S2MOE_PREDICT_H

#include <Python.h>

/* Adds ae_predict() to the module; -1 with an exception set on failure. */
int predict_register(PyObject *module);

#endif
