/* A running job's control page: memory the launcher shares with its ranks (a memfd), where each rank marks the steps it finished and finds the commands `dlua attach` sends. */
#ifndef DLUA_COMM_CONTROL_H
#define DLUA_COMM_CONTROL_H
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

enum { CONTROL_CMD_BYTES = 16384, CONTROL_REPLY_BYTES = 65536, CONTROL_TEXT_BYTES = 512 };

typedef struct {
  _Atomic int64_t step;      /* the last step this rank finished (its last step boundary), -1: none yet */
  _Atomic int64_t done_seq;  /* the last command it ran (or passed over: not its rank) */
  _Atomic int32_t ok;        /* how that command ended */
  char text[CONTROL_TEXT_BYTES]; /* what it returned or raised (cut to fit): a command for every rank shows each */
} dlua_control_rank_t;

/* One page for the ranks of this node. The launcher posts a command in three moves (pending = 1; it reads
   every rank's step and picks the step the command runs at; cmd..., cmd_seq + 1, pending = 0) and a rank
   at a boundary first stores its step, then waits while pending is set: so a command for every rank
   runs at the same step on each (docs/launch.md). */
typedef struct {
  uint64_t magic;
  int32_t nproc;             /* local ranks */
  int32_t first_rank;        /* global rank of local rank 0 */
  _Atomic int32_t pending;
  _Atomic int64_t cmd_seq;   /* commands posted so far */
  int32_t cmd_target;        /* the local rank that runs it, -1: every rank, at cmd_step */
  int64_t cmd_step;
  char cmd[CONTROL_CMD_BYTES];
  _Atomic int64_t reply_seq; /* == cmd_seq once the reply below is the command's */
  char reply[CONTROL_REPLY_BYTES];  /* the target's (every rank: local rank 0's) output */
  dlua_control_rank_t rank[]; /* nproc of them */
} dlua_control_t;

/* ---- the launcher's side --------------------------------------------------------------------- */

/* A fresh page for nproc ranks in a memfd (its fd in *fd, close-on-exec), or NULL. */
dlua_control_t *dlua_control_create(int nproc, int first_rank, int *fd);
/* Every rank back to "no step yet" (a restarted job). */
void dlua_control_reset(dlua_control_t *c);
void dlua_control_destroy(dlua_control_t *c);
/* Posts a command for local rank `target` (-1: every rank, at the step after the furthest rank's).
   Returns its number, or -1 (why in err) when a command for every rank cannot be placed yet. */
int64_t dlua_control_post(dlua_control_t *c, int target, const char *code, int64_t *at_step, char *err, size_t errlen);
/* The furthest step any rank finished, -1: none; *all_started: every rank passed a boundary. */
int64_t dlua_control_max_step(const dlua_control_t *c, int *all_started);

/* ---- a rank's side: dlua.h's "running job" section (dlua_control_available, _boundary...) ------ */

/* Takes DLUA_CONTROL_FD out of the environment and maps the page, once at startup. */
void dlua_control_rank_init(void);

#endif
