/* Checkpoint jobs: snapshots of tensors in host memory and the steps (files, signals, waits, removals) a save runs, on the caller's thread or a background one. */
#ifndef DLUA_IO_CKPT_JOB_H
#define DLUA_IO_CKPT_JOB_H
#include "core/api.h"

/* Snapshot copies larger than this are split over the OpenMP threads. */
enum { DLUA_CKPT_COPY_CHUNK = 4 << 20 };
/* How often a wait step polls the store (milliseconds): one short request each, so the store
   client, shared with the training thread, is never held for long. */
enum { DLUA_CKPT_POLL_MS = 5 };

#endif
