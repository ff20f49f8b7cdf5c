/* Drives the C ABI against a live target: argv = addr kv_token ro_token. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "quiesce.h"

#define CHECK(cond, ...)                                  \
    do {                                                  \
        if (!(cond)) {                                    \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                 \
            fprintf(stderr, " (%s)\n", quiesce_last_error()); \
            return 1;                                     \
        }                                                 \
    } while (0)

int main(int argc, char **argv) {
    if (argc != 4) return 2;
    CHECK(quiesce_log_to_stderr("quiesce_batch=loud") == -1, "a bad log filter refused");
    CHECK(strstr(quiesce_last_error(), "not a log filter") != NULL, "the bad filter's error");
    CHECK(quiesce_log_to_stderr("info") == 0, "logs to stderr");
    CHECK(quiesce_log_to_stderr(NULL) == -1, "a second subscriber refused");
    quiesce_engine *e = quiesce_engine_start("c-test");
    CHECK(e != NULL, "engine start");
    uint32_t kv = 99, ro = 99;
    CHECK(quiesce_open(e, argv[1], "kv", argv[2], &kv) == 0, "open kv");
    CHECK(quiesce_open(e, argv[1], "ro", argv[3], &ro) == 0, "open ro");
    CHECK(quiesce_open(e, argv[1], "kv", "00000000000000000000000000000000", &kv) == -1, "wrong token refused");
    /* A host name resolves ("localhost" may be ::1 first: each address is tried). */
    char named[64];
    snprintf(named, sizeof named, "localhost%s", strrchr(argv[1], ':'));
    uint32_t by_name = 0;
    CHECK(quiesce_open(e, named, "kv", argv[2], &by_name) == 0, "open by host name");
    CHECK(quiesce_open(e, "no-such-host.invalid:1", "kv", argv[2], &by_name) == -1, "a name that does not resolve");

    size_t len = 1 << 20;
    unsigned char *src = malloc(len), *dst = malloc(len);
    for (size_t i = 0; i < len; i++) src[i] = (unsigned char)(i * 7 + 1);
    memset(dst, 0, len);

    CHECK(quiesce_transfer_sync_write(e, kv, 4096, src, len, NULL, NULL) == 0, "write");
    CHECK(quiesce_transfer_sync_read(e, kv, 4096, dst, len, NULL, NULL) == 0, "read");
    CHECK(memcmp(src, dst, len) == 0, "read back differs");

    /* A batch with a refused task: -1, and the buffers are ours again. */
    quiesce_task tasks[2] = {
        {ro, 0, src, 4096},
        {kv, 0, src, len},
    };
    quiesce_options ff = {0, 0, 1, 0};
    uint64_t ticket = 0;
    CHECK(quiesce_batch_transfer_sync_write(e, tasks, 2, &ff, &ticket) == -1, "refused batch fails");
    CHECK(strlen(quiesce_last_error()) > 0, "an error message");
    /* Refused and fenced by a live target: it confirmed that nothing more lands. */
    CHECK(quiesce_last_remote_confirmed() == 1, "a live target confirms the failed batch");
    memset(src, 0xEE, len); /* reuse at once: nothing touches it any more */

    quiesce_task reads[1] = {{kv, 4096, dst, len}};
    CHECK(quiesce_batch_transfer_sync_read(e, reads, 1, NULL, NULL) == 0, "batch read");

    /* More tasks than a Rust batch holds by default (4,096): a C caller's
       array is its own bound, as Mooncake's callers' lists are. */
    size_t many = 5000, piece = 128;
    quiesce_task *lots = calloc(many, sizeof *lots);
    CHECK(lots != NULL, "calloc");
    for (size_t i = 0; i < many; i++) {
        quiesce_task t = {kv, i * piece, src + i * piece, piece};
        lots[i] = t;
    }
    memset(src, 0x5C, many * piece);
    CHECK(quiesce_batch_transfer_sync_write(e, lots, many, NULL, NULL) == 0, "a batch of 5000 tasks");
    memset(dst, 0, len);
    CHECK(quiesce_transfer_sync_read(e, kv, 0, dst, many * piece, NULL, NULL) == 0, "read the 5000 back");
    CHECK(memcmp(src, dst, many * piece) == 0, "the 5000 tasks' bytes");
    free(lots);

    /* Memory this process may not touch (CUDA reserves device memory so):
       refused with -1 and a message, before anything copies from it or
       into it. A small batch's bytes are copied on the caller's thread:
       that copy killed the process. */
    size_t gap = 1 << 16;
    unsigned char *none = mmap(NULL, gap, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(none != MAP_FAILED, "mmap");
    CHECK(quiesce_transfer_sync_write(e, kv, 0, none, 4096, NULL, NULL) == -1, "an inaccessible source refused");
    CHECK(strstr(quiesce_last_error(), "not memory this process") != NULL, "the inaccessible source's error");
    CHECK(quiesce_transfer_sync_read(e, kv, 0, none, 4096, NULL, NULL) == -1, "an inaccessible destination refused");
    quiesce_task half[2] = {
        {kv, 0, src, 4096},
        {kv, 4096, none + gap - 2048, 4096},
    };
    CHECK(quiesce_batch_transfer_sync_write(e, half, 2, NULL, NULL) == -1, "a batch with one inaccessible buffer refused");
    munmap(none, gap);

    /* A write's source need only be readable (a PROT_READ file mapping, a
       constant): taken. A read's destination must be writable: refused. */
    unsigned char *ro_map = mmap(NULL, gap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(ro_map != MAP_FAILED, "mmap");
    memset(ro_map, 0x3C, 4096);
    CHECK(mprotect(ro_map, gap, PROT_READ) == 0, "mprotect");
    CHECK(quiesce_transfer_sync_write(e, kv, 0, ro_map, 4096, NULL, NULL) == 0, "a write from read-only memory");
    CHECK(quiesce_transfer_sync_read(e, kv, 0, ro_map, 4096, NULL, NULL) == -1, "a read into read-only memory refused");
    munmap(ro_map, gap);

    /* An unknown ticket must not read as "drained" (-1): it has its own code. */
    CHECK(quiesce_ticket_poll(e, 12345) == QUIESCE_UNKNOWN_HANDLE, "unknown ticket");
    CHECK(quiesce_ticket_wait(e, 12345, 1) == QUIESCE_UNKNOWN_HANDLE, "unknown ticket (wait)");
    CHECK(quiesce_transfer_sync_write(e, 77, 0, src, 16, NULL, NULL) == QUIESCE_UNKNOWN_HANDLE, "unknown segment handle");
    CHECK(quiesce_transfer_sync_write(NULL, kv, 0, src, 16, NULL, NULL) == QUIESCE_UNKNOWN_HANDLE, "null engine");

    CHECK(quiesce_engine_stop(e) == 0, "stop drains every op on lent memory");
    CHECK(quiesce_engine_stop(NULL) == QUIESCE_UNKNOWN_HANDLE, "stop of a null engine");
    free(src);
    free(dst);
    printf("c abi: ok\n");
    return 0;
}
