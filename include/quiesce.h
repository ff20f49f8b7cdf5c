/*
 * quiesce C API: blocking transfers that return only once nothing touches the
 * caller's buffers any more, or say that they cannot know yet.
 *
 * Return codes of every transfer call:
 *    0  every task completed; the buffers are the caller's again.
 *   -1  the batch failed (or a call was refused before starting: see
 *       quiesce_last_error()); nothing touches the buffers any more.
 *   -2  completion unknown: the fence did not finish in time. Do NOT free,
 *       reuse or touch the buffers; wait on (or poll) *ticket_out until it
 *       returns 0 or -1.
 *   -3  unknown handle: a null engine, a segment handle quiesce_open never
 *       returned, or a ticket that was never issued or was already
 *       collected. Nothing was started; for a ticket this says nothing about
 *       the memory of the batch the caller meant (if it is still outstanding,
 *       keep its buffers).
 *
 * The codes speak of the caller's memory. quiesce_last_remote_confirmed()
 * says whether the targets confirmed that nothing more of the last batch
 * lands there: after a -1 write with 0 from it, bytes already sent may still
 * land in the target ranges (revoke or fence them before trusting them).
 *
 * A panic inside the engine while a call waits for its batch aborts the
 * process; one in a batch whose -2 ticket is out leaves that ticket at -2
 * (its memory stays pinned) until the engine stops, and one that ends the
 * engine's thread leaves every ticket of it at -2 for good. No call ever returns 0 or -1 without the
 * batch having quiesced.
 *
 * Link with -lquiesce_batch (the cdylib of the quiesce-batch crate).
 */
#ifndef QUIESCE_H
#define QUIESCE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a struct or a signature here changes: build against the
 * header that ships with the library (2: quiesce_options.flags, int
 * quiesce_engine_stop). */
#define QUIESCE_ABI_VERSION 2

#define QUIESCE_OK 0
#define QUIESCE_FAILED (-1)
#define QUIESCE_UNKNOWN (-2)
#define QUIESCE_UNKNOWN_HANDLE (-3)

typedef struct QuiesceEngine quiesce_engine;

typedef struct quiesce_task {
    uint32_t segment; /* handle from quiesce_open */
    uint64_t offset;  /* offset in the remote segment */
    void *buf;        /* local memory: source of a write, destination of a read */
    uint64_t len;     /* bytes */
} quiesce_task;

typedef struct quiesce_options {
    uint64_t deadline_ms;    /* 0: no deadline */
    uint64_t fence_grace_ms; /* 0: the default (200 ms), unless flags has QUIESCE_OPT_GRACE */
    int32_t fail_fast;       /* non-zero: fence the rest at the first failure */
    uint32_t retries;        /* extra attempts for failed tasks, after quiescence */
    uint32_t flags;          /* QUIESCE_OPT_* bits; 0: every default */
} quiesce_options;

/* quiesce_options.flags: fence_grace_ms is used as given, 0 included (no
 * grace: -2 at once if the fence has not finished). */
#define QUIESCE_OPT_GRACE 1u

/* Starts an engine (its own thread and runtime) named node (NULL: the
 * default name, "quiesce"; UTF-8, else refused). NULL on failure. */
quiesce_engine *quiesce_engine_start(const char *node);
/* Stops it: batches still in flight are cancelled, and it returns once every
 * operation on memory lent to the engine has been reaped: 0. -2 if that drain
 * timed out: memory lent to this engine may still be touched and must never be
 * freed or reused. A call in flight on another thread then answers -1 if the
 * drain reaped its batch, -2 if not. The handle stays valid (it is never
 * freed): a call that begins after the stop began answers -3, as for a null
 * engine, and a second stop answers what the first did. -1 in a forked child of the process
 * that started it (every call there is -1: the engine's thread is the
 * parent's, and nothing in the child touches the child's memory). */
int quiesce_engine_stop(quiesce_engine *e);

/* Connects to addr ("host:port", the host an address or a name that resolves:
 * its addresses are tried in turn) and proves token (32 hex digits) for the
 * segment named name; stores a handle in *handle_out. 0 or -1 (-3 for a null
 * engine). */
int quiesce_open(quiesce_engine *e, const char *addr, const char *name, const char *token, uint32_t *handle_out);

/* opts may be NULL (defaults); ticket_out may be NULL if -2 is not expected:
 * a -2 answered without one leaves its memory pinned for good (there is no
 * ticket to wait on), so pass one wherever the memory is to be reused.
 * A batch call takes any n > 0 (about 2 KiB per task while it runs).
 * Buffers must be host memory this process may read (a write's source) or
 * read and write (a read's destination): one that is not (a GPU device
 * pointer, a PROT_NONE reservation) is refused with -1 before anything
 * touches it, as the kernel's table of mappings says. The engine remembers
 * the spans it found good (up to 64): memory made inaccessible after a call
 * used it (mprotect, munmap and a new reservation at its addresses) is not
 * noticed, and such a buffer passed again may crash the process. */
int quiesce_transfer_sync_write(quiesce_engine *e, uint32_t segment, uint64_t offset, const void *src, uint64_t len,
                                const quiesce_options *opts, uint64_t *ticket_out);
int quiesce_transfer_sync_read(quiesce_engine *e, uint32_t segment, uint64_t offset, void *dst, uint64_t len,
                               const quiesce_options *opts, uint64_t *ticket_out);
int quiesce_batch_transfer_sync_write(quiesce_engine *e, const quiesce_task *tasks, size_t n,
                                      const quiesce_options *opts, uint64_t *ticket_out);
int quiesce_batch_transfer_sync_read(quiesce_engine *e, const quiesce_task *tasks, size_t n,
                                     const quiesce_options *opts, uint64_t *ticket_out);

/* For a -2: waits up to timeout_ms; 0 or -1 once drained, -2 if still not
 * (and always -2 in a forked child: the parent's batch may still touch the
 * ticket's memory, shared with the child if it is MAP_SHARED). */
int quiesce_ticket_wait(quiesce_engine *e, uint64_t ticket, uint64_t timeout_ms);
int quiesce_ticket_poll(quiesce_engine *e, uint64_t ticket);

/* Log events (warnings by default) to stderr: filter is tracing-subscriber
 * Targets directives ("warn", "info,quiesce_transports=debug"), or NULL for
 * $QUIESCE_LOG (default "warn"). 0, or -1 if the filter does not parse or a
 * subscriber is installed already. Call once, before starting engines. */
int quiesce_log_to_stderr(const char *filter);

/* The last error message of the calling thread ("" if none). */
const char *quiesce_last_error(void);
/* 1 if every target confirmed the last batch of this thread that returned 0
 * or -1 (nothing more of it lands there), 0 if not: a call that
 * quiesce_engine_stop cut off answers -1 with 0 here (it was never fenced).
 * A call refused before anything started (bad input) leaves it as it was. */
int quiesce_last_remote_confirmed(void);

#ifdef __cplusplus
}
#endif

#endif /* QUIESCE_H */
