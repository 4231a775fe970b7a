/*
 * forkvm-clone: ask the VMM for clones from inside a Linux guest (docs/guest-abi.md).
 *
 *   forkvm-clone [N]        make N clones (default 1); prints 0 in the parent and the
 *                           clone's number in each clone, like fork(); exit 0, or 1 if
 *                           the VMM refused (prints "failed"). Each clone first reseeds
 *                           the kernel RNG with 64 bytes from the host (entropy port,
 *                           RNDADDENTROPY + RNDRESEEDCRNG) and, with a virtio-rng device,
 *                           discards what /dev/hwrng had buffered before the clone point
 *                           (identical in every clone); --no-reseed skips both
 *   forkvm-clone --done S   end this VM with exit status S (the done port)
 *   forkvm-clone --probe    print whether the VMM is forkvm (probe port magic)
 *   forkvm-clone --reseed   reseed the kernel RNG and drain /dev/hwrng as a clone does
 *                           (for clones the host made: vmm exec ... -- forkvm-clone --reseed)
 *   forkvm-clone --id       print this VM's clone sequence number (0: not a clone),
 *                           from the identity port; works in clones the host made too
 *   forkvm-clone --clock    print how far the guest's wall clock is behind the host's
 *                           (host clock port), in seconds, and the reading's uncertainty:
 *                           "+3.412345 0.000040"
 *   forkvm-clone --sync-clock
 *                           shift the guest's wall clock by that much (adjtimex
 *                           ADJ_SETOFFSET, so the slow syscall does not add an error) and
 *                           print the shift; a clone made by the tool does this too
 *
 * Port access: ioperm() and 32-bit port I/O from user mode where the CPU allows it,
 * otherwise /dev/port (byte-wide: clone numbers above 254 then read modulo 256).
 * Needs root (CAP_SYS_RAWIO).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/random.h>
#include <sys/io.h>
#include <sys/ioctl.h>
#include <sys/timex.h>
#include <time.h>
#include <unistd.h>

#define PROBE_PORT 0xf40
#define CLONE_PORT 0xf48
#define DONE_PORT 0xf4c
#define ENTROPY_PORT 0xf50
#define IDENTITY_PORT 0xf54
#define CLOCK_PORT 0xf58
#define RESEED_BYTES 64
#define PROBE_MAGIC 0x4d564b46u /* "FKVM" */

static int devport = -1;

static int use_devport(void)
{
    if (devport < 0)
        devport = open("/dev/port", O_RDWR | O_CLOEXEC);
    return devport;
}

static int port_access(void)
{
    int ioperm_errno = 0;
    if (getenv("FORKVM_CLONE_DEVPORT") == NULL) {
        if (ioperm(PROBE_PORT, CLOCK_PORT + 8 - PROBE_PORT, 1) == 0)
            return 0;
        ioperm_errno = errno;
    }
    if (use_devport() >= 0)
        return 1;
    fprintf(stderr, "forkvm-clone: no port access (ioperm: %s; /dev/port: %s)\n",
            strerror(ioperm_errno), strerror(errno));
    exit(2);
}

static void out32(int mode, uint16_t port, uint32_t v)
{
    if (mode == 0) {
        outl(v, port);
        return;
    }
    uint8_t b = (uint8_t)v;
    if (pwrite(devport, &b, 1, port) != 1) {
        perror("forkvm-clone: /dev/port write");
        exit(2);
    }
}

static uint32_t in32(int mode, uint16_t port)
{
    if (mode == 0)
        return inl(port);
    uint8_t b;
    if (pread(devport, &b, 1, port) != 1) {
        perror("forkvm-clone: /dev/port read");
        exit(2);
    }
    return b == 0xff ? 0xffffffffu : b;
}

/* Reseeds the kernel CRNG with host entropy; returns 0 or -1 (reason on stderr). */
static int reseed(int mode)
{
    struct {
        int entropy_count;
        int buf_size;
        uint32_t buf[RESEED_BYTES / 4];
    } pool;
    for (int i = 0; i < RESEED_BYTES / 4; i++) {
        uint32_t v = 0;
        if (mode == 0) {
            v = inl(ENTROPY_PORT);
        } else {
            for (int b = 0; b < 4; b++)
                v = (v << 8) | (in32(mode, ENTROPY_PORT) & 0xff);
        }
        pool.buf[i] = v;
    }
    pool.entropy_count = RESEED_BYTES * 8;
    pool.buf_size = RESEED_BYTES;
    int fd = open("/dev/urandom", O_RDWR | O_CLOEXEC);
    if (fd < 0 || ioctl(fd, RNDADDENTROPY, &pool) != 0 || ioctl(fd, RNDRESEEDCRNG) != 0) {
        perror("forkvm-clone: reseeding the kernel RNG");
        if (fd >= 0)
            close(fd);
        return -1;
    }
    close(fd);
    return 0;
}

/* The host's CLOCK_REALTIME in ns: the first read latches it, the second reads the rest. */
static int64_t host_clock(int mode)
{
    uint64_t v;
    if (mode == 0) {
        uint32_t lo = inl(CLOCK_PORT);
        v = (uint64_t)inl(CLOCK_PORT + 4) << 32 | lo;
    } else {
        uint8_t b[8];
        if (pread(devport, b, 8, CLOCK_PORT) != 8) {
            perror("forkvm-clone: /dev/port read");
            exit(2);
        }
        v = 0;
        for (int i = 7; i >= 0; i--)
            v = v << 8 | b[i];
    }
    return (int64_t)v;
}

static int64_t realtime_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/*
 * Host wall clock minus the guest's, in ns; *window is the reading's uncertainty (half
 * the guest time around the port read; the best of a few tries).
 */
#define CLOCK_TRIES 8
static int64_t clock_offset(int mode, int64_t *window)
{
    int64_t best = 0;
    *window = INT64_MAX;
    for (int i = 0; i < CLOCK_TRIES; i++) {
        int64_t before = realtime_ns();
        int64_t host = host_clock(mode);
        int64_t after = realtime_ns();
        if (host == 0 || host == -1) {
            fprintf(stderr, "forkvm-clone: the VMM has no host clock port\n");
            exit(2);
        }
        if ((after - before) / 2 < *window) {
            *window = (after - before) / 2;
            best = host - (before + (after - before) / 2);
        }
    }
    return best;
}

static void print_seconds(int64_t ns, int64_t window)
{
    int64_t a = ns < 0 ? -ns : ns;
    printf("%c%lld.%06lld %lld.%06lld\n", ns < 0 ? '-' : '+', (long long)(a / 1000000000),
           (long long)(a % 1000000000 / 1000), (long long)(window / 1000000000),
           (long long)(window % 1000000000 / 1000));
}

/* Shifts the guest's wall clock onto the host's; returns the shift in ns, or exits. */
static int64_t sync_clock(int mode, int64_t *window)
{
    int64_t off = clock_offset(mode, window);
    struct timex tx = {0};
    tx.modes = ADJ_SETOFFSET | ADJ_NANO;
    tx.time.tv_sec = off / 1000000000;
    tx.time.tv_usec = off % 1000000000;
    if (tx.time.tv_usec < 0) {
        tx.time.tv_sec -= 1;
        tx.time.tv_usec += 1000000000;
    }
    if (adjtimex(&tx) < 0) {
        perror("forkvm-clone: setting the clock");
        exit(3);
    }
    return off;
}

/*
 * Bytes /dev/hwrng may hold from before the clone point, identical in every clone: the
 * hwrng core's leftover buffer (up to 64 bytes) and the virtio-rng driver's prefetched
 * request (64 bytes in Linux 6.1). Reading this much makes every later read come from
 * the clone's own device.
 */
#define HWRNG_DRAIN 128

/* Discards what /dev/hwrng buffered before the clone; 0 also when there is no hwrng. */
static int drain_hwrng(void)
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
            perror("forkvm-clone: draining /dev/hwrng");
            return -1;
        }
        got += (size_t)n;
    }
    close(fd);
    return 0;
}

int main(int argc, char **argv)
{
    int mode = port_access();
    if (argc > 1 && strcmp(argv[1], "--probe") == 0) {
        uint32_t m = 0;
        if (mode == 0) {
            m = inl(PROBE_PORT);
        } else {
            uint8_t b[4];
            if (pread(devport, b, 4, PROBE_PORT) != 4)
                return 2;
            m = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
        }
        printf("%s (port access: %s)\n", m == PROBE_MAGIC ? "forkvm" : "not forkvm",
               mode == 0 ? "ioperm" : "/dev/port");
        return m == PROBE_MAGIC ? 0 : 1;
    }
    if (argc > 1 && strcmp(argv[1], "--reseed") == 0)
        return reseed(mode) != 0 || drain_hwrng() != 0 ? 3 : 0;
    if (argc > 1 && strcmp(argv[1], "--id") == 0) {
        printf("%u\n", in32(mode, IDENTITY_PORT));
        return 0;
    }
    if (argc > 1 && (strcmp(argv[1], "--clock") == 0 || strcmp(argv[1], "--sync-clock") == 0)) {
        int64_t window;
        int64_t off = argv[1][2] == 'c' ? clock_offset(mode, &window) : sync_clock(mode, &window);
        print_seconds(off, window);
        return 0;
    }
    if (argc > 2 && strcmp(argv[1], "--done") == 0) {
        out32(mode, DONE_PORT, (uint32_t)strtoul(argv[2], NULL, 0));
        for (;;)
            pause();
    }
    int do_reseed = 1;
    if (argc > 1 && strcmp(argv[1], "--no-reseed") == 0) {
        do_reseed = 0;
        argv++;
        argc--;
    }
    unsigned long n = argc > 1 ? strtoul(argv[1], NULL, 0) : 1;
    fflush(stdout);
    out32(mode, CLONE_PORT, (uint32_t)n);
    uint32_t r = in32(mode, CLONE_PORT);
    if (r == 0xffffffffu) {
        printf("failed\n");
        return 1;
    }
    if (r != 0 && do_reseed && (reseed(mode) != 0 || drain_hwrng() != 0))
        return 3;
    if (r != 0) {
        int64_t window;
        sync_clock(mode, &window);
    }
    printf("%u\n", r);
    return 0;
}
