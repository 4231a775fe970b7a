/*
 * forkvm-file.h: small file helpers the guest tools share.
 */
#ifndef FORKVM_FILE_H
#define FORKVM_FILE_H

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

/* Writes `value` to the existing file `path` (a sysfs or cgroup control file) in one
 * write; 0, or -1 with errno. */
static inline int forkvm_write_file(const char *path, const char *value)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = write(fd, value, strlen(value));
    int e = errno;
    close(fd);
    errno = e;
    return n == (ssize_t)strlen(value) ? 0 : -1;
}

#endif
