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
 *   forkvm-clone [--no-reseed] --ticks MS [--tick-bytes B] [N]
 *                           make N clones (none when N is 0), then, in the parent and
 *                           each clone, read B bytes (default 16) with one getrandom()
 *                           and print "tick id=ID from=FROM rand=HEX" forever, MS ms
 *                           apart: the clone number read right after the read (ID) and
 *                           right before it (FROM; they differ when a clone point fell
 *                           between the two), and the read's first 16 bytes. The first
 *                           read comes right after the clone point (the tests'
 *                           uniqueness probe; it waits for the kernel RNG to be ready
 *                           before cloning and stays on the CPU it started on, as the
 *                           kernel's RNG state is per CPU)
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
 *   forkvm-clone --net      give the first Ethernet interface the MAC address, IPv4
 *                           address and default gateway of the identity block (what the
 *                           host set for this VM or clone); prints what it set. When the
 *                           address changes, the TCP connections from the old one are
 *                           aborted (inherited from the template, they can send nothing;
 *                           an NFS mount's reconnects at once, docs/shared-storage.md).
 *                           A clone made by the tool does this too
 *   forkvm-clone --adopt    what a clone made by the tool does after the clone point:
 *                           reseed, drain /dev/hwrng, sync the clock, --net (forkvm-agent
 *                           runs it before its first command in every new clone)
 *
 * Before it asks for clones, `forkvm-clone [N]` runs sync(): data written to an NFS
 * mount and not yet sent would otherwise be sent by every clone (and by the parent).
 *
 * Port access (forkvm-ports.h): ioperm() and 32-bit port I/O from user mode where the
 * CPU allows it, otherwise /dev/port (byte-wide: clone numbers above 254 then read
 * modulo 256). Needs root (CAP_SYS_RAWIO).
 */
#include "forkvm-adopt.h" /* reseed, clock, network: what a clone adopts */

#include <sched.h>
#include <sys/random.h>

static int port_access(void)
{
    int mode = ports_open();
    if (mode < 0)
        exit(2);
    return mode;
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

static void print_seconds(int64_t ns, int64_t window)
{
    int64_t a = ns < 0 ? -ns : ns;
    printf("%c%lld.%06lld %lld.%06lld\n", ns < 0 ? '-' : '+', (long long)(a / 1000000000),
           (long long)(a % 1000000000 / 1000), (long long)(window / 1000000000),
           (long long)(window % 1000000000 / 1000));
}

/* One tick: `len` bytes of one getrandom() (the first 16 printed), with this VM's clone
 * number read right before the read and right after it. They differ when a clone point
 * fell between the two: inside the read (the kernel draws it again, buildroot patch
 * 0004) or after it returned (bytes this program holds, which a clone shares with its
 * parent as a fork()ed child does). */
static void tick(int mode, uint8_t *buf, size_t len)
{
    uint32_t from = in32(mode, IDENTITY_PORT);
    ssize_t got = getrandom(buf, len, 0);
    uint32_t id = in32(mode, IDENTITY_PORT);
    if (got != (ssize_t)len) {
        perror("forkvm-clone: getrandom");
        exit(3);
    }
    printf("tick id=%u from=%u rand=", id, from);
    for (size_t i = 0; i < 16 && i < len; i++)
        printf("%02x", buf[i]);
    printf("\n");
    fflush(stdout);
}

/* Ticks every `ms` milliseconds, forever (the first after a pause). */
static void tick_forever(int mode, long ms, uint8_t *buf, size_t len)
{
    struct timespec period = {ms / 1000, (ms % 1000) * 1000000L};
    for (;;) {
        nanosleep(&period, NULL);
        tick(mode, buf, len);
    }
}

int main(int argc, char **argv)
{
    int mode = port_access();
    if (argc > 1 && strcmp(argv[1], "--probe") == 0) {
        uint8_t b[4];
        if (ports_read(mode, PROBE_PORT, b, 4) != 0)
            return 2;
        uint32_t m = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
        printf("%s (port access: %s)\n", m == PROBE_MAGIC ? "forkvm" : "not forkvm",
               mode == 0 ? "ioperm" : "/dev/port");
        return m == PROBE_MAGIC ? 0 : 1;
    }
    if (argc > 1 && strcmp(argv[1], "--reseed") == 0)
        return reseed(mode) != 0 || drain_hwrng() != 0 ? 3 : 0;
    if (argc > 1 && strcmp(argv[1], "--net") == 0)
        return apply_net(mode, stdout) == 0 ? 0 : 4;
    if (argc > 1 && strcmp(argv[1], "--adopt") == 0)
        return adopt(mode, stdout);
    if (argc > 1 && strcmp(argv[1], "--id") == 0) {
        printf("%u\n", in32(mode, IDENTITY_PORT));
        return 0;
    }
    if (argc > 1 && (strcmp(argv[1], "--clock") == 0 || strcmp(argv[1], "--sync-clock") == 0)) {
        int64_t off, window;
        int rc = argv[1][2] == 'c' ? clock_offset(mode, &off, &window)
                                   : sync_clock(mode, &off, &window);
        if (rc != 0)
            return rc == -1 ? 2 : 3;
        print_seconds(off, window);
        return 0;
    }
    if (argc > 2 && strcmp(argv[1], "--done") == 0) {
        out32(mode, DONE_PORT, (uint32_t)strtoul(argv[2], NULL, 0));
        for (;;)
            pause();
    }
    int do_reseed = 1;
    long ticks = -1;
    unsigned long tick_bytes = 16;
    for (;;) {
        if (argc > 1 && strcmp(argv[1], "--no-reseed") == 0) {
            do_reseed = 0;
            argv++;
            argc--;
        } else if (argc > 2 && strcmp(argv[1], "--ticks") == 0) {
            ticks = strtol(argv[2], NULL, 0);
            argv += 2;
            argc -= 2;
        } else if (argc > 2 && strcmp(argv[1], "--tick-bytes") == 0) {
            tick_bytes = strtoul(argv[2], NULL, 0);
            argv += 2;
            argc -= 2;
        } else {
            break;
        }
    }
    if (tick_bytes == 0 || tick_bytes > (32u << 20)) {
        fprintf(stderr, "forkvm-clone: --tick-bytes takes 1 to %u\n", 32u << 20);
        return 2;
    }
    uint8_t *buf = NULL;
    if (ticks >= 0) {
        buf = malloc(tick_bytes);
        if (buf == NULL) {
            perror("forkvm-clone: malloc");
            return 3;
        }
        /* The kernel's RNG state is per CPU: every side reads on the CPU it was cloned
         * on, so a clone that was not reseeded reads what its parent would have. */
        cpu_set_t one;
        CPU_ZERO(&one);
        int cpu = sched_getcpu();
        CPU_SET(cpu < 0 ? 0 : cpu, &one);
        if (sched_setaffinity(0, sizeof one, &one) != 0)
            perror("forkvm-clone: sched_setaffinity");
        /* The probe clones a ready kernel RNG (else each clone seeds its own, slowly,
         * and the probe would not show what a clone inherits). */
        if (getrandom(buf, 1, 0) != 1) {
            perror("forkvm-clone: getrandom");
            return 3;
        }
    }
    unsigned long n = argc > 1 ? strtoul(argv[1], NULL, 0) : 1;
    if (ticks >= 0 && n == 0) {
        tick(mode, buf, tick_bytes);
        tick_forever(mode, ticks, buf, tick_bytes);
    }
    fflush(stdout);
    /* Data written and not yet sent (an NFS mount's dirty pages) goes out once, from
     * here, rather than from every clone. */
    sync();
    out32(mode, CLONE_PORT, (uint32_t)n);
    uint32_t r = in32(mode, CLONE_PORT);
    if (r == 0xffffffffu) {
        printf("failed\n");
        return 1;
    }
    /* The first read right after the clone point, before anything else runs here. */
    if (ticks >= 0)
        tick(mode, buf, tick_bytes);
    if (r != 0 && do_reseed) {
        /* Quietly: the caller reads the clone number from stdout. */
        int rc = adopt(mode, NULL);
        if (rc != 0)
            return rc;
    } else if (r != 0) {
        int64_t off, window;
        if (sync_clock(mode, &off, &window) != 0)
            return 3;
        if (apply_net(mode, NULL) != 0)
            return 4;
    }
    if (ticks >= 0)
        tick_forever(mode, ticks, buf, tick_bytes);
    printf("%u\n", r);
    return 0;
}
