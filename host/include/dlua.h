/* dlua's public C API: every function Lua may call. Plain declarations only (no macros,
   no includes): the build embeds this text and bindings/ hands it to ffi.cdef verbatim.
   C files include <stdint.h> and <stddef.h> before this header. */

/* Every fallible function returns a status; the message is in dlua_last_error(). */
typedef enum {
  DLUA_OK = 0,
  DLUA_ERR_ARG = 1,         /* bad argument: shapes, dtypes, ranges */
  DLUA_ERR_OOM = 2,         /* an allocation failed */
  DLUA_ERR_IO = 3,          /* a file or socket failed */
  DLUA_ERR_BACKEND = 4,     /* CUDA, cuDNN, NCCL, gloo... reported an error */
  DLUA_ERR_INTERRUPTED = 5, /* Ctrl-C arrived while the call ran */
  DLUA_ERR_TIMEOUT = 6,
  DLUA_ERR_INTERNAL = 7,
  DLUA_STATUS_COUNT = 8
} dlua_status_t;

/* The calling thread's last error message, with the C file:line that raised it. */
const char *dlua_last_error(void);
dlua_status_t dlua_last_status(void);
void dlua_clear_error(void);
const char *dlua_status_name(dlua_status_t status);

/* Versions. */
const char *dlua_version(void);
const char *dlua_cuda_build_info(void); /* "CUDA 13.0, cuDNN 9.19.0, NCCL 2.28.9" or "no CUDA" */
int dlua_has_cuda_build(void);

/* Threads used by CPU kernels (one pool, shared with oneDNN). n < 1 is an error. */
dlua_status_t dlua_set_num_threads(int n);
int dlua_get_num_threads(void);

/* Ctrl-C: the host sets the flag from its signal handler; long C loops poll it and
   return DLUA_ERR_INTERRUPTED. */
void dlua_interrupt_set(int on);
int dlua_interrupt_pending(void);
