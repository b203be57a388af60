"""Reading CPU tensors of any framework through DLPack, with ctypes only (no compiled extension).

``tensor.__dlpack__()`` returns a PyCapsule named "dltensor" holding a ``DLManagedTensor*``. We read its data
pointer, dtype and shape, and keep the capsule alive while the library uses the memory; the capsule's own
destructor calls the producer's deleter when it is collected (we never rename it to "used_dltensor").
"""

import ctypes


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

KDL_CPU = 1
# (type code, bits) -> hvd dtype code (hvd.h enum hvd_dtype)
_DTYPES = {
    (1, 8): 0,  # uint8
    (0, 8): 1,  # int8
    (0, 32): 2,  # int32
    (0, 64): 3,  # int64
    (2, 16): 4,  # float16
    (2, 32): 5,  # float32
    (2, 64): 6,  # float64
    (4, 16): 7,  # bfloat16
    (6, 8): 0,  # bool, read as uint8
}


class DLPackView:
    """Data pointer, hvd dtype code and shape of a CPU, C-contiguous DLPack tensor."""

    def __init__(self, tensor):
        capsule = tensor.__dlpack__()
        ptr = _get_pointer(capsule, b"dltensor")
        managed = DLManagedTensor.from_address(ptr)
        t = managed.dl_tensor
        if t.device.device_type != KDL_CPU:
            raise ValueError(
                "hvd takes CPU tensors through DLPack; this one is on device type {} (move it to the CPU first)".format(
                    t.device.device_type
                )
            )
        key = (t.dtype.code, t.dtype.bits)
        if key not in _DTYPES or t.dtype.lanes != 1:
            raise TypeError("unsupported DLPack dtype (code {}, {} bits, {} lanes)".format(key[0], key[1], t.dtype.lanes))
        self.shape = tuple(t.shape[i] for i in range(t.ndim))
        if t.strides:
            expect = 1
            for i in reversed(range(t.ndim)):
                if self.shape[i] != 1 and t.strides[i] != expect:
                    raise ValueError("hvd needs C-contiguous tensors; call .contiguous() first")
                expect *= self.shape[i]
        self.dtype = _DTYPES[key]
        self.data = (t.data or 0) + t.byte_offset
        self._capsule = capsule  # keeps the memory alive
        self._tensor = tensor
