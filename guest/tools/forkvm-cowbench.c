/*
 * forkvm-cowbench: the copy-on-write write penalty a clone pays, from inside a Linux
 * guest (benches/cow.py drives it).
 *
 *   forkvm-cowbench MIB ROUNDS [read]
 *
 * Allocates and touches MIB MiB, then ROUNDS times: times a full write pass with no
 * clone in between (baseline; the pages are private to this VM), asks the VMM for one
 * clone through the clone port, and times the first full write pass after it, in the
 * parent and in the clone (both now share every page copy-on-write with the other). The
 * clone prints its figure and ends its VM through the done port. With `read`, a full read
 * pass is timed before each of those write passes (the same pass with no clone, then
 * after the clone), which tells the cost of mapping a page again after the clone from
 * the cost of copying it. Output lines:
 *   cow base   ROUND MS          cow base-read   ROUND MS   (with read)
 *   cow parent ROUND MS          cow parent-read ROUND MS   (with read)
 *   cow clone  ROUND MS          cow clone-read  ROUND MS   (with read)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/io.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "forkvm-abi.h" /* guest/lib */

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

/* Reads every 8 bytes of the buffer; returns milliseconds. */
static double read_pass(const uint8_t *buf, size_t len)
{
    double t = now_ms();
    const volatile uint64_t *w = (const volatile uint64_t *)buf;
    uint64_t sum = 0;
    for (size_t i = 0; i < len / 8; i++)
        sum += w[i];
    __asm__ volatile("" : : "r"(sum) : "memory");
    return now_ms() - t;
}

int main(int argc, char **argv)
{
    if (argc < 3 || (argc > 3 && strcmp(argv[3], "read") != 0)) {
        fprintf(stderr, "usage: forkvm-cowbench MIB ROUNDS [read]\n");
        return 2;
    }
    size_t len = strtoul(argv[1], NULL, 0) << 20;
    int rounds = atoi(argv[2]);
    int read_first = argc > 3;
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
        if (read_first)
            printf("cow base-read %d %.3f\n", r, read_pass(buf, len));
        printf("cow base %d %.3f\n", r, write_pass(buf, len, 3));
        fflush(stdout);
        outl(1, CLONE_PORT);
        uint32_t who = inl(CLONE_PORT);
        if (who == 0xffffffffu) {
            printf("cow failed\n");
            return 1;
        }
        const char *me = who ? "clone" : "parent";
        if (read_first)
            printf("cow %s-read %d %.3f\n", me, r, read_pass(buf, len));
        double ms = write_pass(buf, len, 4);
        printf("cow %s %d %.3f\n", me, r, ms);
        fflush(stdout);
        if (who) {
            outl(0, DONE_PORT);
            for (;;)
                pause();
        }
    }
    return 0;
}
