/* Load generator for the uprobe tests: call ncclAllReduce N times in a tight loop.
 *
 *   nccl_loop LIBNCCL N [wait|go] [RATE]
 *
 * The communicator is a zeroed buffer, which NCCL rejects (ncclInvalidArgument) without touching
 * a GPU, so each call is the real host entry path up to the argument checks. With "wait", prints
 * "ready" and waits for a line on stdin before the loop (time for the probe to add our pid).
 * With RATE (calls per second), the loop is paced to that rate (checked every 256 calls);
 * without it, it runs flat out. Each call passes its index as `count`, so a consumer can check
 * that every call arrived exactly once.
 * Prints one line: "calls=N ns=ELAPSED rate=CALLS_PER_S ns_per_call=X ret=R".
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int (*all_reduce_t)(const void *, void *, size_t, int, int, void *, void *);

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s LIBNCCL N [wait|go] [RATE]\n", argv[0]);
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 1;
    }
    all_reduce_t all_reduce = (all_reduce_t)dlsym(lib, "ncclAllReduce");
    if (!all_reduce) {
        fprintf(stderr, "dlsym: %s\n", dlerror());
        return 1;
    }
    long n = atol(argv[2]);
    void *comm = calloc(1, 1 << 20);
    if (argc > 3 && strcmp(argv[3], "wait") == 0) {
        char line[16];
        printf("ready\n");
        fflush(stdout);
        if (!fgets(line, sizeof(line), stdin))
            return 1;
    }
    double rate = argc > 4 ? atof(argv[4]) : 0.0;
    int ret = 0;
    uint64_t t0 = now_ns();
    for (long i = 0; i < n; i++) {
        ret |= all_reduce((void *)0x1000, (void *)0x2000, (size_t)i, 7, 0, comm, (void *)0x7777);
        if (rate > 0 && (i & 255) == 255) {
            uint64_t due = t0 + (uint64_t)((double)(i + 1) * 1e9 / rate), t = now_ns();
            if (due > t)
                usleep((useconds_t)((due - t) / 1000));
        }
    }
    uint64_t dt = now_ns() - t0;
    printf("calls=%ld ns=%llu rate=%.0f ns_per_call=%.1f ret=%d\n", n, (unsigned long long)dt,
           n * 1e9 / (double)dt, (double)dt / (double)n, ret);
    return 0;
}
