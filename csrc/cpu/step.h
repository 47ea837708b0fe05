/* s2moe._cpu.moe_step: one decode token's MoE layer in one call (see step.c). */
#ifndef S2MOE_STEP_H
#define S2MOE_STEP_H

#include <Python.h>

/* Adds moe_step() to the module; -1 with an exception set on failure. */
int step_register(PyObject *module);

#endif
