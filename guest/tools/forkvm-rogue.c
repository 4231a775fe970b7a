/*
 * forkvm-rogue: a root process turned virtio driver, doing everything wrong (the
 * malicious-guest tests, docs/reliability.md). It takes one virtio-mmio device away from
 * Linux (sysfs unbind), drives its registers through /dev/mem, and resets it at the end;
 * with --rebind it then gives the device back to Linux's driver.
 *
 *   forkvm-rogue [--rounds N] [--seed S] [--rebind] MMIO_BASE
 *
 * Its rings and buffers live in forkvm's invocation mailbox (the VM needs --mailbox-mib 1
 * or more): memory outside the guest's RAM, which user space maps through /dev/mem and
 * whose guest-physical addresses it knows, so every device write lands there and the
 * guest kernel stays intact. The mailbox is split into:
 *
 *   RINGS     0-256 KiB    queue q's descriptor table, available and used ring at
 *                          q * 64 KiB + 0, 16 KiB and 32 KiB
 *   WRITABLE  256-768 KiB  where device-writable descriptors point
 *   TABLES    768-832 KiB  indirect descriptor tables, written only by this program
 *   HEADERS   832-896 KiB  request headers (virtio-blk, vsock), biased towards valid ones
 *
 * Each round resets the device, negotiates random features (not always in order), and
 * sets up queues 0-3 with random sizes (one in eight any 32-bit value) and rings in
 * RINGS (one in eight anywhere outside memory). Then 16 times: descriptors at random
 * (headers, writable buffers, indirect tables; addresses past the mailbox's end, above
 * 1 TiB or wrapping around 2^64; lengths up to 4 KiB or any 32-bit value; links that
 * loop), available rings with random heads and indexes, every queue notified (and one
 * random queue number), one random register written (any but the ring addresses) and
 * one read. Interrupts are acknowledged in half the rounds only. The device's status
 * is read after each round (DEVICE_NEEDS_RESET counted), and so are the used rings'
 * indexes (the chains the device returned: it got past the layout checks).
 *
 * Prints "forkvm-rogue: NAME device D: ..." with its counts and exits 0 once the device
 * reset (and was bound again, with --rebind); 1 if the device did not reset; 2 on bad
 * usage or a missing mailbox, /dev/mem or sysfs entry.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/io.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "forkvm-abi.h"
#include "forkvm-file.h"

#define KIB 1024u
#define RINGS 0u
#define WRITABLE (256 * KIB)
#define WRITABLE_LEN (512 * KIB)
#define TABLES (768 * KIB)
#define TABLE_LEN (1 * KIB) /* 64 descriptors */
#define HEADERS (832 * KIB)
#define HEADER_SLOTS 1024u /* 64 bytes each */
#define NEEDED (896 * KIB)
#define QUEUES 4
#define MAX_QUEUE 1024u /* the most RINGS holds per queue */

/* virtio-mmio registers (version 2) */
#define R_MAGIC 0x000
#define R_VERSION 0x004
#define R_DEVICE_ID 0x008
#define R_DEV_FEATURES 0x010
#define R_DEV_FEATURES_SEL 0x014
#define R_DRV_FEATURES 0x020
#define R_DRV_FEATURES_SEL 0x024
#define R_QUEUE_SEL 0x030
#define R_QUEUE_NUM_MAX 0x034
#define R_QUEUE_NUM 0x038
#define R_QUEUE_READY 0x044
#define R_QUEUE_NOTIFY 0x050
#define R_INT_STATUS 0x060
#define R_INT_ACK 0x064
#define R_STATUS 0x070
#define R_QUEUE_DESC 0x080
#define R_QUEUE_AVAIL 0x090
#define R_QUEUE_USED 0x0a0

#define S_ACK 1u
#define S_DRIVER 2u
#define S_DRIVER_OK 4u
#define S_FEATURES_OK 8u
#define S_NEEDS_RESET 0x40u

#define D_NEXT 1u
#define D_WRITE 2u
#define D_INDIRECT 4u

static volatile uint8_t *regs;
static uint8_t *mbox;
static uint64_t mbox_addr, mbox_size;
static uint64_t rng_state;
static uint32_t device_id;
static unsigned long writes, notifies, used;

static uint64_t next_rand(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* One in `n`. */
static int one_in(unsigned n) { return next_rand() % n == 0; }

static uint32_t rd(unsigned off) { return *(volatile uint32_t *)(regs + off); }

static void wr(unsigned off, uint32_t v)
{
    *(volatile uint32_t *)(regs + off) = v;
    writes++;
}

static void wr64(unsigned off, uint64_t v)
{
    wr(off, (uint32_t)v);
    wr(off + 4, (uint32_t)(v >> 32));
}

static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

/* An address a device cannot use whole: straddling the mailbox's end, above 1 TiB (no
 * memory there), or so close to 2^64 that address + length wraps. */
static uint64_t outside(void)
{
    switch (next_rand() % 3) {
    case 0: return mbox_addr + mbox_size - next_rand() % 64;
    case 1: return (1ull << 40) + (next_rand() % (1ull << 30));
    default: return UINT64_MAX - next_rand() % 4096;
    }
}

static uint32_t length(uint32_t usual)
{
    return one_in(8) ? (uint32_t)next_rand() : (uint32_t)(next_rand() % usual) + 1;
}

/* Refills the request headers: random bytes, half of them made plausible for the
 * device (a virtio-blk request type and sector; a vsock packet to the host). */
static void headers(void)
{
    for (unsigned s = 0; s < HEADER_SLOTS; s++) {
        uint8_t *h = mbox + HEADERS + s * 64;
        for (unsigned i = 0; i < 64; i += 8)
            put64(h + i, next_rand());
        if (one_in(2))
            continue;
        if (device_id == 2) { /* blk: type, reserved, sector */
            static const uint32_t types[] = {0, 1, 4, 8, 11, 13};
            put32(h, types[next_rand() % 6]);
            put64(h + 8, one_in(4) ? next_rand() : next_rand() % 32768);
        } else if (device_id == 19) { /* vsock: src_cid, dst_cid, ports, len, type, op */
            put64(h, next_rand() % 8);
            put64(h + 8, one_in(2) ? 2 : next_rand() % 8);
            put32(h + 16, 1024 + (uint32_t)(next_rand() % 4));
            put32(h + 20, one_in(2) ? 1024 : (uint32_t)next_rand());
            put32(h + 24, length(4096));
            put16(h + 28, one_in(4) ? (uint16_t)next_rand() : 1);
            put16(h + 30, (uint16_t)(next_rand() % 8));
        }
    }
}

/* One descriptor at `d`: a header, a writable buffer, an address outside memory, or
 * (with `indirect`) an indirect table of such descriptors. Links may loop. */
static void descriptor(uint8_t *d, unsigned size, int indirect)
{
    uint64_t addr;
    uint32_t len;
    uint16_t flags = one_in(2) ? D_NEXT : 0;
    unsigned kind = next_rand() % 16;
    if (kind < 6) {
        addr = mbox_addr + HEADERS + (next_rand() % HEADER_SLOTS) * 64;
        len = length(64);
    } else if (kind < 12) {
        addr = mbox_addr + WRITABLE + next_rand() % WRITABLE_LEN;
        len = length(4096);
        flags |= D_WRITE;
        /* A length running past WRITABLE would let the device write a table. */
        if (addr + len > mbox_addr + WRITABLE + WRITABLE_LEN)
            len = (uint32_t)(mbox_addr + WRITABLE + WRITABLE_LEN - addr);
    } else if (kind < 14 || !indirect) {
        addr = outside();
        len = length(4096);
        flags |= (uint16_t)(next_rand() & D_WRITE);
    } else {
        unsigned t = (unsigned)(next_rand() % 64);
        uint8_t *table = mbox + TABLES + t * TABLE_LEN;
        unsigned n = 1 + (unsigned)(next_rand() % 64);
        for (unsigned i = 0; i < n; i++)
            descriptor(table + i * 16, n, 0);
        addr = mbox_addr + TABLES + t * TABLE_LEN;
        len = one_in(4) ? length(TABLE_LEN * 2) : n * 16;
        flags |= D_INDIRECT;
    }
    if (one_in(16))
        flags = (uint16_t)next_rand() & (indirect ? 0xffff : ~D_INDIRECT & 0xffff);
    /* Never an indirect table and a writable flag together: the device would write
     * into the table, and the next round would read what it wrote as addresses. */
    if ((flags & D_INDIRECT) && (flags & D_WRITE))
        flags &= (uint16_t)~D_WRITE;
    /* Random flags may mark any descriptor writable: only inside WRITABLE or outside
     * memory. */
    if ((flags & D_WRITE) && addr >= mbox_addr && addr < mbox_addr + mbox_size &&
        (addr < mbox_addr + WRITABLE || addr + len > mbox_addr + WRITABLE + WRITABLE_LEN))
        flags &= (uint16_t)~D_WRITE;
    put64(d, addr);
    put32(d + 8, len);
    put16(d + 12, flags);
    put16(d + 14, one_in(2) ? (uint16_t)(next_rand() % size) : (uint16_t)next_rand());
}

struct queue {
    unsigned size; /* what the driver wrote; 0: not set up */
    uint16_t avail_idx;
    int in_mailbox; /* its used ring is in RINGS */
};

static void setup(struct queue *q, unsigned n)
{
    wr(R_QUEUE_SEL, n);
    uint32_t max = rd(R_QUEUE_NUM_MAX);
    unsigned size = 0;
    if (max > 0) {
        if (max > MAX_QUEUE)
            max = MAX_QUEUE;
        size = one_in(8) ? (unsigned)next_rand() : 1 + (unsigned)(next_rand() % max);
    }
    wr(R_QUEUE_NUM, size);
    uint64_t base = mbox_addr + RINGS + n * 64 * KIB;
    wr64(R_QUEUE_DESC, one_in(8) ? outside() : base);
    wr64(R_QUEUE_AVAIL, one_in(8) ? outside() : base + 16 * KIB);
    q->in_mailbox = !one_in(8);
    wr64(R_QUEUE_USED, q->in_mailbox ? base + 32 * KIB : outside());
    wr(R_QUEUE_READY, one_in(16) ? (uint32_t)next_rand() : 1);
    q->size = size > 0 && size <= MAX_QUEUE ? size : 0;
    q->avail_idx = 0;
    put16(mbox + RINGS + n * 64 * KIB + 32 * KIB + 2, 0);
}

/* The chains the device returned to queue `n` this round (its used index). */
static unsigned returned(const struct queue *q, unsigned n)
{
    uint16_t idx;
    memcpy(&idx, mbox + RINGS + n * 64 * KIB + 32 * KIB + 2, 2);
    return q->in_mailbox ? idx : 0;
}

static void offer(struct queue *q, unsigned n)
{
    if (q->size == 0)
        return;
    uint8_t *ring = mbox + RINGS + n * 64 * KIB;
    for (unsigned i = 0; i < q->size; i++)
        descriptor(ring + i * 16, q->size, 1);
    uint8_t *avail = ring + 16 * KIB;
    unsigned offered = (unsigned)(next_rand() % (q->size + 2));
    for (unsigned i = 0; i < offered; i++)
        put16(avail + 4 + 2 * ((q->avail_idx + i) % q->size),
              one_in(8) ? (uint16_t)next_rand() : (uint16_t)(next_rand() % q->size));
    q->avail_idx = one_in(8) ? (uint16_t)next_rand() : (uint16_t)(q->avail_idx + offered);
    put16(avail, one_in(2));
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    put16(avail + 2, q->avail_idx);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

/* The platform device at `base`, from /proc/iomem ("d0000000-d0000fff : virtio-mmio.0"). */
static int device_name(uint64_t base, char *name, size_t len)
{
    FILE *f = fopen("/proc/iomem", "r");
    if (!f)
        return -1;
    char line[256];
    int found = -1;
    while (found < 0 && fgets(line, sizeof line, f)) {
        uint64_t start, end;
        char n[128];
        if (sscanf(line, " %" SCNx64 "-%" SCNx64 " : %127s", &start, &end, n) == 3 &&
            start == base && strncmp(n, "virtio-mmio", 11) == 0) {
            snprintf(name, len, "%s", n);
            found = 0;
        }
    }
    fclose(f);
    return found;
}

static void sleep_us(long us)
{
    struct timespec t = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&t, NULL);
}

/* Writes 0 to the status register and waits (10,000 times 1 ms at least: a busy host
 * may take a while to end the device's worker) for it to read 0. */
static int reset(void)
{
    wr(R_STATUS, 0);
    for (int i = 0; i < 10000; i++) {
        if (rd(R_STATUS) == 0)
            return 0;
        sleep_us(1000);
    }
    return -1;
}

static void round_of(struct queue *qs)
{
    reset();
    wr(R_STATUS, S_ACK);
    wr(R_STATUS, S_ACK | S_DRIVER);
    for (uint32_t sel = 0; sel < 2; sel++) {
        wr(R_DEV_FEATURES_SEL, sel);
        uint32_t offered = rd(R_DEV_FEATURES);
        wr(R_DRV_FEATURES_SEL, one_in(16) ? (uint32_t)next_rand() : sel);
        wr(R_DRV_FEATURES, one_in(4) ? (uint32_t)next_rand() : offered & (uint32_t)next_rand());
    }
    if (!one_in(16))
        wr(R_STATUS, S_ACK | S_DRIVER | S_FEATURES_OK);
    for (unsigned n = 0; n < QUEUES; n++)
        setup(&qs[n], n);
    wr(R_STATUS, one_in(16) ? (uint32_t)next_rand()
                            : S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK);
    int ack = one_in(2);
    for (int i = 0; i < 16; i++) {
        headers();
        for (unsigned n = 0; n < QUEUES; n++) {
            offer(&qs[n], n);
            wr(R_QUEUE_NOTIFY, n);
            notifies++;
        }
        wr(R_QUEUE_NOTIFY, (uint32_t)next_rand());
        notifies++;
        unsigned reg = (unsigned)(next_rand() % 128) * 4;
        if (reg < R_QUEUE_DESC || reg >= 0xc0)
            wr(reg, (uint32_t)next_rand());
        (void)rd((unsigned)(next_rand() % 1024) * 4);
        if (ack)
            wr(R_INT_ACK, rd(R_INT_STATUS));
        sleep_us(200);
    }
}

int main(int argc, char **argv)
{
    long rounds = 100;
    uint64_t seed = (uint64_t)time(NULL);
    int rebind = 0, i = 1;
    for (; i < argc && strncmp(argv[i], "--", 2) == 0; i++) {
        if (strcmp(argv[i], "--rebind") == 0)
            rebind = 1;
        else if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc)
            rounds = strtol(argv[++i], NULL, 0);
        else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc)
            seed = strtoull(argv[++i], NULL, 0);
        else
            break;
    }
    if (i + 1 != argc || rounds < 1) {
        fprintf(stderr, "usage: forkvm-rogue [--rounds N] [--seed S] [--rebind] MMIO_BASE\n");
        return 2;
    }
    uint64_t base = strtoull(argv[i], NULL, 0);
    rng_state = seed | 1;
    char name[128], path[256];
    if (device_name(base, name, sizeof name) != 0) {
        fprintf(stderr, "forkvm-rogue: no virtio-mmio device at %#" PRIx64 " in /proc/iomem\n",
                base);
        return 2;
    }
    if (ioperm(MAILBOX_ADDR_PORT, 8, 1) != 0) {
        perror("forkvm-rogue: ioperm");
        return 2;
    }
    mbox_addr = inl(MAILBOX_ADDR_PORT);
    mbox_size = inl(MAILBOX_SIZE_PORT);
    if (mbox_addr == 0 || mbox_size < NEEDED) {
        fprintf(stderr, "forkvm-rogue: needs a mailbox of 1 MiB (--mailbox-mib 1); has %" PRIu64
                        " bytes\n", mbox_size);
        return 2;
    }
    /* Linux's driver lets go of the device (it resets it). */
    snprintf(path, sizeof path, "/sys/bus/platform/devices/%s/driver", name);
    if (access(path, F_OK) == 0 &&
        forkvm_write_file("/sys/bus/platform/drivers/virtio-mmio/unbind", name) != 0) {
        fprintf(stderr, "forkvm-rogue: unbind %s: %s\n", name, strerror(errno));
        return 2;
    }
    int mem = open("/dev/mem", O_RDWR | O_SYNC | O_CLOEXEC);
    if (mem < 0) {
        perror("forkvm-rogue: /dev/mem");
        return 2;
    }
    void *r = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, mem, (off_t)base);
    void *m = mmap(NULL, mbox_size, PROT_READ | PROT_WRITE, MAP_SHARED, mem, (off_t)mbox_addr);
    close(mem);
    if (r == MAP_FAILED || m == MAP_FAILED) {
        perror("forkvm-rogue: mmap");
        return 2;
    }
    regs = r;
    mbox = m;
    if (rd(R_MAGIC) != 0x74726976 || rd(R_VERSION) != 2) {
        fprintf(stderr, "forkvm-rogue: %s: not a virtio-mmio version 2 device\n", name);
        return 2;
    }
    device_id = rd(R_DEVICE_ID);
    struct queue qs[QUEUES];
    long needs_reset = 0;
    for (long k = 0; k < rounds; k++) {
        round_of(qs);
        needs_reset += (rd(R_STATUS) & S_NEEDS_RESET) != 0;
        for (unsigned n = 0; n < QUEUES; n++)
            used += returned(&qs[n], n);
    }
    int reset_ok = reset() == 0;
    printf("forkvm-rogue: %s device %u: %ld rounds (seed %" PRIu64 "), %lu register writes, "
           "%lu notifications, %lu chains returned, needs-reset after %ld rounds, reset %s\n",
           name, device_id, rounds, seed, writes, notifies, used, needs_reset,
           reset_ok ? "ok" : "did not take");
    fflush(stdout);
    if (!reset_ok)
        return 1;
    if (rebind) {
        if (forkvm_write_file("/sys/bus/platform/drivers/virtio-mmio/bind", name) != 0) {
            fprintf(stderr, "forkvm-rogue: bind %s: %s\n", name, strerror(errno));
            return 1;
        }
        printf("forkvm-rogue: %s bound to its driver again\n", name);
    }
    return 0;
}
