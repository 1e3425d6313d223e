/* gpuio's two hot paths in C: Histogram.observe() and a plain `with metrics.infer():`.
 *
 * Optional: setup.py builds it where a C compiler and CPython's headers are present, and gpuio falls
 * back to the same stores in Python without it (gpuio.metrics says when each is used).  It exists for
 * speed only: a Python observe() is ~400 ns and a Python `with infer():` ~1.2 us, most of it the
 * interpreter's calls and float objects; here they are a few dozen nanoseconds of stores.
 *
 * The stores are the ones the Python paths make, into the same doubles of the process's spool mapping
 * (gpuio/spool.py): a histogram bucket, its sum and the file's generation; for an inference, the
 * in-flight gauge and the generation on entry, and the in-flight gauge, the latency's bucket and sum
 * and the generation on exit.  They run with the GIL held and call no Python code in between, so no
 * other thread of the process can come between a read and its write (CPython with its GIL only:
 * setup.py does not build this for the free-threaded build, whose stores take the lock in Python).
 *
 * Memory safety: each object holds a buffer export of the spool's memoryview, so the mapping cannot be
 * unmapped while it can still be written (SpoolFile.close() then leaves it mapped until the last
 * handle is gone).  After fork() the child maps a file of its own at the very address of its parent's
 * (gpuio.spool.SpoolFile.take_over_after_fork), so every handle keeps working and writes the child's
 * file; only where that failed does gpuio call disown_handles(): handles made before then raise rather
 * than write the parent's file.  __init__ may run Python code (a bound's __float__, an
 * index's __index__) that calls __init__ again: it builds everything in locals and stores into the
 * object only after the last such call.  Timed takes part in garbage collection: an error callback that
 * keeps the exception makes a cycle through it.
 *
 * Guard (at the end): a store into a page of the spool that its file no longer backs (a same-uid
 * sidecar truncated the file) raises SIGBUS, which kills the process.  A Guard registers a mapping with
 * a SIGBUS handler that puts anonymous memory under the faulting page and the rest of the mapping and
 * lets the store run again: the process lives, its later counts stay in its memory, and the Guard
 * counts the fault (gpuio.describe() says so).  Faults anywhere else go to the handler that was there
 * before, or kill as they would have.
 *
 * Limited API 3.11 (abi3): one build serves CPython 3.11 and later.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

/* Bumped by disown_handles() in a forked child whose spool could not be taken over: objects made before
 * it refuse to store (they would write the parent's file). */
static volatile unsigned long fork_epoch = 0;

static PyObject *
disown_handles(PyObject *module, PyObject *unused)
{
    fork_epoch++;
    Py_RETURN_NONE;
}

/* The spool's doubles, held for as long as an object may store into them. */
typedef struct {
    Py_buffer view;
    double *values;
    Py_ssize_t count;
    unsigned long epoch;
} Doubles;

static int
doubles_open(Doubles *doubles, PyObject *values)
{
    if (PyObject_GetBuffer(values, &doubles->view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (doubles->view.itemsize != sizeof(double) || doubles->view.format == NULL
        || strcmp(doubles->view.format, "d") != 0) {
        PyBuffer_Release(&doubles->view);
        PyErr_SetString(PyExc_TypeError, "the spool's values must be a writable buffer of doubles");
        return -1;
    }
    doubles->values = (double *)doubles->view.buf;
    doubles->count = doubles->view.len / (Py_ssize_t)sizeof(double);
    doubles->epoch = fork_epoch;
    return 0;
}

static void
doubles_close(Doubles *doubles)
{
    if (doubles->values != NULL) {
        PyBuffer_Release(&doubles->view);
        doubles->values = NULL;
    }
}

static int
doubles_check_index(const Doubles *doubles, Py_ssize_t index, const char *what)
{
    if (index < 0 || index >= doubles->count) {
        PyErr_Format(PyExc_IndexError, "%s index %zd is outside the spool's %zd doubles", what, index, doubles->count);
        return -1;
    }
    return 0;
}

static int
doubles_usable(const Doubles *doubles)
{
    if (doubles->values == NULL) {  /* made by __new__ without __init__ */
        PyErr_SetString(PyExc_TypeError, "this gpuio handle was not initialised");
        return 0;
    }
    if (doubles->epoch != fork_epoch) {
        PyErr_SetString(PyExc_ValueError,
                        "this gpuio handle belongs to the parent process's spool; after fork() get it again "
                        "from gpuio.engine(...)");
        return 0;
    }
    return 1;
}

/* Histogram bounds as C doubles, sorted ascending (the spool's own bounds). */
typedef struct {
    double *bounds;
    Py_ssize_t count;
} Bounds;

static int
bounds_open(Bounds *bounds, PyObject *sequence)
{
    /* Python code can run below (__float__, an iterator): fill a fresh array, give it to ``bounds`` at the end. */
    PyObject *tuple = PySequence_Tuple(sequence);
    if (tuple == NULL)
        return -1;
    Py_ssize_t count = PyTuple_Size(tuple);
    double *array = PyMem_Malloc(sizeof(double) * (size_t)(count > 0 ? count : 1));
    if (array == NULL) {
        Py_DECREF(tuple);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        double bound = PyFloat_AsDouble(PyTuple_GetItem(tuple, i));
        if (bound == -1.0 && PyErr_Occurred())
            goto fail;
        if (i > 0 && !(bound > array[i - 1])) {
            PyErr_SetString(PyExc_ValueError, "histogram bounds must be increasing");
            goto fail;
        }
        array[i] = bound;
    }
    Py_DECREF(tuple);
    bounds->bounds = array;
    bounds->count = count;
    return 0;
fail:
    Py_DECREF(tuple);
    PyMem_Free(array);
    return -1;
}

/* The doubles and bounds of a histogram whose buckets start at ``first``, its sum's index in ``total``;
 * every index it stores at is checked to lie inside the buffer.  On failure no buffer is held. */
static int
histogram_open(Doubles *doubles, Bounds *bounds, PyObject *values, PyObject *bound_sequence, Py_ssize_t first,
               Py_ssize_t generation, Py_ssize_t *total)
{
    if (bounds_open(bounds, bound_sequence) < 0)
        return -1;
    if (doubles_open(doubles, values) < 0) {
        PyMem_Free(bounds->bounds);
        return -1;
    }
    if (doubles_check_index(doubles, first, "first bucket") == 0) {
        *total = first + bounds->count + 1;  /* buckets, the +Inf one included, then the sum */
        if (doubles_check_index(doubles, *total, "sum") == 0
            && doubles_check_index(doubles, generation, "generation") == 0)
            return 0;
    }
    doubles_close(doubles);
    PyMem_Free(bounds->bounds);
    return -1;
}

/* bisect.bisect_left: how many bounds are below the value (le semantics: value <= bound is in it). */
static inline Py_ssize_t
bucket_of(const Bounds *bounds, double value)
{
    Py_ssize_t low = 0, high = bounds->count;
    while (low < high) {
        Py_ssize_t middle = low + (high - low) / 2;
        if (bounds->bounds[middle] < value)
            low = middle + 1;
        else
            high = middle;
    }
    return low;
}

static inline double
monotonic_seconds(void)
{
    /* time.perf_counter()'s clock on Linux. */
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------------------------------------- */
/* Observer(values, first, generation, bounds): .observe(value) stores an observation               */
/* ---------------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Doubles doubles;
    Bounds bounds;
    Py_ssize_t first, total, generation;
} Observer;

static int
Observer_init(PyObject *self_object, PyObject *args, PyObject *kwargs)
{
    Observer *self = (Observer *)self_object;
    PyObject *values, *bounds;
    Py_ssize_t first, generation, total;
    Doubles doubles = {0};
    Bounds parsed = {0};
    static char *keywords[] = {"values", "first", "generation", "bounds", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnnO", keywords, &values, &first, &generation, &bounds))
        return -1;
    if (histogram_open(&doubles, &parsed, values, bounds, first, generation, &total) < 0)
        return -1;
    /* Checked after the last Python code (__index__, __float__, an iterator may have called __init__). */
    if (self->doubles.values != NULL) {
        doubles_close(&doubles);
        PyMem_Free(parsed.bounds);
        PyErr_SetString(PyExc_TypeError, "an Observer is initialised once");
        return -1;
    }
    PyMem_Free(self->bounds.bounds);
    self->doubles = doubles;
    self->bounds = parsed;
    self->total = total;
    self->first = first;
    self->generation = generation;
    return 0;
}

static PyObject *
Observer_observe(PyObject *self_object, PyObject *value)
{
    Observer *self = (Observer *)self_object;
    double seconds;
    if (PyFloat_CheckExact(value)) {
        seconds = PyFloat_AsDouble(value);
    } else {
        /* float(value), as the Python path does: before any store, so no Python code runs between them. */
        PyObject *converted = PyNumber_Float(value);
        if (converted == NULL)
            return NULL;
        seconds = PyFloat_AsDouble(converted);
        Py_DECREF(converted);
    }
    if (seconds != seconds)  /* NaN would poison the sum forever */
        Py_RETURN_NONE;
    if (!doubles_usable(&self->doubles))
        return NULL;
    double *values = self->doubles.values;
    values[self->first + bucket_of(&self->bounds, seconds)] += 1.0;
    values[self->total] += seconds;
    values[self->generation] += 1.0;
    Py_RETURN_NONE;
}

static void
Observer_dealloc(PyObject *self_object)
{
    Observer *self = (Observer *)self_object;
    PyTypeObject *type = Py_TYPE(self_object);
    doubles_close(&self->doubles);
    PyMem_Free(self->bounds.bounds);
    freefunc free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free(self_object);
    Py_DECREF(type);
}

static PyMethodDef Observer_methods[] = {
    {"observe", Observer_observe, METH_O, "Record one observation: a bisect and three stores, no syscall."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Observer_slots[] = {
    {Py_tp_doc, "A histogram's observe() over the spool's doubles: Observer(values, first, generation, bounds)."},
    {Py_tp_init, Observer_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, Observer_dealloc},
    {Py_tp_methods, Observer_methods},
    {0, NULL},
};

static PyType_Spec Observer_spec = {
    "gpuio._hotpath.Observer", sizeof(Observer), 0, Py_TPFLAGS_DEFAULT, Observer_slots,
};

/* ---------------------------------------------------------------------------------------------- */
/* Inferences(values, in_flight, first, generation, bounds, failed): .infer() for a with statement */
/* ---------------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Doubles doubles;
    Bounds bounds;
    Py_ssize_t in_flight, first, total, generation;
    PyObject *failed;  /* failed(exc): an inference raised (in flight down, the error counted) */
    PyTypeObject *timed_type;
} Inferences;

typedef struct {
    PyObject_HEAD
    Inferences *inferences;
    double start;
    PyObject *latency;  /* None until it completes */
    int entered;
} Timed;

static int
Inferences_init(PyObject *self_object, PyObject *args, PyObject *kwargs)
{
    Inferences *self = (Inferences *)self_object;
    PyObject *values, *bounds, *failed;
    Py_ssize_t in_flight, first, generation, total;
    Doubles doubles = {0};
    Bounds parsed = {0};
    static char *keywords[] = {"values", "in_flight", "first", "generation", "bounds", "failed", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnnnOO", keywords, &values, &in_flight, &first, &generation,
                                     &bounds, &failed))
        return -1;
    if (!PyCallable_Check(failed)) {
        PyErr_SetString(PyExc_TypeError, "failed must be callable");
        return -1;
    }
    if (histogram_open(&doubles, &parsed, values, bounds, first, generation, &total) < 0)
        return -1;
    if (doubles_check_index(&doubles, in_flight, "in flight") < 0 || self->doubles.values != NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "an Inferences is initialised once");
        doubles_close(&doubles);
        PyMem_Free(parsed.bounds);
        return -1;
    }
    PyMem_Free(self->bounds.bounds);
    self->doubles = doubles;
    self->bounds = parsed;
    self->total = total;
    self->in_flight = in_flight;
    self->first = first;
    self->generation = generation;
    Py_INCREF(failed);
    self->failed = failed;
    return 0;
}

static PyObject *
Inferences_infer(PyObject *self_object, PyObject *unused)
{
    Inferences *self = (Inferences *)self_object;
    if (self->doubles.values == NULL) {
        PyErr_SetString(PyExc_TypeError, "Inferences was not initialised");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(self->timed_type, Py_tp_alloc);
    Timed *timed = (Timed *)alloc(self->timed_type, 0);
    if (timed == NULL)
        return NULL;
    Py_INCREF(self_object);
    timed->inferences = self;
    Py_INCREF(Py_None);
    timed->latency = Py_None;
    return (PyObject *)timed;
}

static int
Inferences_traverse(PyObject *self_object, visitproc visit, void *arg)
{
    Inferences *self = (Inferences *)self_object;
    Py_VISIT(self->failed);
    Py_VISIT(Py_TYPE(self_object));
    return 0;
}

static int
Inferences_clear(PyObject *self_object)
{
    Inferences *self = (Inferences *)self_object;
    Py_CLEAR(self->failed);
    return 0;
}

static void
Inferences_dealloc(PyObject *self_object)
{
    Inferences *self = (Inferences *)self_object;
    PyTypeObject *type = Py_TYPE(self_object);
    PyObject_GC_UnTrack(self_object);
    Inferences_clear(self_object);
    doubles_close(&self->doubles);
    PyMem_Free(self->bounds.bounds);
    Py_XDECREF((PyObject *)self->timed_type);
    freefunc free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free(self_object);
    Py_DECREF(type);
}

static PyObject *timed_type_singleton = NULL;

static PyObject *
Inferences_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    Inferences *self = (Inferences *)PyType_GenericNew(type, args, kwargs);
    if (self == NULL)
        return NULL;
    Py_INCREF(timed_type_singleton);
    self->timed_type = (PyTypeObject *)timed_type_singleton;
    return (PyObject *)self;
}

static PyMethodDef Inferences_methods[] = {
    {"infer", Inferences_infer, METH_NOARGS, "A timed inference for a with statement."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Inferences_slots[] = {
    {Py_tp_doc, "An engine's plain `with infer():` over the spool's doubles."},
    {Py_tp_init, Inferences_init},
    {Py_tp_new, Inferences_new},
    {Py_tp_dealloc, Inferences_dealloc},
    {Py_tp_traverse, Inferences_traverse},
    {Py_tp_clear, Inferences_clear},
    {Py_tp_methods, Inferences_methods},
    {0, NULL},
};

static PyType_Spec Inferences_spec = {
    "gpuio._hotpath.Inferences", sizeof(Inferences), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, Inferences_slots,
};

static PyObject *
Timed_enter(PyObject *self_object, PyObject *unused)
{
    Timed *self = (Timed *)self_object;
    Inferences *inferences = self->inferences;
    if (self->entered) {
        PyErr_SetString(PyExc_RuntimeError, "an inference from infer() is entered once; call infer() again");
        return NULL;
    }
    if (!doubles_usable(&inferences->doubles))
        return NULL;
    double *values = inferences->doubles.values;
    values[inferences->in_flight] += 1.0;
    values[inferences->generation] += 1.0;
    self->entered = 1;
    self->start = monotonic_seconds();
    Py_INCREF(self_object);
    return self_object;
}

static PyObject *
Timed_exit(PyObject *self_object, PyObject *const *args, Py_ssize_t nargs)
{
    double seconds = monotonic_seconds();
    Timed *self = (Timed *)self_object;
    Inferences *inferences = self->inferences;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "__exit__ takes the exception's type, value and traceback");
        return NULL;
    }
    if (self->entered != 1) {
        PyErr_SetString(PyExc_RuntimeError, "__exit__ without __enter__");
        return NULL;
    }
    self->entered = 2;
    seconds -= self->start;
    if (args[1] != Py_None) {
        if (inferences->failed == NULL) {  /* cleared by the collector */
            PyErr_SetString(PyExc_RuntimeError, "this inference's engine is gone");
            return NULL;
        }
        PyObject *result = PyObject_CallFunctionObjArgs(inferences->failed, args[1], NULL);
        if (result == NULL)
            return NULL;
        Py_DECREF(result);
        Py_RETURN_NONE;  /* the exception goes on */
    }
    if (!doubles_usable(&inferences->doubles))
        return NULL;
    PyObject *latency = PyFloat_FromDouble(seconds);
    if (latency == NULL)
        return NULL;
    PyObject *previous = self->latency;
    self->latency = latency;
    Py_XDECREF(previous);
    double *values = inferences->doubles.values;
    values[inferences->in_flight] -= 1.0;
    values[inferences->first + bucket_of(&inferences->bounds, seconds)] += 1.0;  /* a clock difference: never NaN */
    values[inferences->total] += seconds;
    values[inferences->generation] += 1.0;
    Py_RETURN_NONE;
}

static PyObject *
Timed_enqueued(PyObject *self_object, PyObject *unused)
{
    Py_RETURN_NONE;  /* no GPU timer to stop */
}

static PyObject *
Timed_latency(PyObject *self_object, void *closure)
{
    Timed *self = (Timed *)self_object;
    Py_INCREF(self->latency);
    return self->latency;
}

static int
Timed_traverse(PyObject *self_object, visitproc visit, void *arg)
{
    Py_VISIT((PyObject *)((Timed *)self_object)->inferences);
    Py_VISIT(Py_TYPE(self_object));
    return 0;
}

static void
Timed_dealloc(PyObject *self_object)
{
    Timed *self = (Timed *)self_object;
    PyTypeObject *type = Py_TYPE(self_object);
    PyObject_GC_UnTrack(self_object);
    Py_XDECREF(self->latency);
    Py_XDECREF((PyObject *)self->inferences);
    freefunc free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free(self_object);
    Py_DECREF(type);
}

static PyMethodDef Timed_methods[] = {
    {"__enter__", Timed_enter, METH_NOARGS, "In flight up, the clock started."},
    {"__exit__", (PyCFunction)(void (*)(void))Timed_exit, METH_FASTCALL,
     "Completed: in flight down and the latency observed; raised: failed(exc)."},
    {"enqueued", Timed_enqueued, METH_NOARGS, "Mark the end of the GPU work on the stream (no GPU timer here)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Timed_getset[] = {
    {"latency", Timed_latency, NULL, "Seconds the inference took, once it completed; else None.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Timed_slots[] = {
    {Py_tp_doc, "One timed inference: `with metrics.infer(): ...` (enqueue and synchronise inside)."},
    {Py_tp_dealloc, Timed_dealloc},
    {Py_tp_traverse, Timed_traverse},
    {Py_tp_methods, Timed_methods},
    {Py_tp_getset, Timed_getset},
    {0, NULL},
};

static PyType_Spec Timed_spec = {
    "gpuio._hotpath.Timed", sizeof(Timed), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_HAVE_GC, Timed_slots,
};

/* ---------------------------------------------------------------------------------------------- */

static int
add_type(PyObject *module, PyType_Spec *spec, PyObject **out)
{
    PyObject *type = PyType_FromSpec(spec);
    if (type == NULL)
        return -1;
    if (PyModule_AddObjectRef(module, strrchr(spec->name, '.') + 1, type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    if (out != NULL)
        *out = type;
    else
        Py_DECREF(type);
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* Guard(mapping): survive SIGBUS from a spool file truncated under the process                     */
/* ---------------------------------------------------------------------------------------------- */

#define MAX_GUARDED 256

/* The guarded mappings, read by the signal handler: a slot is filled (start, then length) and
 * emptied (length first) with the GIL held, so the handler never sees a half-made one. */
static struct {
    volatile uintptr_t start;
    volatile size_t length;
    volatile sig_atomic_t faults;
} guarded[MAX_GUARDED];

static struct sigaction previous_bus;
static int handler_installed = 0;
static uintptr_t page_size = 4096;

static int
replace_with_memory(Py_ssize_t slot, uintptr_t address)
{
    uintptr_t start = guarded[slot].start, end = start + guarded[slot].length;
    uintptr_t page = address & ~(page_size - 1);
    /* The file's pages from here on are gone (a truncated file reads as zeros when it grows again):
     * zeroed private memory is what the stores would have found, and it cannot fault. */
    void *placed = mmap((void *)page, end - page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
                        -1, 0);
    if (placed == MAP_FAILED)
        return 0;
    guarded[slot].faults++;
    return 1;
}

static void
pass_on(int signal_number, siginfo_t *info, void *context)
{
    if (previous_bus.sa_flags & SA_SIGINFO) {
        if (previous_bus.sa_sigaction != NULL) {
            previous_bus.sa_sigaction(signal_number, info, context);
            return;
        }
    } else if (previous_bus.sa_handler != SIG_DFL && previous_bus.sa_handler != SIG_IGN) {
        previous_bus.sa_handler(signal_number);
        return;
    }
    /* The default action: a fault runs again on return and now kills; a sent signal is sent again. */
    signal(SIGBUS, SIG_DFL);
    if (info->si_code <= 0)
        raise(SIGBUS);
}

static void
on_sigbus(int signal_number, siginfo_t *info, void *context)
{
    if (info->si_code > 0) {  /* a fault: si_addr is the address that faulted */
        uintptr_t address = (uintptr_t)info->si_addr;
        for (Py_ssize_t slot = 0; slot < MAX_GUARDED; slot++) {
            size_t length = guarded[slot].length;
            if (length != 0 && address - guarded[slot].start < length && replace_with_memory(slot, address))
                return;  /* the store runs again, into memory */
        }
    } else if (info->si_pid == getpid()) {
        /* Raised by this process itself: another handler (faulthandler) passing a fault on to us after
         * reporting it; returning lets the faulting store run again, and its fault comes here. */
        return;
    }
    pass_on(signal_number, info, context);
}

static int
install_handler(void)
{
    if (handler_installed)
        return 0;
    long size = sysconf(_SC_PAGESIZE);
    if (size > 0)
        page_size = (uintptr_t)size;
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&ours.sa_mask);
    if (sigaction(SIGBUS, &ours, &previous_bus) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    handler_installed = 1;
    return 0;
}

typedef struct {
    PyObject_HEAD
    Py_buffer view;  /* held while guarded: the mapping cannot be unmapped under the handler */
    Py_ssize_t slot;  /* -1: not guarding */
} Guard;

static void
guard_release(Guard *self)
{
    if (self->slot >= 0) {
        guarded[self->slot].length = 0;
        guarded[self->slot].start = 0;
        self->slot = -1;
        PyBuffer_Release(&self->view);
    }
}

static int
Guard_init(PyObject *self_object, PyObject *args, PyObject *kwargs)
{
    Guard *self = (Guard *)self_object;
    PyObject *mapping;
    static char *keywords[] = {"mapping", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O", keywords, &mapping))
        return -1;
    guard_release(self);
    if (install_handler() < 0)
        return -1;
    Py_ssize_t slot = 0;
    while (slot < MAX_GUARDED && guarded[slot].length != 0)
        slot++;
    if (slot == MAX_GUARDED) {
        PyErr_SetString(PyExc_OSError, "no free guard slot (at most 256 spool mappings are guarded)");
        return -1;
    }
    if (PyObject_GetBuffer(mapping, &self->view, PyBUF_WRITABLE) < 0)
        return -1;
    if (self->view.len <= 0) {
        PyBuffer_Release(&self->view);
        PyErr_SetString(PyExc_ValueError, "an empty mapping needs no guard");
        return -1;
    }
    guarded[slot].faults = 0;
    guarded[slot].start = (uintptr_t)self->view.buf;
    guarded[slot].length = (size_t)self->view.len;
    self->slot = slot;
    return 0;
}

static PyObject *
Guard_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    Guard *self = (Guard *)PyType_GenericNew(type, args, kwargs);
    if (self != NULL)
        self->slot = -1;
    return (PyObject *)self;
}

static PyObject *
Guard_release(PyObject *self_object, PyObject *unused)
{
    guard_release((Guard *)self_object);
    Py_RETURN_NONE;
}

static PyObject *
Guard_faults(PyObject *self_object, void *closure)
{
    Guard *self = (Guard *)self_object;
    return PyLong_FromLong(self->slot < 0 ? 0 : (long)guarded[self->slot].faults);
}

static PyObject *
Guard_address(PyObject *self_object, void *closure)
{
    Guard *self = (Guard *)self_object;
    return PyLong_FromSize_t(self->slot < 0 ? 0 : (size_t)guarded[self->slot].start);
}

static void
Guard_dealloc(PyObject *self_object)
{
    PyTypeObject *type = Py_TYPE(self_object);
    guard_release((Guard *)self_object);
    freefunc free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free(self_object);
    Py_DECREF(type);
}

static PyMethodDef Guard_methods[] = {
    {"release", Guard_release, METH_NOARGS, "Stop guarding and let the mapping go (before it is unmapped)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Guard_getset[] = {
    {"faults", Guard_faults, NULL, "SIGBUS faults in the mapping survived so far.", NULL},
    {"address", Guard_address, NULL, "Where the guarded mapping starts (0: not guarding).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Guard_slots[] = {
    {Py_tp_doc, "Guard(mapping): survive SIGBUS in a spool mapping whose file was truncated."},
    {Py_tp_init, Guard_init},
    {Py_tp_new, Guard_new},
    {Py_tp_dealloc, Guard_dealloc},
    {Py_tp_methods, Guard_methods},
    {Py_tp_getset, Guard_getset},
    {0, NULL},
};

static PyType_Spec Guard_spec = {
    "gpuio._hotpath.Guard", sizeof(Guard), 0, Py_TPFLAGS_DEFAULT, Guard_slots,
};

/* ---------------------------------------------------------------------------------------------- */

static PyMethodDef module_functions[] = {
    {"disown_handles", disown_handles, METH_NOARGS,
     "After fork(): objects made before now refuse to store (the child could not take its spool over)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hotpath_module = {
    PyModuleDef_HEAD_INIT, "gpuio._hotpath",
    "gpuio's observe() and `with infer():` stores in C (optional; gpuio.metrics falls back to Python).",
    -1, module_functions, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__hotpath(void)
{
    PyObject *module = PyModule_Create(&hotpath_module);
    if (module == NULL)
        return NULL;
    if (add_type(module, &Observer_spec, NULL) < 0 || add_type(module, &Timed_spec, &timed_type_singleton) < 0
        || add_type(module, &Inferences_spec, NULL) < 0 || add_type(module, &Guard_spec, NULL) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
