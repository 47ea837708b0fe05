/* s2moe._cpu.Read: a file read on the extension's own I/O threads, which never take the GIL.
 *
 * Expert fetches used to run on Python threads, whose Python around each pread holds the GIL: on
 * this 2-vCPU VM a six-token draft beside prefetches on them took 1.42x its time without prefetch,
 * against 1.13x with these threads (docs/performance/kernels.md, "Reads off the GIL"). Here a
 * request is queued with its target buffer; a pthread reads it; the caller polls `done()` or
 * blocks in `wait()` with the GIL released.
 *
 * Lifetime: a Read holds a view of its buffer until the read is over and collected (wait, or
 * dealloc, which first takes it off the queue or waits for it), so the buffer cannot be freed
 * under a running read. The I/O threads touch only the C struct, never a Python object.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include "aio.h"

enum { QUEUED, RUNNING, DONE, CANCELLED };

typedef struct ReadObject {
    PyObject_HEAD
    int fd;
    long long offset;
    Py_buffer view;
    int has_view;
    int state;        /* under io.mu */
    long long got;    /* bytes read (DONE) */
    int err;          /* errno of a failed read (DONE) */
    long long done_ns; /* CLOCK_MONOTONIC, as time.perf_counter on Linux */
    struct ReadObject *next;
} ReadObject;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t work;  /* a request was queued, or stop */
    pthread_cond_t done;  /* a request finished */
    ReadObject *head, *tail;
    int threads;          /* started */
    int want;             /* to start on first use */
    int stop;
    int held;             /* tests: requests stay queued while set */
    pthread_t tid[AIO_MAX_THREADS];
} io = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, 0, 4, 0, 0, {0}};

/* Tests: while set, every read fails with this errno, or reports at most this many bytes. */
static atomic_int inject_errno;
static atomic_llong inject_cap = -1;
static atomic_long inject_delay_us; /* and each read, once started, takes this much longer */

static long long mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void *io_worker(void *arg) {
    (void)arg;
    pthread_mutex_lock(&io.mu);
    for (;;) {
        while ((!io.head || io.held) && !io.stop) pthread_cond_wait(&io.work, &io.mu);
        if (io.stop) break;
        ReadObject *r = io.head;
        io.head = r->next;
        if (!io.head) io.tail = NULL;
        r->next = NULL;
        r->state = RUNNING;
        pthread_mutex_unlock(&io.mu);
        char *p = r->view.buf;
        long long want = r->view.len, got = 0;
        int err = 0;
        long delay = atomic_load(&inject_delay_us);
        if (delay > 0) {
            struct timespec nap = {delay / 1000000, (delay % 1000000) * 1000};
            nanosleep(&nap, NULL);
        }
        err = atomic_load(&inject_errno);
        while (!err && got < want) { /* a short read is retried; end of file stops it (the caller reports it) */
            ssize_t n = pread(r->fd, p + got, (size_t)(want - got), (off_t)(r->offset + got));
            if (n < 0 && errno == EINTR) continue;
            if (n < 0) { err = errno; break; }
            if (n == 0) break;
            got += n;
        }
        long long cap = atomic_load(&inject_cap);
        if (cap >= 0 && got > cap) got = cap; /* as if the device had returned less */
        pthread_mutex_lock(&io.mu);
        r->got = got;
        r->err = err;
        r->done_ns = mono_ns();
        r->state = DONE;
        pthread_cond_broadcast(&io.done);
    }
    pthread_mutex_unlock(&io.mu);
    return NULL;
}

/* Under io.mu: start the threads if none run yet. */
static int start_threads_locked(void) {
    while (io.threads < io.want) {
        if (pthread_create(&io.tid[io.threads], NULL, io_worker, NULL) != 0) break;
        io.threads++;
    }
    return io.threads;
}

/* A forked child has none of the parent's threads: start afresh (nothing of the parent's is queued
 * for it: a Read never crosses a fork in use). */
static void after_fork_child(void) {
    pthread_mutex_init(&io.mu, NULL);
    pthread_cond_init(&io.work, NULL);
    pthread_cond_init(&io.done, NULL);
    io.head = io.tail = NULL;
    io.threads = 0;
    io.stop = 0;
    io.held = 0;
}

/* Wait (GIL released) until r is DONE or CANCELLED. */
static void wait_for(ReadObject *r) {
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&io.mu);
    while (r->state == QUEUED || r->state == RUNNING) pthread_cond_wait(&io.done, &io.mu);
    pthread_mutex_unlock(&io.mu);
    Py_END_ALLOW_THREADS
}

/* Under io.mu: unlink a QUEUED r. */
static void unqueue_locked(ReadObject *r) {
    ReadObject **pp = &io.head, *prev = NULL;
    while (*pp && *pp != r) {
        prev = *pp;
        pp = &(*pp)->next;
    }
    if (*pp == r) {
        *pp = r->next;
        if (io.tail == r) io.tail = prev;
        r->next = NULL;
    }
}

static void release_view(ReadObject *r) {
    if (r->has_view) {
        PyBuffer_Release(&r->view);
        r->has_view = 0;
    }
}

static int Read_init(ReadObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"fd", "offset", "buffer", NULL};
    PyObject *buffer;
    if (self->has_view) {
        PyErr_SetString(PyExc_RuntimeError, "Read: already started");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iLO", names, &self->fd, &self->offset, &buffer)) return -1;
    if (self->fd < 0 || self->offset < 0) {
        PyErr_SetString(PyExc_ValueError, "Read: fd and offset must be >= 0");
        return -1;
    }
    if (PyObject_GetBuffer(buffer, &self->view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return -1;
    self->has_view = 1;
    pthread_mutex_lock(&io.mu);
    if (start_threads_locked() == 0) {
        pthread_mutex_unlock(&io.mu);
        release_view(self);
        PyErr_SetString(PyExc_OSError, "Read: no I/O thread could be started");
        return -1;
    }
    self->state = QUEUED;
    self->next = NULL;
    if (io.tail) io.tail->next = self; else io.head = self;
    io.tail = self;
    pthread_cond_signal(&io.work);
    pthread_mutex_unlock(&io.mu);
    return 0;
}

static void Read_dealloc(ReadObject *self) {
    if (self->has_view) { /* never free the buffer under a running read */
        pthread_mutex_lock(&io.mu);
        if (self->state == QUEUED) {
            unqueue_locked(self);
            self->state = CANCELLED;
        }
        pthread_mutex_unlock(&io.mu);
        wait_for(self);
        release_view(self);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Read_done(ReadObject *self, PyObject *unused) {
    (void)unused;
    pthread_mutex_lock(&io.mu);
    int s = self->state;
    pthread_mutex_unlock(&io.mu);
    return PyBool_FromLong(s == DONE || s == CANCELLED);
}

static PyObject *Read_wait(ReadObject *self, PyObject *unused) {
    (void)unused;
    if (!self->has_view && self->state != DONE) {
        PyErr_SetString(PyExc_RuntimeError, "Read: cancelled, or never started");
        return NULL;
    }
    wait_for(self);
    release_view(self);
    if (self->state == CANCELLED) {
        PyErr_SetString(PyExc_RuntimeError, "Read: cancelled");
        return NULL;
    }
    if (self->err) {
        errno = self->err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLongLong(self->got);
}

static PyObject *Read_cancel(ReadObject *self, PyObject *unused) {
    (void)unused;
    pthread_mutex_lock(&io.mu);
    int queued = self->state == QUEUED;
    if (queued) {
        unqueue_locked(self);
        self->state = CANCELLED;
    }
    pthread_mutex_unlock(&io.mu);
    if (queued) release_view(self);
    return PyBool_FromLong(queued || self->state == CANCELLED);
}

static PyObject *Read_done_at(ReadObject *self, void *unused) {
    (void)unused;
    pthread_mutex_lock(&io.mu);
    int s = self->state;
    long long ns = self->done_ns;
    pthread_mutex_unlock(&io.mu);
    if (s != DONE) Py_RETURN_NONE;
    return PyFloat_FromDouble((double)ns * 1e-9);
}

static PyMethodDef read_methods[] = {
    {"done", (PyCFunction)Read_done, METH_NOARGS, "done() -> whether the read is over (finished or cancelled)"},
    {"wait", (PyCFunction)Read_wait, METH_NOARGS, "wait() -> bytes read (fewer at end of file); OSError if it failed"},
    {"cancel", (PyCFunction)Read_cancel, METH_NOARGS, "cancel() -> True if it had not started (it never will)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef read_getset[] = {
    {"done_at", (getter)Read_done_at, NULL, "when it finished, in time.perf_counter() seconds (Linux); None before", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ReadType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "s2moe._cpu.Read",
    .tp_basicsize = sizeof(ReadObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Read(fd, offset, buffer): read len(buffer) bytes at offset on an I/O thread, starting now",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Read_init,
    .tp_dealloc = (destructor)Read_dealloc,
    .tp_methods = read_methods,
    .tp_getset = read_getset,
};

static PyObject *py_io_threads(PyObject *self, PyObject *args) {
    (void)self;
    int n = -1;
    if (!PyArg_ParseTuple(args, "|i", &n)) return NULL;
    pthread_mutex_lock(&io.mu);
    if (n > 0) /* more threads start on the next read; fewer take effect in a fresh process only */
        io.want = n > AIO_MAX_THREADS ? AIO_MAX_THREADS : n;
    int want = io.want;
    pthread_mutex_unlock(&io.mu);
    return PyLong_FromLong(want);
}

static PyObject *py_io_inject(PyObject *self, PyObject *args) {
    (void)self;
    int err = 0;
    long long cap = -1;
    long delay = 0;
    if (!PyArg_ParseTuple(args, "|iLl", &err, &cap, &delay)) return NULL;
    atomic_store(&inject_errno, err);
    atomic_store(&inject_cap, cap);
    atomic_store(&inject_delay_us, delay);
    Py_RETURN_NONE;
}

static PyObject *py_io_hold(PyObject *self, PyObject *args) {
    (void)self;
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    pthread_mutex_lock(&io.mu);
    io.held = on;
    pthread_cond_broadcast(&io.work);
    pthread_mutex_unlock(&io.mu);
    Py_RETURN_NONE;
}

PyMethodDef aio_methods[] = {
    {"io_hold", py_io_hold, METH_VARARGS, "io_hold(on): tests; queued reads wait (cancellable) while on"},
    {"io_inject", py_io_inject, METH_VARARGS, "io_inject(errno=0, cap=-1, delay_us=0): tests; reads fail with errno, report at most cap bytes, take delay_us longer"},
    {"io_threads", py_io_threads, METH_VARARGS, "io_threads([n]) -> I/O threads Read uses (at least n from the next read)"},
    {NULL, NULL, 0, NULL},
};

int aio_register(PyObject *module) {
    static int forked_handler = 0;
    if (!forked_handler) {
        pthread_atfork(NULL, NULL, after_fork_child);
        forked_handler = 1;
    }
    if (PyType_Ready(&ReadType) < 0) return -1;
    Py_INCREF(&ReadType);
    if (PyModule_AddObject(module, "Read", (PyObject *)&ReadType) < 0) {
        Py_DECREF(&ReadType);
        return -1;
    }
    return PyModule_AddFunctions(module, aio_methods);
}
