/* hvd.h: the C ABI of libhvd_runtime.so, the hvd worker runtime (a Horovod-style engine).
 *
 * One engine per process, started by hvd_init() from the environment (HVD_RANK, HVD_SIZE, HVD_RENDEZVOUS,
 * HVD_JOB_TOKEN... as set by `hvd run`; MPI and Slurm variables; no variables at all = a job of one rank).
 * Operations are named and asynchronous: hvd_enqueue() returns a handle, hvd_wait()/hvd_poll() complete it.
 * Every rank must submit the same names; the order may differ between ranks.
 *
 * Errors: functions returning int return -1 (or a negative handle) on failure; hvd_last_error() then holds a
 * message for the calling thread, hvd_last_error_kind() what kind of failure it was (enum hvd_error_kind) and
 * hvd_last_error_rank() the rank a lost peer names. No function unwinds or aborts on bad input.
 *
 * Buffers: `input` and `output` must stay valid and unmodified until the handle completes. Allreduce and broadcast
 * write their result to `output` (which may equal `input`); allgather, alltoall and reducescatter results are
 * owned by the library: read their shape with hvd_result_ndim/hvd_result_shape, copy them with hvd_result_copy,
 * then hvd_release() the handle. Release every handle after hvd_wait(), successful or not.
 *
 * Compatibility: the numeric codes below never change; new fields are only ever appended to hvd_request_t.
 */
#ifndef HVD_H
#define HVD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types (hvd_request_t.dtype). Little-endian, as the CPU holds them. */
enum hvd_dtype {
  HVD_UINT8 = 0,
  HVD_INT8 = 1,
  HVD_INT32 = 2,
  HVD_INT64 = 3,
  HVD_FLOAT16 = 4,
  HVD_FLOAT32 = 5,
  HVD_FLOAT64 = 6,
  HVD_BFLOAT16 = 7
};

/* Reductions (hvd_request_t.op). Average divides the sum by the number of ranks (integers round to nearest). */
enum hvd_reduce_op { HVD_SUM = 0, HVD_AVERAGE = 1, HVD_MIN = 2, HVD_MAX = 3, HVD_PRODUCT = 4 };

/* Operations (hvd_request_t.kind). */
enum hvd_op_kind {
  HVD_ALLREDUCE = 0,     /* output: same shape as input */
  HVD_ALLGATHER = 1,     /* concatenation along dim 0; ranks may differ in dim 0; library-owned result */
  HVD_BROADCAST = 2,     /* root's input to every rank's output */
  HVD_ALLTOALL = 3,      /* rows splits[j] of dim 0 go to rank j (NULL splits: even); library-owned result */
  HVD_REDUCESCATTER = 4, /* reduce, then rank r keeps its block of dim 0 (first dim % size ranks get one more row) */
  HVD_BARRIER = 5,
  HVD_JOIN = 6           /* this rank has no more data: it contributes zeros/identity until every rank joined;
                            hvd_result_value() = the rank that joined last */
};

typedef struct hvd_request {
  int32_t kind;          /* enum hvd_op_kind */
  const char *name;      /* NUL-terminated, unique among pending operations; NULL: "<op>.noname.<n>" */
  int32_t dtype;         /* enum hvd_dtype */
  int32_t ndim;
  const int64_t *shape;  /* ndim values */
  const void *input;     /* product(shape) elements; NULL for barrier and join */
  void *output;          /* allreduce, broadcast: product(shape) elements (may equal input); others: NULL */
  int32_t op;            /* enum hvd_reduce_op (allreduce, reducescatter) */
  int32_t root;          /* broadcast root rank */
  double prescale;       /* input multiplied by this before the reduction (1.0: none) */
  double postscale;      /* result multiplied by this after the reduction (1.0: none) */
  const int64_t *splits; /* alltoall: nsplits == size row counts, or NULL; NULL for other kinds */
  int32_t nsplits;
} hvd_request_t;

/* Lifecycle. hvd_init is idempotent; hvd_shutdown returns once every rank has called it (until then this rank
 * takes part in the others' collectives as a joined rank). */
int hvd_init(void);
int hvd_shutdown(void);
int hvd_is_initialized(void);
/* An elastic step's worker leaves on its own (preempted, after its last commit and hvd_shutdown): the launcher's
 * rendezvous stops waiting for it and reports it as preempted. Returns the workers left alive, or -1. */
int hvd_elastic_leave(void);
const char *hvd_last_error(void);
const char *hvd_version(void);

/* The kind of the calling thread's last failure (hvd_last_error_kind; HVD_ERROR_NONE before any), and so what the
 * caller can do about it. Kinds 3, 4, 5 and 7 stop the engine: every later operation fails with the same kind. */
enum hvd_error_kind {
  HVD_ERROR_NONE = 0,
  HVD_ERROR_INVALID_ARGUMENT = 1, /* a bad argument or request, refused on this rank before anything ran */
  HVD_ERROR_MISMATCH = 2,         /* the ranks' requests disagree (name, operation, dtype, shape, root, group; a
                                     broadcast rooted at a joined rank): failed on every rank, the job goes on */
  HVD_ERROR_PEER_LOST = 3,        /* a peer died or left (hvd_last_error_rank() names it) */
  HVD_ERROR_TIMEOUT = 4,          /* no progress from some rank within HVD_COLLECTIVE_TIMEOUT */
  HVD_ERROR_STALLED = 5,          /* a rank did not submit what the others wait for (HVD_STALL_SHUTDOWN_TIME) */
  HVD_ERROR_NOT_INITIALIZED = 6,  /* no engine: hvd_init not called, or hvd_shutdown called */
  HVD_ERROR_INTERNAL = 7          /* anything else that stops the job: a broken connection, I/O, a bug */
};
int hvd_last_error_kind(void);
/* The rank the calling thread's last failure names as lost (HVD_ERROR_PEER_LOST), else -1. */
int64_t hvd_last_error_rank(void);

/* Topology; -1 when not initialized. */
int hvd_rank(void);
int hvd_size(void);
int hvd_local_rank(void);
int hvd_local_size(void);
int hvd_cross_rank(void);
int hvd_cross_size(void);

/* Build and job introspection (Horovod's mpi_built, nccl_built, mpi_enabled, is_homogeneous...).
 * hvd_build_features: what this library was compiled with, a bitmask of enum hvd_build_feature; needs no hvd_init.
 * hvd_is_homogeneous: 1 when every host runs the same number of ranks, 0 when not (gathered from every rank at
 * init), -1 when not initialized. hvd_backend: the communicator in use ("SHM", "TCP", "HIERARCHICAL", "MPI",
 * "NCCL"; "LOCAL" for a job of one rank), NULL when not initialized; valid until hvd_shutdown. */
enum hvd_build_feature {
  HVD_BUILT_MPI = 1,  /* the mpi backend (HVD_COLLECTIVE_BACKEND=mpi) */
  HVD_BUILT_NCCL = 2  /* the nccl backend (host buffers staged through the GPU; NCCL loaded at run time) */
};
int hvd_build_features(void);
int hvd_is_homogeneous(void);
const char *hvd_backend(void);

/* Shared buffers (docs/collective.md, "Single-copy allreduce"): hvd_alloc returns bytes zeroed, page-aligned bytes
 * that the other ranks on this host can map (a 0600 file under /dev/shm of this process), so that an allreduce of
 * 1 MiB or more whose buffer lies in one on every rank of a shm job reads the peers' buffers with plain loads (one
 * copy per byte instead of two through the segment). Where that fails (no /dev/shm, its size limit, a sandbox) it
 * returns private memory, logs why once, and such allreduces take the ring; NULL only when no memory could be had.
 * hvd_free gives it back (0; -1 for another pointer or a second free): no operation may still use it. Neither
 * needs hvd_init. hvd_alloc_is_shared: 1 shared, 0 the private fallback, -1 not from hvd_alloc. */
void *hvd_alloc(size_t bytes);
int hvd_free(void *ptr);
int hvd_alloc_is_shared(const void *ptr);

/* Submission: a handle > 0, or -1. hvd_enqueue_many submits n requests with one call (they reach the engine
 * together, so they run in one cycle and fuse), writes one handle (or -1) per request and returns how many
 * succeeded. With fusion on, consecutive allreduces of one dtype, op and scale factors are fused at once into one
 * negotiated tensor: every rank must submit the same group. */
int64_t hvd_enqueue(const hvd_request_t *request);
int hvd_enqueue_many(const hvd_request_t *requests, int n, int64_t *handles);
/* Process sets (Horovod's): groups of the job's ranks that run collectives among themselves, each with its own
 * negotiation (names, fusion, response cache, stall inspection) and communicator. hvd_add_process_set is collective
 * over the job: every rank calls it with the same n global ranks (any order; no duplicates, all in the job, not
 * every rank, not an existing set), in the same order as its other adds; returns the set's id (> 0, the same on
 * every rank) or -1 (HVD_ERROR_INVALID_ARGUMENT: refused ranks; HVD_ERROR_MISMATCH: the ranks asked for different
 * sets). hvd_remove_process_set is collective the same way: every rank calls it with the same id, in the same
 * order as its adds and removes (0, or -1: HVD_ERROR_MISMATCH when the ranks asked to remove different sets or one
 * asked to add, HVD_ERROR_INVALID_ARGUMENT for an unknown set or the global set 0, HVD_ERROR_STALLED when the
 * set's engine did not stop within 60 s; hvd_shutdown reports the same). The order of a set's ranks is not part of
 * it: [1, 0] and [0, 1] are one set (as in Horovod, which sorts them).
 * hvd_process_set_rank: this rank's position among the set's ranks (-1 when not a member); hvd_process_set_size;
 * hvd_process_set_ranks writes up to capacity ranks (ascending) and returns how many the set has. Id 0 is the
 * global set. hvd_enqueue_ps / hvd_enqueue_many_ps submit over a set this rank is a member of (a broadcast's root
 * is the root's rank in the set); their handles are waited for like any other. hvd_shutdown removes every set. */
int hvd_add_process_set(const int64_t *ranks, int n);
int hvd_remove_process_set(int id);
int hvd_process_set_rank(int id);
int hvd_process_set_size(int id);
int hvd_process_set_ranks(int id, int64_t *ranks, int capacity);
int64_t hvd_enqueue_ps(const hvd_request_t *request, int process_set);
int hvd_enqueue_many_ps(const hvd_request_t *requests, int n, int64_t *handles, int process_set);
/* The same requests again and again (a training loop's gradients): hvd_group_prepare checks and fuses them once and
 * returns a group id > 0 (-1: a request is invalid); hvd_group_enqueue submits the group, writes its n handles and
 * returns n (-1 on error); hvd_group_release forgets it (0, or -1 for an unknown id). The buffers must stay valid
 * until the group is released; hvd_shutdown releases every group. */
int64_t hvd_group_prepare(const hvd_request_t *requests, int n);
int hvd_group_enqueue(int64_t group, int64_t *handles);
int hvd_group_release(int64_t group);
/* Submits a prepared group as one operation: returns one handle (> 0) for all of its requests (wait with
 * hvd_wait_and_release), 0 when the group was not fused into one operation (use hvd_group_enqueue), -1 on error. */
int64_t hvd_group_submit(int64_t group);
/* Per-tensor in-place allreduces batched by the caller, in columns: data[i] (input and output), dtypes[i], ops[i],
 * prescale[i], postscale[i]; ndims[i] dimensions each, one request after another in dims; names: n NUL-terminated
 * names back to back ("" = unnamed). Nothing is fused at submission (each is negotiated alone and fused by the
 * engine), so ranks may batch the same tensors differently. Writes one handle (or -1) per request; returns how
 * many succeeded. */
int hvd_enqueue_allreduces(int n, void *const *data, const int32_t *dtypes, const int32_t *ndims,
                           const int64_t *dims, const char *names, const int32_t *ops, const double *prescale,
                           const double *postscale, int64_t *handles);

/* Timeline at run time (Horovod's start_timeline/stop_timeline), like HVD_TIMELINE: every rank calls them; rank 0
 * writes the file ({rank} in the path: every rank its own). Start replaces a timeline being written; when stop
 * returns, the file is complete. 0, or -1 (hvd_last_error). */
int hvd_start_timeline(const char *path, int mark_cycles);
int hvd_stop_timeline(void);

/* Completion. hvd_poll: 1 done, 0 pending, -1 unknown handle. hvd_wait: 0 success, -1 failure (message in
 * hvd_last_error; e.g. ranks disagreeing on the shape, a dead peer, a stall shutdown). */
int hvd_poll(int64_t handle);
int hvd_wait(int64_t handle);
/* hvd_wait + hvd_release in one call, for operations whose result is in the caller's memory (allreduce,
 * broadcast, barrier): 0 success, -1 failure. */
int hvd_wait_and_release(int64_t handle);
/* Groups (e.g. the handles of one hvd_enqueue_many; entries <= 0 are skipped), for operations whose results are in
 * the caller's memory: hvd_wait_many waits for all n with one wait and releases them (0 all succeeded, -1: the
 * first failure is in hvd_last_error; every handle is still waited for and released). hvd_poll_many: 1 when all
 * are done, 0 when any is pending, -1 for an unknown handle. */
int hvd_wait_many(const int64_t *handles, int n);
int hvd_poll_many(const int64_t *handles, int n);
/* One wait of a batch (e.g. the handles of one hvd_enqueue_allreduces; done: n bytes, zero at first, shared by
 * every wait on the batch): waits for handles[i] and releases it, then releases the handles after it that have
 * completed successfully, up to the first that has not, and marks each 1 in done (skip the wait of a handle marked
 * 1). handles[i] is marked 1 or -1 (failed); a failed handle is left for its own wait. 0 when handles[i]
 * succeeded, -1 when it failed (hvd_last_error). */
int hvd_wait_batch(const int64_t *handles, int n, int i, int8_t *done);

/* Results of a successfully waited handle, until hvd_release. */
int hvd_result_ndim(int64_t handle);
int hvd_result_shape(int64_t handle, int64_t *shape);
int64_t hvd_result_nbytes(int64_t handle);
int hvd_result_copy(int64_t handle, void *dst, int64_t nbytes);
int hvd_result_splits(int64_t handle, int64_t *splits); /* alltoall: rows received from each rank; returns how
                                                          many it wrote (size; 0 for other results) */
int64_t hvd_result_value(int64_t handle);                /* join: last joined rank */
void hvd_release(int64_t handle);

#ifdef __cplusplus
}
#endif

#endif /* HVD_H */
