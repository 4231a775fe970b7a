/*
 * forkvm-cowbench: the copy-on-write write penalty a clone pays, from inside a Linux
 * guest (benches/cow.py drives it).
 *
 *   forkvm-cowbench MIB ROUNDS
 *
 * Allocates and touches MIB MiB, then ROUNDS times: times a full write pass with no
 * clone in between (baseline; the pages are private to this VM), asks the VMM for one
 * clone through the clone port, and times the first full write pass after it, in the
 * parent and in the clone (both now share every page copy-on-write with the other). The
 * clone prints its figure and ends its VM through the done port. Output lines:
 *   cow base   ROUND MS
 *   cow parent ROUND MS
 *   cow clone  ROUND MS
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/io.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define CLONE_PORT 0xf48
#define DONE_PORT 0xf4c

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Writes every byte of the buffer; returns milliseconds. */
static double write_pass(uint8_t *buf, size_t len, uint8_t v)
{
    double t = now_ms();
    memset(buf, v, len);
    __asm__ volatile("" : : "r"(buf) : "memory");
    return now_ms() - t;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: forkvm-cowbench MIB ROUNDS\n");
        return 2;
    }
    size_t len = strtoul(argv[1], NULL, 0) << 20;
    int rounds = atoi(argv[2]);
    if (ioperm(CLONE_PORT, 8, 1) != 0) {
        perror("forkvm-cowbench: ioperm");
        return 2;
    }
    uint8_t *buf = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (buf == MAP_FAILED) {
        perror("forkvm-cowbench: mmap");
        return 2;
    }
    memset(buf, 1, len);
    for (int r = 0; r < rounds; r++) {
        write_pass(buf, len, 2);
        printf("cow base %d %.3f\n", r, write_pass(buf, len, 3));
        fflush(stdout);
        outl(1, CLONE_PORT);
        uint32_t who = inl(CLONE_PORT);
        if (who == 0xffffffffu) {
            printf("cow failed\n");
            return 1;
        }
        double ms = write_pass(buf, len, 4);
        printf("cow %s %d %.3f\n", who ? "clone" : "parent", r, ms);
        fflush(stdout);
        if (who) {
            outl(0, DONE_PORT);
            for (;;)
                pause();
        }
    }
    return 0;
}
