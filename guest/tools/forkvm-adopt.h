/*
 * forkvm-adopt.h: what a clone does after the clone point to take its own identity:
 * reseed the kernel RNG from the host, discard what /dev/hwrng buffered before the clone
 * point, put the wall clock on the host's, and apply the identity block's network
 * identity. `forkvm-clone --adopt` runs it, and so does forkvm-agent, in its own
 * process, before its first command in a new clone (a process of its own cost half a
 * second per clone on the PVM host, docs/benchmarks.md). Nothing here exits: errors go
 * to stderr and come back as a status, so a long-running agent can call it.
 */
#ifndef FORKVM_ADOPT_H
#define FORKVM_ADOPT_H

#include "forkvm-ports.h"
#include "forkvm.h" /* forkvm_net_apply (libforkvm) */

#include <linux/random.h>
#include <sys/ioctl.h>
#include <sys/timex.h>
#include <time.h>

#define RESEED_BYTES 64

/* Whether this VM's kernel CRNG is registered with the VMM (the CRNG port reads 1),
 * which then rekeys it in every clone before the clone runs (docs/clone-uniqueness.md).
 * Only looked at with ioperm: /dev/port reads ports a byte at a time. */
static inline int crng_rekeyed_by_vmm(int mode)
{
    return mode == PORTS_IOPERM && inl(CRNG_PORT) == 1;
}

/* Reseeds the kernel CRNG with host entropy: into the input pool, so that every later
 * reseed of the clone's differs from its siblings', and the CRNG reseeded from it at
 * once unless the VMM rekeyed it already (a reseed forced here is about 29,000 emulated
 * guest kernel instructions on the PVM host); returns 0 or -1 (reason on stderr). */
static inline int reseed(int mode)
{
    struct {
        int entropy_count;
        int buf_size;
        uint32_t buf[RESEED_BYTES / 4];
    } pool;
    for (int i = 0; i < RESEED_BYTES / 4; i++) {
        uint32_t v = 0;
        if (mode == PORTS_IOPERM) {
            v = inl(ENTROPY_PORT);
        } else {
            for (int b = 0; b < 4; b++) {
                uint8_t byte;
                if (ports_read(mode, ENTROPY_PORT, &byte, 1) != 0) {
                    perror("forkvm: /dev/port read");
                    return -1;
                }
                v = (v << 8) | byte;
            }
        }
        pool.buf[i] = v;
    }
    pool.entropy_count = RESEED_BYTES * 8;
    pool.buf_size = RESEED_BYTES;
    int fd = open("/dev/urandom", O_RDWR | O_CLOEXEC);
    if (fd < 0 || ioctl(fd, RNDADDENTROPY, &pool) != 0 ||
        (!crng_rekeyed_by_vmm(mode) && ioctl(fd, RNDRESEEDCRNG) != 0)) {
        perror("forkvm: reseeding the kernel RNG");
        if (fd >= 0)
            close(fd);
        return -1;
    }
    close(fd);
    return 0;
}

/* The host's CLOCK_REALTIME in ns (the first read latches it, the second reads the
 * rest); 0 or -1. */
static inline int host_clock(int mode, int64_t *ns)
{
    uint8_t b[8];
    if (ports_read(mode, CLOCK_PORT, b, 8) != 0) {
        perror("forkvm: /dev/port read");
        return -1;
    }
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | b[i];
    *ns = (int64_t)v;
    return 0;
}

static inline int64_t realtime_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/*
 * Host wall clock minus the guest's, in ns, in *off; *window is the reading's
 * uncertainty (half the guest time around the port read; the best of a few tries).
 * 0, or -1 when the host clock cannot be read.
 */
#define CLOCK_TRIES 8
static inline int clock_offset(int mode, int64_t *off, int64_t *window)
{
    *off = 0;
    *window = INT64_MAX;
    for (int i = 0; i < CLOCK_TRIES; i++) {
        int64_t before = realtime_ns(), host;
        if (host_clock(mode, &host) != 0)
            return -1;
        int64_t after = realtime_ns();
        if (host == 0 || host == -1) {
            fprintf(stderr, "forkvm: the VMM has no host clock port\n");
            return -1;
        }
        if ((after - before) / 2 < *window) {
            *window = (after - before) / 2;
            *off = host - (before + (after - before) / 2);
        }
    }
    return 0;
}

/* How far off the host's a clone's wall clock may be for adopt() to leave it (its
 * clocks continue from its template's, docs/cloning.md, so it usually is within the
 * reading's own uncertainty): setting it is a guest kernel path of tens of thousands of
 * instructions, emulated on a PVM host. */
#define CLOCK_TOLERANCE_NS 100000

/* Shifts the guest's wall clock onto the host's by *off ns, unless it is off by no
 * more than `tolerance` ns or the reading's uncertainty (a negative `tolerance`:
 * always): 0; -1 when the host clock
 * cannot be read, -2 when the guest's cannot be set. */
static inline int sync_clock_beyond(int mode, int64_t *off, int64_t *window, int64_t tolerance)
{
    if (clock_offset(mode, off, window) != 0)
        return -1;
    int64_t mag = *off < 0 ? -*off : *off;
    if (tolerance >= 0 && (mag <= tolerance || mag <= *window))
        return 0;
    struct timex tx = {0};
    tx.modes = ADJ_SETOFFSET | ADJ_NANO;
    tx.time.tv_sec = *off / 1000000000;
    tx.time.tv_usec = *off % 1000000000;
    if (tx.time.tv_usec < 0) {
        tx.time.tv_sec -= 1;
        tx.time.tv_usec += 1000000000;
    }
    if (adjtimex(&tx) < 0) {
        perror("forkvm: setting the clock");
        return -2;
    }
    return 0;
}

/* Shifts the guest's wall clock onto the host's by *off ns, whatever it is. */
static inline int sync_clock(int mode, int64_t *off, int64_t *window)
{
    return sync_clock_beyond(mode, off, window, -1);
}

/*
 * Bytes /dev/hwrng may hold from before the clone point, identical in every clone: the
 * hwrng core's leftover buffer (up to 64 bytes) and the virtio-rng driver's prefetched
 * request (64 bytes in Linux 6.1). Reading this much makes every later read come from
 * the clone's own device.
 */
#define HWRNG_DRAIN 128

/* Discards what /dev/hwrng buffered before the clone; 0 also when there is no hwrng. */
static inline int drain_hwrng(void)
{
    int fd = open("/dev/hwrng", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT || errno == ENODEV || errno == ENXIO ? 0 : -1;
    char buf[HWRNG_DRAIN];
    size_t got = 0;
    while (got < sizeof(buf)) {
        ssize_t n = read(fd, buf + got, sizeof(buf) - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            int e = n < 0 ? errno : 0;
            close(fd);
            /* ENODEV: no hardware RNG registered behind /dev/hwrng. */
            if (e == ENODEV && got == 0)
                return 0;
            errno = e ? e : EIO;
            perror("forkvm: draining /dev/hwrng");
            return -1;
        }
        got += (size_t)n;
    }
    close(fd);
    return 0;
}

static inline void print_mac(FILE *f, const uint8_t *m)
{
    fprintf(f, "%02x:%02x:%02x:%02x:%02x:%02x", m[0], m[1], m[2], m[3], m[4], m[5]);
}

/*
 * Applies the identity block's network identity (docs/clone-network.md, libforkvm's
 * forkvm_net_apply) and prints what it set to `f` (none when NULL). Returns 0 (also
 * with no card) or -1.
 */
static inline int apply_net(int mode, FILE *f)
{
    uint8_t blk[IDENTITY_BLOCK_LEN];
    if (ports_read(mode, IDENTITY_BLOCK, blk, sizeof(blk)) != 0) {
        perror("forkvm: reading the identity block");
        return -1;
    }
    struct forkvm_net net;
    char why[256];
    int rc = forkvm_net_apply(blk, &net, why, sizeof why);
    static const uint8_t zero[6];
    if (rc == 0 && memcmp(net.mac, zero, 6) == 0) {
        if (f)
            fprintf(f, "no network card\n");
        return 0;
    }
    if (f && net.ifname[0]) {
        fprintf(f, "%s ", net.ifname);
        print_mac(f, net.mac);
        if (net.prefix)
            fprintf(f, " %u.%u.%u.%u/%u", net.addr[0], net.addr[1], net.addr[2],
                    net.addr[3], net.prefix);
        if (net.prefix && memcmp(net.gateway, zero, 4) != 0)
            fprintf(f, " via %u.%u.%u.%u", net.gateway[0], net.gateway[1], net.gateway[2],
                    net.gateway[3]);
        fprintf(f, "\n");
    }
    if (rc != 0) {
        fprintf(stderr, "forkvm: %s\n", why);
        return -1;
    }
    if (f && net.aborted > 0)
        fprintf(f, "aborted %d TCP connections from %u.%u.%u.%u\n", net.aborted,
                net.old_addr[0], net.old_addr[1], net.old_addr[2], net.old_addr[3]);
    return 0;
}

/* Everything a clone does after the clone point (the wall clock set only when it is
 * more than CLOCK_TOLERANCE_NS off), what the network step set printed to `f` (none
 * when NULL); 0, or the status of the first failure (3: reseeding or the
 * clock, 4: the network identity). */
static inline int adopt(int mode, FILE *f)
{
    if (reseed(mode) != 0 || drain_hwrng() != 0)
        return 3;
    int64_t off, window;
    if (sync_clock_beyond(mode, &off, &window, CLOCK_TOLERANCE_NS) != 0)
        return 3;
    int rc = apply_net(mode, f);
    if (f)
        fflush(f);
    return rc == 0 ? 0 : 4;
}

#endif
