/* s2moe._cpu.Read: file reads on C threads that never take the GIL (see aio.c). */
#ifndef S2MOE_AIO_H
#define S2MOE_AIO_H

#include <Python.h>

#define AIO_MAX_THREADS 32

/* Adds the Read type and io_threads() to the module; -1 with an exception set on failure. */
int aio_register(PyObject *module);

#endif
