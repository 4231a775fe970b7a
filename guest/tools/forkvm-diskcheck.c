/*
 * forkvm-diskcheck: write or verify a text pattern on a block device with O_DIRECT, so
 * the data goes straight between this program's buffer and the device (the tests use it
 * on per-clone copy-on-write disks; a pipe from `yes` through `dd` costs minutes of
 * guest kernel time on a PVM host).
 *
 *   forkvm-diskcheck write DEV OFFSET_MIB LEN_MIB TEXT   fill with "TEXT\n" repeated
 *   forkvm-diskcheck check DEV OFFSET_MIB LEN_MIB TEXT   prints "ok" (exit 0) or the
 *                                                        first differing byte (exit 1)
 *
 * The pattern restarts at OFFSET_MIB, as `yes TEXT | head -c LEN` would make it.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MIB (1024 * 1024)

int main(int argc, char **argv)
{
    if (argc != 6 || (strcmp(argv[1], "write") != 0 && strcmp(argv[1], "check") != 0)) {
        fprintf(stderr, "usage: forkvm-diskcheck write|check DEV OFFSET_MIB LEN_MIB TEXT\n");
        return 2;
    }
    int writing = argv[1][0] == 'w';
    long off = strtol(argv[3], NULL, 0), len = strtol(argv[4], NULL, 0);
    size_t tl = strlen(argv[5]) + 1;
    int fd = open(argv[2], (writing ? O_WRONLY : O_RDONLY) | O_DIRECT | O_CLOEXEC);
    if (fd < 0 || off < 0 || len <= 0) {
        perror("forkvm-diskcheck: open");
        return 2;
    }
    char *want, *buf;
    if (posix_memalign((void **)&want, 4096, MIB) || posix_memalign((void **)&buf, 4096, MIB))
        return 2;
    size_t pos = 0; /* position in the pattern, carried across chunks */
    for (long m = 0; m < len; m++) {
        for (size_t i = 0; i < MIB; i++, pos++)
            want[i] = pos % tl == tl - 1 ? '\n' : argv[5][pos % tl];
        off_t at = (off_t)(off + m) * MIB;
        ssize_t n = writing ? pwrite(fd, want, MIB, at) : pread(fd, buf, MIB, at);
        if (n != MIB) {
            perror(writing ? "forkvm-diskcheck: write" : "forkvm-diskcheck: read");
            return 2;
        }
        if (!writing && memcmp(buf, want, MIB) != 0) {
            for (size_t i = 0; i < MIB; i++)
                if (buf[i] != want[i]) {
                    printf("differs at byte %lld\n", (long long)at + (long long)i);
                    return 1;
                }
        }
    }
    if (writing && fdatasync(fd) != 0) {
        perror("forkvm-diskcheck: fdatasync");
        return 2;
    }
    printf("ok\n");
    return 0;
}
