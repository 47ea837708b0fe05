/* s2moe._cpu.decode_pass: a decode token's whole pass in one call (see pass.c). */
#ifndef S2MOE_PASS_H
#define S2MOE_PASS_H

#include <Python.h>

/* Adds decode_pass() to the module; -1 with an exception set on failure. */
int pass_register(PyObject *module);

#endif
