/*
 * INTERNAL: the one interface between libsfsync.so and its LD_PRELOAD shim
 * libsfsync_shim.so (shim/). Not part of the public ABI and not installed:
 * the function below is exported in the private version node
 * SFSYNC_PRIVATE_0.2, never in the stable node SFSYNC_1, and the shim looks
 * it up with dlvsym(name, "SFSYNC_PRIVATE_0.2"), so that a libsfsync.so
 * without it makes the shim pass every call through instead of failing to
 * load. A change of the struct or of the meaning of a field is a new
 * function (sf_internal_window_state_v2) in a new private node.
 *
 * libsfsync.so publishes the window state of a context; every policy of the
 * shim (which all-reduces are gradients, which are deferred, pass tracking,
 * probing, the warnings and the report) lives in the shim's own library.
 */
#ifndef SFSYNC_INTERNAL_H
#define SFSYNC_INTERNAL_H

#include <stdint.h>

#include "sfsync.h"

#ifdef __cplusplus
extern "C" {
#endif

/** The version node of the private interface. */
#define SF_INTERNAL_NODE "SFSYNC_PRIVATE_0.2"

/** A snapshot of one context's accumulation-window state. */
typedef struct sf_window_state_v1 {
  uint64_t struct_size;        /* in: sizeof(sf_window_state_v1) */
  int32_t context_made;        /* 0: the default context was not made yet (all else 0) */
  int32_t in_window;           /* 1 inside a window */
  int64_t windows_begun;       /* sf_begin_accumulation calls that succeeded; read after
                                  in_window, so a snapshot inside a window holds its number */
  int64_t windows_ended;       /* sf_end_accumulation calls that succeeded */
  int64_t refused_begins;      /* sf_begin_accumulation calls refused inside a window
                                  (a forgotten sf_end_accumulation) */
  int64_t refused_begin_window;/* the window that was open at the latest refusal */
  int64_t gradients;           /* gradients registered with the context */
  int32_t strict;              /* SF_STRICT=1 (read once by libsfsync) */
  int32_t reserved;            /* 0 */
} sf_window_state_v1;

/** flags: the caller acts on the windows of `ctx` (NULL: of the default
 *  context, also if it is made later), as the shim does from its load on:
 *  libsfsync then does not say that they affect nothing. */
#define SF_INTERNAL_FOLLOW 1

/**
 * Fill `out` with the window state of `ctx`, or of the process's default
 * context when `ctx` is NULL (never made by this call: context_made 0 until
 * the host makes it). Cheap (a few atomic loads): the shim calls it for every
 * gradient all-reduce. SF_ERR_INVALID_ARGUMENT for a NULL `out` or a
 * struct_size other than sizeof(sf_window_state_v1); unknown flags
 * bits are ignored. Thread-safe. Since 0.2 (private).
 */
SF_API sf_status sf_internal_window_state_v1(const sf_context* ctx, int32_t flags,
                                             sf_window_state_v1* out);

#ifdef __cplusplus
}
#endif

#endif /* SFSYNC_INTERNAL_H */
