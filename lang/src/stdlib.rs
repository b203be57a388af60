//! The standard library: recipes written in .hvd (the `stdlib/` folder), embedded into the binary.
//! `import std` binds every top-level `let` of these files (names starting with `_` stay private).

/// `(file name, source)` of every stdlib file, in a fixed order.
pub const FILES: &[(&str, &str)] = &[
    ("python.hvd", include_str!("../../stdlib/python.hvd")),
    (
        "tensorflow.hvd",
        include_str!("../../stdlib/tensorflow.hvd"),
    ),
    ("torch.hvd", include_str!("../../stdlib/torch.hvd")),
    ("jax.hvd", include_str!("../../stdlib/jax.hvd")),
    ("horovod.hvd", include_str!("../../stdlib/horovod.hvd")),
    ("gcc.hvd", include_str!("../../stdlib/gcc.hvd")),
    ("cmake.hvd", include_str!("../../stdlib/cmake.hvd")),
    ("nccl.hvd", include_str!("../../stdlib/nccl.hvd")),
    ("cuda.hvd", include_str!("../../stdlib/cuda.hvd")),
];
