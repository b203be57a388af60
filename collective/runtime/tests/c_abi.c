/* Drives libhvd_runtime.so through include/hvd.h as a C program would (a job of one rank). */
#include <stdio.h>
#include <string.h>

#include "hvd.h"

#define CHECK(cond)                                                                     \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      fprintf(stderr, "check failed at line %d: %s (%s)\n", __LINE__, #cond, hvd_last_error()); \
      return 1;                                                                         \
    }                                                                                   \
  } while (0)

/* A request (sum, no scaling): the fields every test request sets. */
static hvd_request_t request(int32_t kind, const char *name, int32_t dtype, int32_t ndim, const int64_t *shape,
                             const void *input, void *output) {
  hvd_request_t r;
  memset(&r, 0, sizeof r);
  r.kind = kind;
  r.name = name;
  r.dtype = dtype;
  r.ndim = ndim;
  r.shape = shape;
  r.input = input;
  r.output = output;
  r.op = HVD_SUM;
  r.prescale = 1.0;
  r.postscale = 1.0;
  return r;
}

int main(void) {
  CHECK(hvd_is_initialized() == 0);
  CHECK(hvd_last_error_kind() == HVD_ERROR_NONE && hvd_last_error_rank() == -1);
  CHECK(hvd_rank() == -1 && strlen(hvd_last_error()) > 0);
  CHECK(hvd_last_error_kind() == HVD_ERROR_NOT_INITIALIZED);
  CHECK((hvd_build_features() & ~(HVD_BUILT_MPI | HVD_BUILT_NCCL)) == 0);
  CHECK(hvd_is_homogeneous() == -1 && hvd_backend() == NULL);
  CHECK(hvd_init() == 0 && hvd_init() == 0);
  CHECK(hvd_is_initialized() == 1 && hvd_size() == 1 && hvd_rank() == 0 && hvd_local_size() == 1);
  CHECK(hvd_is_homogeneous() == 1 && hvd_backend() != NULL && strcmp(hvd_backend(), "LOCAL") == 0);

  float x[3] = {1.0f, 2.0f, 3.0f}, y[3] = {0};
  int64_t shape[1] = {3};
  hvd_request_t r = request(HVD_ALLREDUCE, "x", HVD_FLOAT32, 1, shape, x, y);
  r.prescale = 2.0;
  int64_t h = hvd_enqueue(&r);
  CHECK(h > 0);
  CHECK(hvd_wait(h) == 0 && hvd_poll(h) == 1);
  hvd_release(h);
  CHECK(y[0] == 2.0f && y[1] == 4.0f && y[2] == 6.0f);

  /* Process sets in a job of one rank: the global set is id 0 (over it, hvd_enqueue_ps is hvd_enqueue); a set of
   * every rank exists already; an unknown set is refused. */
  int64_t every[1] = {0}, members[2] = {-1, -1};
  CHECK(hvd_process_set_size(0) == 1 && hvd_process_set_rank(0) == 0);
  CHECK(hvd_process_set_ranks(0, members, 2) == 1 && members[0] == 0 && members[1] == -1);
  CHECK(hvd_add_process_set(every, 1) == -1 && hvd_last_error_kind() == HVD_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(hvd_last_error(), "exists already") != NULL);
  CHECK(hvd_process_set_size(7) == -1 && hvd_last_error_kind() == HVD_ERROR_INVALID_ARGUMENT);
  CHECK(hvd_remove_process_set(0) == -1 && hvd_enqueue_ps(&r, 7) == -1);
  h = hvd_enqueue_ps(&r, 0);
  CHECK(h > 0 && hvd_wait_and_release(h) == 0);

  /* A group: one submission call, one wait. */
  float a[2] = {1.0f, 2.0f}, b[1] = {5.0f};
  int64_t sa[1] = {2}, sb[1] = {1};
  hvd_request_t group[2];
  memset(group, 0, sizeof group);
  group[0] = r;
  group[0].name = "ga";
  group[0].shape = sa;
  group[0].input = a;
  group[0].output = a;
  group[0].prescale = 1.0;
  group[1] = group[0];
  group[1].name = "gb";
  group[1].shape = sb;
  group[1].input = b;
  group[1].output = b;
  int64_t hs[2];
  CHECK(hvd_enqueue_many(group, 2, hs) == 2 && hs[0] > 0 && hs[1] > 0);
  CHECK(hvd_wait_many(hs, 2) == 0);
  CHECK(a[0] == 1.0f && a[1] == 2.0f && b[0] == 5.0f);
  CHECK(hvd_poll_many(hs, 2) == -1); /* released */
  group[1].dtype = 42;
  CHECK(hvd_enqueue_many(group, 2, hs) == 1 && hs[0] > 0 && hs[1] == -1);
  CHECK(strstr(hvd_last_error(), "dtype") != NULL && hvd_last_error_kind() == HVD_ERROR_INVALID_ARGUMENT);
  CHECK(hvd_wait_many(hs, 2) == 0);

  /* A prepared group: checked once (an invalid request is refused), submitted again and again, released. */
  CHECK(hvd_group_prepare(group, 2) == -1 && strstr(hvd_last_error(), "dtype") != NULL);
  group[1].dtype = HVD_FLOAT32;
  int64_t g = hvd_group_prepare(group, 2);
  CHECK(g > 0);
  for (int i = 0; i < 3; i++) {
    a[0] = 1.0f + i;
    b[0] = 5.0f;
    CHECK(hvd_group_enqueue(g, hs) == 2 && hs[0] > 0 && hs[1] == hs[0] + 1);
    CHECK(hvd_wait_many(hs, 2) == 0);
    CHECK(a[0] == 1.0f + i && a[1] == 2.0f && b[0] == 5.0f);
  }
  /* Fused into one operation: it can also go as one handle. */
  for (int i = 0; i < 2; i++) {
    a[0] = 3.0f + i;
    int64_t whole = hvd_group_submit(g);
    CHECK(whole > 0 && hvd_wait_and_release(whole) == 0);
    CHECK(a[0] == 3.0f + i && a[1] == 2.0f && b[0] == 5.0f);
  }
  CHECK(hvd_group_release(g) == 0);
  CHECK(hvd_group_release(g) == -1 && strstr(hvd_last_error(), "unknown tensor group") != NULL);
  CHECK(hvd_group_enqueue(g, hs) == -1 && strstr(hvd_last_error(), "unknown tensor group") != NULL);
  CHECK(hvd_group_submit(g) == -1 && strstr(hvd_last_error(), "unknown tensor group") != NULL);
  /* Two operations (different reduce ops do not fuse): no single handle, one per request. */
  group[1].op = HVD_MAX;
  g = hvd_group_prepare(group, 2);
  CHECK(g > 0 && hvd_group_submit(g) == 0);
  CHECK(hvd_group_enqueue(g, hs) == 2 && hvd_wait_many(hs, 2) == 0);
  CHECK(a[0] == 4.0f && b[0] == 5.0f);
  CHECK(hvd_group_release(g) == 0);
  group[1].op = group[0].op;

  /* Timelines at run time: bad paths are errors; stopping without one is fine. */
  CHECK(hvd_start_timeline(NULL, 0) == -1 && strstr(hvd_last_error(), "null") != NULL);
  CHECK(hvd_start_timeline("/nonexistent-hvd-dir/t.json", 1) == -1 && strstr(hvd_last_error(), "timeline") != NULL);
  CHECK(hvd_last_error_kind() == HVD_ERROR_INVALID_ARGUMENT);
  CHECK(hvd_stop_timeline() == 0);

  /* A library-owned result. */
  int64_t rows[2] = {2, 1};
  int32_t data[2] = {7, 8};
  r = request(HVD_ALLGATHER, "g", HVD_INT32, 2, rows, data, NULL);
  h = hvd_enqueue(&r);
  CHECK(h > 0 && hvd_wait(h) == 0);
  int64_t out_shape[2];
  CHECK(hvd_result_ndim(h) == 2 && hvd_result_shape(h, out_shape) == 0);
  CHECK(out_shape[0] == 2 && out_shape[1] == 1 && hvd_result_nbytes(h) == 8);
  int32_t out[2];
  CHECK(hvd_result_copy(h, out, 8) == 0 && out[0] == 7 && out[1] == 8);
  hvd_release(h);

  /* Bad input is an error with a message, not a crash. */
  r.dtype = 99;
  CHECK(hvd_enqueue(&r) == -1 && strstr(hvd_last_error(), "dtype") != NULL);
  CHECK(hvd_enqueue(NULL) == -1);
  CHECK(hvd_wait(123456) == -1 && strstr(hvd_last_error(), "unknown handle") != NULL);
  CHECK(hvd_last_error_kind() == HVD_ERROR_INVALID_ARGUMENT && hvd_last_error_rank() == -1);

  CHECK(hvd_shutdown() == 0 && hvd_is_initialized() == 0);
  r.dtype = HVD_INT32;
  CHECK(hvd_enqueue(&r) == -1 && hvd_last_error_kind() == HVD_ERROR_NOT_INITIALIZED);
  CHECK(hvd_is_homogeneous() == -1 && hvd_backend() == NULL);
  printf("ok %s\n", hvd_version());
  return 0;
}
