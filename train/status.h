/*
 * status.h — the driver's status codes: what its functions return and what `tinymoe` exits
 * with.
 */
#ifndef TMD_STATUS_H
#define TMD_STATUS_H

/* Return values, also the process exit status. */
enum { TMD_OK = 0, TMD_RUNTIME_ERROR = 1, TMD_CONFIG_ERROR = 2 };

#endif
