/*
 * libforkvm: forkvm_wait, forkvm_reply and forkvm_fail over the invoke ports and the
 * mailbox (docs/invoke.md, "The ports" and "The mailbox").
 */
#define _GNU_SOURCE
#include "forkvm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/io.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include "forkvm-abi.h"

#define INVOKE_NONE 0xffffffffu

#define LAYOUT_VERSION 1
#define HEADER_LEN 64
#define REQUEST_MAGIC 0x51524b46u /* "FKRQ" */
#define REPLY_MAGIC 0x50524b46u   /* "FKRP" */
#define WAIT_MAGIC 0x54574b46u    /* "FKWT" */
#define STATUS_OK 0
#define STATUS_ERROR 1

static uint8_t *mailbox;
static size_t mailbox_size;
static uint32_t features;

/* glibc's inl/outl have no memory clobber: without this the compiler may keep mailbox
 * stores after an outl, or reuse values it stored before an inl (the wait header) for
 * the loads after it, where the VMM has written the request. */
#define BARRIER() __asm__ __volatile__("" ::: "memory")

static uint16_t get16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

int forkvm_open(void)
{
    if (mailbox)
        return 0;
    /* The probe port, the identity ports and block, the invoke ports. */
    if (ioperm(PROBE_PORT, INVOKE_VERSION_PORT + 4 - PROBE_PORT, 1) != 0)
        return -errno;
    if (inl(PROBE_PORT) != PROBE_MAGIC)
        return -ENODEV;
    uint32_t addr = inl(MAILBOX_ADDR_PORT);
    uint32_t size = inl(MAILBOX_SIZE_PORT);
    if (addr == 0 || size <= HEADER_LEN)
        return -ENODEV;
    if (inl(INVOKE_VERSION_PORT) != LAYOUT_VERSION)
        return -EPROTO;
    /* Wait until the kernel RNG is ready, here in the template: otherwise every clone's
     * first getrandom() would wait for it (seconds of jitter entropy on a slow guest). */
    uint8_t seeded;
    while (getrandom(&seeded, 1, 0) < 0)
        if (errno != EINTR)
            return -errno;
    int fd = open("/dev/mem", O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    /* A PFN mapping: its page tables are filled now, so a clone's runtime takes no
     * page fault in it. */
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)addr);
    int err = errno;
    close(fd);
    if (m == MAP_FAILED)
        return -err;
    mailbox = m;
    mailbox_size = size;
    return 0;
}

void forkvm_enable(uint32_t f)
{
    features = f;
}

int forkvm_identity_block(uint8_t block[FORKVM_IDENTITY_BLOCK_LEN])
{
    int r = forkvm_open();
    if (r != 0)
        return r;
    for (int i = 0; i < FORKVM_IDENTITY_BLOCK_LEN; i += 4) {
        uint32_t v = inl(IDENTITY_BLOCK + i);
        memcpy(block + i, &v, 4);
    }
    return 0;
}

/* Applies this clone's network identity (FORKVM_ADOPT_NET); 0, or -1 once the request
 * was failed with the reason. */
static int adopt_net(void)
{
    uint8_t block[FORKVM_IDENTITY_BLOCK_LEN];
    struct forkvm_net net;
    char why[256];
    int r = forkvm_identity_block(block);
    if (r == 0 && forkvm_net_apply(block, &net, why, sizeof why) == 0)
        return 0;
    char msg[320];
    snprintf(msg, sizeof msg, "forkvm: cannot take the clone's network identity: %s",
             r != 0 ? forkvm_strerror(r) : why);
    forkvm_fail(msg);
    return -1;
}

static int wait_once(struct forkvm_request *req);

int forkvm_wait(struct forkvm_request *req)
{
    for (;;) {
        int r = wait_once(req);
        if (r != 0 || !(req->flags & FORKVM_ADOPT_NET) || adopt_net() == 0)
            return r;
    }
}

static int wait_once(struct forkvm_request *req)
{
    int r = forkvm_open();
    if (r != 0)
        return r;
    /* The wait header: what this runtime handles, for the VMM to read while it waits. */
    uint8_t *w = mailbox;
    memset(w, 0, 16);
    put32(w, WAIT_MAGIC);
    put16(w + 4, LAYOUT_VERSION);
    put32(w + 8, features);
    uint32_t len;
    /* All ones: the VM was resumed without a request; wait again. */
    BARRIER();
    while ((len = inl(INVOKE_PORT)) == INVOKE_NONE)
        ;
    BARRIER();
    const uint8_t *h = mailbox;
    uint16_t kind = get16(h + 6);
    int known = kind == FORKVM_KIND_INVOKE || (kind == FORKVM_KIND_PRIME && (features & FORKVM_PRIME)) ||
                (kind == FORKVM_KIND_LOAD && (features & FORKVM_LOAD));
    if (get32(h) != REQUEST_MAGIC || get16(h + 4) != LAYOUT_VERSION || !known ||
        get32(h + 12) != len || len > mailbox_size - HEADER_LEN)
        return -EPROTO;
    req->kind = kind;
    req->data = mailbox + HEADER_LEN;
    req->len = len;
    req->flags = get32(h + 8);
    req->sequence = get64(h + 16);
    req->timeout_ms = get32(h + 24);
    memcpy(req->entropy, h + 32, FORKVM_ENTROPY_LEN);
    return 0;
}

uint8_t *forkvm_reply_buffer(size_t *capacity)
{
    if (capacity)
        *capacity = mailbox ? mailbox_size - HEADER_LEN : 0;
    return mailbox ? mailbox + HEADER_LEN : NULL;
}

static int send_reply(uint16_t status, const void *data, size_t len)
{
    int r = forkvm_open();
    if (r != 0)
        return r;
    if (len > mailbox_size - HEADER_LEN)
        return -EMSGSIZE;
    if (data != mailbox + HEADER_LEN)
        memmove(mailbox + HEADER_LEN, data, len);
    uint8_t *h = mailbox;
    memset(h, 0, HEADER_LEN);
    put32(h, REPLY_MAGIC);
    put16(h + 4, LAYOUT_VERSION);
    put16(h + 6, status);
    put32(h + 8, (uint32_t)len);
    BARRIER();
    outl((uint32_t)len, INVOKE_PORT);
    BARRIER();
    return 0;
}

int forkvm_reply(const void *data, size_t len)
{
    return send_reply(STATUS_OK, data, len);
}

int forkvm_fail(const char *msg)
{
    int r = forkvm_open();
    if (r != 0)
        return r;
    size_t len = strlen(msg);
    if (len > mailbox_size - HEADER_LEN)
        len = mailbox_size - HEADER_LEN;
    return send_reply(STATUS_ERROR, msg, len);
}

uint32_t forkvm_clone_seq(void)
{
    return mailbox ? inl(IDENTITY_PORT) : 0;
}

uint64_t forkvm_generation(void)
{
    if (!mailbox)
        return 0;
    uint64_t g = 0;
    for (int i = 0; i < 8; i += 4) {
        uint32_t v = inl(IDENTITY_BLOCK + i);
        for (int b = 0; b < 4; b++)
            g = g << 8 | ((v >> (8 * b)) & 0xff);
    }
    return g;
}

const char *forkvm_strerror(int err)
{
    switch (err) {
    case 0:
        return "ok";
    case -ENODEV:
        return "no forkvm mailbox (not a forkvm VM, or it runs without --mailbox-mib)";
    case -EPROTO:
        return "the mailbox does not hold a request of a known layout";
    case -EMSGSIZE:
        return "the reply does not fit the mailbox";
    default:
        return strerror(-err);
    }
}
