# cython: autotestdict=False
"""DLPack capsules over memory the library owns, for the device layer's array views.

A capsule holds a ``DLManagedTensor`` (the ``"dltensor"`` capsule of DLPack before 1.0) or a
``DLManagedTensorVersioned`` (``"dltensor_versioned"``), in one allocation with its shape and
strides, and a reference on the view it describes, so the memory outlives the consumer's tensor.
The deleter drops that reference and frees the allocation; it takes the GIL itself, since a
consumer may free its tensor on a thread that does not hold it. A capsule dropped unconsumed (its
name not changed to ``"used_..."``) runs the deleter from its destructor.

Every argument is checked by the caller (``lifecycle/device/dlpack.py``); here only what C needs.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uintptr_t

cdef extern from *:
    """
    #include <Python.h>
    #include <stdint.h>
    #include <stdlib.h>

    /* The DLPack 1.x ABI (dlpack.h), under names of our own. */
    typedef struct { int32_t device_type; int32_t device_id; } lc_DLDevice;
    typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } lc_DLDataType;
    typedef struct {
        void *data;
        lc_DLDevice device;
        int32_t ndim;
        lc_DLDataType dtype;
        int64_t *shape;
        int64_t *strides;
        uint64_t byte_offset;
    } lc_DLTensor;
    typedef struct lc_DLManagedTensor {
        lc_DLTensor dl_tensor;
        void *manager_ctx;
        void (*deleter)(struct lc_DLManagedTensor *self);
    } lc_DLManagedTensor;
    typedef struct { uint32_t major; uint32_t minor; } lc_DLPackVersion;
    typedef struct lc_DLManagedTensorVersioned {
        lc_DLPackVersion version;
        void *manager_ctx;
        void (*deleter)(struct lc_DLManagedTensorVersioned *self);
        uint64_t flags;
        lc_DLTensor dl_tensor;
    } lc_DLManagedTensorVersioned;

    #define LC_DLPACK_MAJOR 1
    #define LC_DLPACK_MINOR 1
    #define LC_FLAG_READ_ONLY 1ULL
    #define LC_FLAG_IS_COPIED 2ULL

    /* Drop the owner reference and the allocation. At interpreter exit the owner is left alone:
       a finalized interpreter must not be entered. */
    static void lc_release(void *owner, void *allocation) {
        if (!Py_IsInitialized()) return;
        PyGILState_STATE state = PyGILState_Ensure();
        Py_XDECREF((PyObject *)owner);
        free(allocation);
        PyGILState_Release(state);
    }

    static void lc_deleter(lc_DLManagedTensor *self) { lc_release(self->manager_ctx, self); }

    static void lc_deleter_versioned(lc_DLManagedTensorVersioned *self) {
        lc_release(self->manager_ctx, self);
    }

    /* A capsule's destructor: the tensor is the consumer's once it renamed the capsule "used_...";
       otherwise nobody took it and it is released here. */
    static void lc_capsule_destructor(PyObject *capsule, int versioned) {
        const char *name = versioned ? "dltensor_versioned" : "dltensor";
        if (!PyCapsule_IsValid(capsule, name)) return;
    #if PY_VERSION_HEX >= 0x030C0000
        PyObject *raised = PyErr_GetRaisedException();
    #else
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
    #endif
        void *managed = PyCapsule_GetPointer(capsule, name);
        if (managed == NULL) {
            PyErr_WriteUnraisable(capsule);
        } else if (versioned) {
            lc_deleter_versioned((lc_DLManagedTensorVersioned *)managed);
        } else {
            lc_deleter((lc_DLManagedTensor *)managed);
        }
    #if PY_VERSION_HEX >= 0x030C0000
        PyErr_SetRaisedException(raised);
    #else
        PyErr_Restore(type, value, tb);
    #endif
    }

    static void lc_destroy_legacy(PyObject *capsule) { lc_capsule_destructor(capsule, 0); }
    static void lc_destroy_versioned(PyObject *capsule) { lc_capsule_destructor(capsule, 1); }

    /* A new capsule describing `ndim` dims of `shape` / `strides` (elements) at `data`, holding a
       reference on `owner`; NULL with an exception set on failure. */
    static PyObject *lc_capsule(PyObject *owner, uintptr_t data, int32_t ndim, const int64_t *shape,
                                const int64_t *strides, uint8_t code, uint8_t bits, int32_t device_type,
                                int32_t device_id, int versioned, uint64_t flags) {
        size_t head = versioned ? sizeof(lc_DLManagedTensorVersioned) : sizeof(lc_DLManagedTensor);
        char *block = calloc(1, head + 2 * (size_t)(ndim > 0 ? ndim : 1) * sizeof(int64_t));
        if (block == NULL) return PyErr_NoMemory();
        int64_t *dims = (int64_t *)(block + head);
        int64_t *steps = dims + ndim;
        for (int32_t i = 0; i < ndim; i++) {
            dims[i] = shape[i];
            steps[i] = strides[i];
        }
        lc_DLTensor *tensor;
        if (versioned) {
            lc_DLManagedTensorVersioned *managed = (lc_DLManagedTensorVersioned *)block;
            managed->version.major = LC_DLPACK_MAJOR;
            managed->version.minor = LC_DLPACK_MINOR;
            managed->manager_ctx = owner;
            managed->deleter = lc_deleter_versioned;
            managed->flags = flags;
            tensor = &managed->dl_tensor;
        } else {
            lc_DLManagedTensor *managed = (lc_DLManagedTensor *)block;
            managed->manager_ctx = owner;
            managed->deleter = lc_deleter;
            tensor = &managed->dl_tensor;
        }
        tensor->data = (void *)data;
        tensor->device.device_type = device_type;
        tensor->device.device_id = device_id;
        tensor->ndim = ndim;
        tensor->dtype.code = code;
        tensor->dtype.bits = bits;
        tensor->dtype.lanes = 1;
        tensor->shape = dims;
        tensor->strides = steps;
        tensor->byte_offset = 0;
        PyObject *capsule = PyCapsule_New(block, versioned ? "dltensor_versioned" : "dltensor",
                                          versioned ? lc_destroy_versioned : lc_destroy_legacy);
        if (capsule == NULL) {
            free(block);
            return NULL;
        }
        Py_INCREF(owner);
        return capsule;
    }
    """
    object lc_capsule(object owner, uintptr_t data, int32_t ndim, const int64_t *shape, const int64_t *strides,
                      uint8_t code, uint8_t bits, int32_t device_type, int32_t device_id, int versioned,
                      unsigned long long flags)

# numpy's limit on dimensions: no view has more.
DEF MAX_DIMS = 64

#: The DLPack version a versioned capsule declares.
DLPACK_VERSION = (1, 1)
#: ``flags`` bits of a versioned capsule.
FLAG_READ_ONLY = 1
FLAG_IS_COPIED = 2


def to_capsule(owner, *, uintptr_t data, tuple shape, tuple strides, int code, int bits, int device_type,
               int device_id, bint versioned, unsigned long long flags):
    """A DLPack capsule (``"dltensor_versioned"`` when ``versioned``, else ``"dltensor"``) over
    ``data``, shaped ``shape`` with ``strides`` counted in elements, of DLPack type ``(code,
    bits)`` on device ``(device_type, device_id)``, holding a reference on ``owner`` until the
    consumer deletes the tensor. ``flags`` applies to a versioned capsule only."""
    cdef int64_t dims[MAX_DIMS]
    cdef int64_t steps[MAX_DIMS]
    cdef Py_ssize_t ndim = len(shape)
    cdef Py_ssize_t i
    if ndim > MAX_DIMS or len(strides) != ndim:
        raise ValueError(f"to_capsule: {ndim} dims and {len(strides)} strides; at most {MAX_DIMS}, one per dim")
    if not 0 <= code <= 255 or not 0 < bits <= 255:
        raise ValueError(f"to_capsule: dtype code {code} / bits {bits} do not fit a DLDataType")
    for i in range(ndim):
        dims[i] = shape[i]
        steps[i] = strides[i]
    return lc_capsule(owner, data, <int32_t>ndim, dims, steps, <uint8_t>code, <uint8_t>bits, device_type,
                      device_id, versioned, flags)
