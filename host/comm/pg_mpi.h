/* The MPI backend of process groups (pg_mpi.c) and this process' MPI state, shared by its groups (pg_mpi_world.c). */
#ifndef DLUA_COMM_PG_MPI_H
#define DLUA_COMM_PG_MPI_H
#include <mpi.h>

#include "comm/pg_backend.h"

dlua_status_t dlua_pg_mpi_open(const dlua_pg_open_t *args, const dlua_pg_backend_t **be, void **ctx);

/* ---- the process' MPI (pg_mpi_world.c) --------------------------------------------------------------- */

typedef struct {
  int rank, size;          /* in MPI_COMM_WORLD */
  int tag_ub;              /* the largest tag send/recv may use */
  int cuda_aware;          /* the library takes device pointers (MPIX_Query_cuda_support), and DLUA_MPI_CUDA is not 0 */
  char version[256];       /* MPI_Get_library_version's first line */
} dlua_mpi_process_t;

/* Initialises MPI once, on the calling thread (which must be the one that exits the process: MPI_Finalize
   runs in an exit handler there), with MPI_THREAD_MULTIPLE. An error is recorded and returned. */
dlua_status_t dlua_mpi_init(void);
/* After dlua_mpi_init. */
const dlua_mpi_process_t *dlua_mpi_process(void);
/* The MPI type whose elements are dt's (f16, bf16: 16-bit words, reduced by dlua's own functions). */
MPI_Datatype dlua_mpi_datatype(dlua_dtype_t dt);
/* The MPI op for (op, dt): MPI's own (sum, product of f32/f64 and integers; bool as max/min of 0/1 bytes) or
   one of dlua's element functions (max/min of floats: NaN wins, as on gloo; f16/bf16: computed in f32). AVG is
   the sum; the caller divides. */
MPI_Op dlua_mpi_op(dlua_reduce_t op, dlua_dtype_t dt);
/* "MPI_ERR_TRUNCATE: message truncated" for an MPI error code. */
void dlua_mpi_error_text(int code, char *buf, size_t n);
/* For the exit handler: a collective could not be finished (MPI_Finalize would wait for it forever), or a
   peer was lost first (this rank's failure is a consequence). */
void dlua_mpi_note_failure(int peer_lost);
/* Installs (once, after MPI_Init: chained to MPI's own handlers) the note a rank prints when it crashes inside an
   MPI call of a collective: which one, and what usually causes it. */
void dlua_mpi_crash_note_install(void);

#endif
