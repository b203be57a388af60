//! The content-addressed store: derivations, fetch/verify/unpack, sandboxed builds, env assembly, gc.
