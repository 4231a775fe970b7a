/*
 * Port access to forkvm's guest ports (docs/guest-abi.md), shared by the guest tools:
 * ioperm() and 32-bit port I/O from user mode where the CPU allows it, otherwise
 * /dev/port (byte-wide). Needs root (CAP_SYS_RAWIO).
 */
#ifndef FORKVM_PORTS_H
#define FORKVM_PORTS_H

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/io.h>
#include <unistd.h>

#include "forkvm-abi.h" /* guest/lib: the port numbers */

/* Through the CRNG registration port (read by forkvm-adopt.h). */
#define PORTS_END (CRNG_PORT + 8)

/* Access modes. */
#define PORTS_IOPERM 0
#define PORTS_DEVPORT 1

static int devport = -1;

/*
 * Returns the access mode, or -1 with the reason on stderr. FORKVM_CLONE_DEVPORT in the
 * environment forces /dev/port.
 */
static inline int ports_open(void)
{
    int ioperm_errno = 0;
    if (getenv("FORKVM_CLONE_DEVPORT") == NULL) {
        if (ioperm(PROBE_PORT, PORTS_END - PROBE_PORT, 1) == 0)
            return PORTS_IOPERM;
        ioperm_errno = errno;
    }
    if (devport < 0)
        devport = open("/dev/port", O_RDWR | O_CLOEXEC);
    if (devport >= 0)
        return PORTS_DEVPORT;
    fprintf(stderr, "%s: no port access (ioperm: %s; /dev/port: %s)\n",
            program_invocation_short_name, strerror(ioperm_errno), strerror(errno));
    return -1;
}

/* Reads `len` bytes of consecutive ports from `port` on (any length in ioperm mode
 * that is a multiple of 4); returns 0 or -1. */
static inline int ports_read(int mode, uint16_t port, uint8_t *buf, size_t len)
{
    if (mode == PORTS_IOPERM) {
        for (size_t i = 0; i + 4 <= len; i += 4) {
            uint32_t v = inl(port + i);
            memcpy(buf + i, &v, 4);
        }
        return 0;
    }
    return pread(devport, buf, len, port) == (ssize_t)len ? 0 : -1;
}

/* The VM's generation: different in every VM process, so in every clone; 0 if the
 * ports cannot be read. */
static inline uint64_t ports_generation(int mode)
{
    uint8_t b[8];
    uint64_t g = 0;
    if (ports_read(mode, IDENTITY_BLOCK, b, 8) != 0)
        return 0;
    for (int i = 0; i < 8; i++)
        g = g << 8 | b[i];
    return g;
}

#endif
