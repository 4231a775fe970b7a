/*
 * forkvm-fn: the C invocation runtime for Linux guests (docs/invoke.md, libforkvm).
 * Waits on the invoke port; each request runs a handler in this process, whose reply
 * goes back through the mailbox.
 *
 *   forkvm-fn echo             reply with the request (the benchmarks' C handler)
 *   forkvm-fn info             the tests' handler, by the payload's first word:
 *                                fail TEXT   fail with TEXT (the caller gets a 500)
 *                                exit N      the runtime exits with status N
 *                                sleep S     sleep S seconds, then reply "slept"
 *                                big         try a reply one byte larger than the
 *                                            mailbox (it is refused: a 500 says so)
 *                                sh SCRIPT   run `sh -c SCRIPT` as `forkvm-fn --` does
 *                                clocks      reply "coarse_lag_ms=N": CLOCK_MONOTONIC
 *                                            less CLOCK_MONOTONIC_COARSE (the kernel's
 *                                            last tick), read first thing (vDSO)
 *                              anything else: "seq=N gen=HEX calls=N urandom=HEX
 *                              random=N input=PAYLOAD", where calls counts the
 *                              handler's calls in this process (a prime request, in a
 *                              primed warm clone, is no call), urandom is 32 bytes of getrandom()
 *                              read after the request arrived, and random a random()
 *                              value the runtime reseeds from each request's entropy
 *   forkvm-fn -- CMD [ARG...]  run CMD for each request, the payload on its stdin; its
 *                              stdout is the reply, or, when it exits non-zero, its
 *                              stderr is the error (fork and exec: guest kernel work)
 *
 * Prints "forkvm-fn: ready" on stderr before its first wait. Exits 2 when the library
 * cannot open (no mailbox, no port access); a handler that cannot reply fails instead.
 */
#define _GNU_SOURCE
#include "forkvm.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static char errbuf[4096];

/* Replies, or fails with the reason a reply could not be sent. */
static void reply_or_fail(const void *data, size_t len)
{
    int r = forkvm_reply(data, len);
    if (r == 0)
        return;
    size_t cap;
    forkvm_reply_buffer(&cap);
    snprintf(errbuf, sizeof errbuf, "forkvm-fn: a reply of %zu bytes: %s (%zu bytes fit)",
             len, forkvm_strerror(r), cap);
    forkvm_fail(errbuf);
}

static void hex(char *out, const uint8_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        sprintf(out + 2 * i, "%02x", b[i]);
}

static void command(char **argv, const uint8_t *input, size_t input_len);

/* Handler calls in this process. */
static unsigned calls;

static void info(const struct forkvm_request *req)
{
    char word[16] = {0};
    size_t w = 0;
    while (w < req->len && w < sizeof word - 1 && req->data[w] != ' ')
        word[w] = (char)req->data[w], w++;
    char arg[256] = {0};
    if (w < req->len) {
        size_t n = req->len - w - 1 < sizeof arg - 1 ? req->len - w - 1 : sizeof arg - 1;
        memcpy(arg, req->data + w + 1, n);
    }
    if (strcmp(word, "fail") == 0) {
        forkvm_fail(arg);
        return;
    }
    if (strcmp(word, "exit") == 0)
        exit(atoi(arg));
    if (strcmp(word, "sh") == 0) {
        char *sh[] = {"sh", "-c", arg, NULL};
        command(sh, NULL, 0);
        return;
    }
    if (strcmp(word, "clocks") == 0) {
        struct timespec coarse, fine;
        clock_gettime(CLOCK_MONOTONIC_COARSE, &coarse);
        clock_gettime(CLOCK_MONOTONIC, &fine);
        long long lag = (long long)(fine.tv_sec - coarse.tv_sec) * 1000 +
                        (fine.tv_nsec - coarse.tv_nsec) / 1000000;
        char out[64];
        int n = snprintf(out, sizeof out, "coarse_lag_ms=%lld", lag);
        reply_or_fail(out, (size_t)n);
        return;
    }
    if (strcmp(word, "sleep") == 0) {
        sleep((unsigned)atoi(arg));
        reply_or_fail("slept", 5);
        return;
    }
    size_t cap;
    uint8_t *buf = forkvm_reply_buffer(&cap);
    if (strcmp(word, "big") == 0) {
        reply_or_fail(buf, cap + 1);
        return;
    }
    uint8_t urandom[32];
    if (getrandom(urandom, sizeof urandom, 0) != (ssize_t)sizeof urandom) {
        snprintf(errbuf, sizeof errbuf, "forkvm-fn: getrandom: %s", strerror(errno));
        forkvm_fail(errbuf);
        return;
    }
    char uhex[65];
    hex(uhex, urandom, sizeof urandom);
    char head[192];
    int n = snprintf(head, sizeof head, "seq=%u gen=%016llx calls=%u urandom=%s random=%ld input=",
                     forkvm_clone_seq(), (unsigned long long)forkvm_generation(), calls, uhex,
                     random());
    size_t len = (size_t)n + req->len;
    /* Built in the mailbox: the input (where the request is) moves up behind the line.
     * A reply that does not fit is refused whole, never cut. */
    if (len <= cap) {
        memmove(buf + n, req->data, req->len);
        memcpy(buf, head, (size_t)n);
    }
    reply_or_fail(buf, len);
}

/* Runs argv with `input` on stdin; replies with its stdout, or fails with its stderr
 * when it exits non-zero. */
static void command(char **argv, const uint8_t *input, size_t input_len)
{
    int in = memfd_create("forkvm-fn-in", MFD_CLOEXEC);
    int out = memfd_create("forkvm-fn-out", MFD_CLOEXEC);
    int err = memfd_create("forkvm-fn-err", MFD_CLOEXEC);
    if (in < 0 || out < 0 || err < 0 ||
        write(in, input, input_len) != (ssize_t)input_len || lseek(in, 0, SEEK_SET) != 0) {
        snprintf(errbuf, sizeof errbuf, "forkvm-fn: staging the request: %s", strerror(errno));
        forkvm_fail(errbuf);
        goto out;
    }
    pid_t pid = fork();
    if (pid == 0) {
        dup2(in, 0);
        dup2(out, 1);
        dup2(err, 2);
        execvp(argv[0], argv);
        fprintf(stderr, "forkvm-fn: %s: %s", argv[0], strerror(errno));
        _exit(127);
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid) {
        snprintf(errbuf, sizeof errbuf, "forkvm-fn: running %s: %s", argv[0], strerror(errno));
        forkvm_fail(errbuf);
        goto out;
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        ssize_t k = pread(err, errbuf, sizeof errbuf - 1, 0);
        errbuf[k > 0 ? k : 0] = 0;
        if (k <= 0)
            snprintf(errbuf, sizeof errbuf, "forkvm-fn: %s ended with status %d", argv[0],
                     WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
        forkvm_fail(errbuf);
        goto out;
    }
    struct stat st;
    size_t cap;
    uint8_t *buf = forkvm_reply_buffer(&cap);
    if (fstat(out, &st) != 0) {
        forkvm_fail("forkvm-fn: cannot read the command's output");
        goto out;
    }
    if ((size_t)st.st_size > cap) {
        reply_or_fail(buf, (size_t)st.st_size);
        goto out;
    }
    ssize_t k = pread(out, buf, (size_t)st.st_size, 0);
    reply_or_fail(buf, k > 0 ? (size_t)k : 0);
out:
    if (in >= 0)
        close(in);
    if (out >= 0)
        close(out);
    if (err >= 0)
        close(err);
}

static void usage(void)
{
    fprintf(stderr, "usage: forkvm-fn echo | info | -- CMD [ARG...]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    if (argc < 2)
        usage();
    int mode = strcmp(argv[1], "echo") == 0 ? 0 : strcmp(argv[1], "info") == 0 ? 1 : -1;
    if (strcmp(argv[1], "--") == 0 && argc > 2)
        mode = 2;
    if (mode < 0)
        usage();
    int r = forkvm_open();
    if (r != 0) {
        fprintf(stderr, "forkvm-fn: %s\n", forkvm_strerror(r));
        return 2;
    }
    size_t cap;
    forkvm_reply_buffer(&cap);
    fprintf(stderr, "forkvm-fn: ready (%zu bytes fit the mailbox)\n", cap);
    /* Warm clones of a template run this loop once ahead of requests (a prime request:
     * everything but the handler), so a request finds the path in its VM's page tables. */
    forkvm_enable(FORKVM_PRIME);
    for (;;) {
        struct forkvm_request req;
        r = forkvm_wait(&req);
        if (r != 0) {
            snprintf(errbuf, sizeof errbuf, "forkvm-fn: %s", forkvm_strerror(r));
            forkvm_fail(errbuf);
            continue;
        }
        /* The runtime's own PRNG: reseeded from the host's entropy in every request. */
        unsigned seed;
        memcpy(&seed, req.entropy, sizeof seed);
        srandom(seed);
        if (req.kind == FORKVM_KIND_PRIME) {
            reply_or_fail(req.data, 0);
            continue;
        }
        calls++;
        switch (mode) {
        case 0:
            reply_or_fail(req.data, req.len);
            break;
        case 1:
            info(&req);
            break;
        default:
            command(argv + 2, req.data, req.len);
        }
    }
}
