/* `dlua attach PID|JOBDIR`: a REPL into a running job of `dlua --nproc` through its launcher's Unix socket. */
#ifndef DLUA_ATTACH_H
#define DLUA_ATTACH_H

/* argv[0] is "attach". Returns the process's exit status. */
int dlua_attach_main(int argc, char **argv);

#endif
