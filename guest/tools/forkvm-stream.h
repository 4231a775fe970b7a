/*
 * forkvm-stream.h: forkvm-agent's side of its protocol (docs/guest-abi.md, "Streaming"):
 * reading a request, its output sent as frames, the input and signals the host sends
 * while the command runs, and the command run as the process it is in (forkvm-oci's
 * code in it, anything else executed).
 */
#ifndef FORKVM_STREAM_H
#define FORKVM_STREAM_H

#include "forkvm-oci.h"

#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <termios.h>


#define MAX_IN (16u << 20)
#define MAX_OUT (16u << 20)

static int read_full(int fd, char *buf, size_t len)
{
    size_t got = 0;
    while (got < len) {
        ssize_t n = read(fd, buf + got, len - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        got += (size_t)n;
    }
    return 0;
}

/* Writes all of `buf` to `fd`, on a socket with send(MSG_NOSIGNAL) (`sock`): -1 once
 * it fails (on a socket, once the host has gone, with no SIGPIPE). */
static int put_full(int fd, const char *buf, size_t len, int sock)
{
    while (len > 0) {
        ssize_t n = sock ? send(fd, buf, len, MSG_NOSIGNAL) : write(fd, buf, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

static int write_full(int fd, const char *buf, size_t len)
{
    return put_full(fd, buf, len, 0);
}

/* Streaming request flags. */
#define STREAM 1
#define STREAM_STDIN 2
#define STREAM_TTY 4

/* Reads the "<cmdlen> <stdinlen>[ stream[ stdin][ tty]]\n" line; *stream gets the
 * flags. */
static int read_request_line(int fd, unsigned long *cmdlen, unsigned long *inlen, int *stream)
{
    /* Looked at in the socket's queue first (MSG_PEEK), then read up to its newline
     * only, so that what follows stays for read_full: two system calls for the line
     * where a byte at a time took one per byte (about 1,000 emulated guest kernel
     * instructions each on the PVM host). */
    char line[64];
    size_t n = 0;
    for (;;) {
        ssize_t got = recv(fd, line + n, sizeof(line) - 1 - n, MSG_PEEK);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            return -1;
        char *nl = memchr(line + n, '\n', (size_t)got);
        size_t take = nl ? (size_t)(nl - (line + n)) + 1 : (size_t)got;
        if (read_full(fd, line + n, take) != 0)
            return -1;
        n += take;
        if (nl) {
            n--;
            break;
        }
        if (n == sizeof(line) - 1)
            return -1;
    }
    line[n] = 0;
    char *end;
    *cmdlen = strtoul(line, &end, 10);
    if (end == line || *end != ' ')
        return -1;
    char *second = end + 1;
    *inlen = strtoul(second, &end, 10);
    *stream = 0;
    if (strncmp(end, " stream", 7) == 0) {
        const char *rest = end + 7;
        *stream = STREAM;
        if (strncmp(rest, " stdin", 6) == 0) {
            *stream |= STREAM_STDIN;
            rest += 6;
        }
        if (strcmp(rest, " tty") == 0) {
            *stream |= STREAM_TTY;
            rest += 4;
        }
        if (*rest != 0 || (*stream != STREAM && *inlen != 0))
            return -1;
        *end = 0;
    }
    if (end == second || *end != 0 || *cmdlen == 0 || *cmdlen > MAX_IN || *inlen > MAX_IN)
        return -1;
    return 0;
}

/* Sends all of `buf` on the connection; -1 once the host has gone (no SIGPIPE). */
static int send_full(int fd, const char *buf, size_t len)
{
    return put_full(fd, buf, len, 1);
}

/* Sends what pipe `fd` holds now as "<kind> <len>" frames; 1 at its end, 0 when it
 * would block (or the host has gone: *gone set), -1 on a read error. */
static int forward(int fd, const char *kind, int conn, int *gone)
{
    /* read() into the frame and send() from it: no memcpy in user space (the PVM
     * host's lost vector registers, see serve()). */
    static char buf[65536];
    for (;;) {
        ssize_t n = read(fd, buf, sizeof(buf));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            return 0;
        if (n <= 0)
            return n == 0 ? 1 : -1;
        char head[32];
        int h = snprintf(head, sizeof(head), "%s %zd\n", kind, n);
        if (!*gone && (send_full(conn, head, (size_t)h) != 0 || send_full(conn, buf, (size_t)n) != 0))
            *gone = 1;
    }
}

/* The command's input, fed by the host: where it goes (a pipe, or the terminal's
 * master; -1 when closed) and what it has not taken yet. */
struct input {
    int fd;
    int tty;
    char buf[65536];
    size_t len, off;
};

/* Writes what waits for the command's input, as much as it takes now. */
static void feed(struct input *in)
{
    while (in->fd >= 0 && in->off < in->len) {
        ssize_t n = write(in->fd, in->buf + in->off, in->len - in->off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            return;
        if (n <= 0) {
            /* The command closed its input: what the host sends for it is dropped. */
            close(in->fd);
            in->fd = -1;
            break;
        }
        in->off += (size_t)n;
    }
    if (in->off == in->len)
        in->len = in->off = 0;
}

/* Reads one line from the host ("sig <N>", "in <len>" and its bytes, "eof", "winch
 * <rows> <cols>") and acts on it; -1 once the host has gone. */
static int control(int conn, pid_t group, struct input *in)
{
    char line[64];
    size_t n = 0;
    while (n < sizeof(line) - 1) {
        ssize_t r = read(conn, line + n, 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        if (line[n] == '\n')
            break;
        n++;
    }
    line[n] = 0;
    char *end;
    if (strncmp(line, "sig ", 4) == 0) {
        long sig = strtol(line + 4, &end, 10);
        if (*end == 0 && sig > 0 && sig < NSIG && kill(-group, (int)sig) != 0)
            kill(group, (int)sig);
    } else if (strncmp(line, "in ", 3) == 0) {
        unsigned long len = strtoul(line + 3, &end, 10);
        if (*end != 0 || len > sizeof(in->buf) || read_full(conn, in->buf, len) != 0)
            return -1;
        if (in->fd >= 0) {
            in->len = len;
            in->off = 0;
            feed(in);
        }
    } else if (strcmp(line, "eof") == 0 && in->fd >= 0) {
        if (in->tty) {
            struct termios t;
            char eof = tcgetattr(in->fd, &t) == 0 ? (char)t.c_cc[VEOF] : 4;
            in->buf[0] = eof;
            in->len = 1;
            in->off = 0;
            feed(in);
        } else {
            close(in->fd);
            in->fd = -1;
        }
    } else if (strncmp(line, "winch ", 6) == 0 && in->tty && in->fd >= 0) {
        unsigned long rows = strtoul(line + 6, &end, 10);
        unsigned long cols = *end == ' ' ? strtoul(end + 1, &end, 10) : 0;
        struct winsize w = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
        if (*end == 0)
            ioctl(in->fd, TIOCSWINSZ, &w);
    }
    return 0;
}

#define MAX_ARGS 4096

/* Runs argv `words` (cmdlen bytes, each word ended by a NUL) with input `infd` as the
 * process this is: forkvm-oci in it, anything else executed. Never returns. */
static char *argv_words[MAX_ARGS + 1];

static void run_argv(char *words, unsigned long cmdlen, int infd)
{
    char **argv = argv_words;
    int argc = 0;
    for (unsigned long i = 0; i < cmdlen && argc < MAX_ARGS; argc++) {
        argv[argc] = words + i;
        i += strlen(words + i) + 1;
    }
    argv[argc] = NULL;
    dup2(infd, 0);
    if (infd != 0)
        close(infd);
    if (argc == 0 || words[cmdlen - 1] != 0) {
        fprintf(stderr, "forkvm-agent: the command is no NUL-ended argv\n");
        _exit(255);
    }
    if (strcmp(argv[0], "forkvm-oci") == 0)
        _exit(oci_main(argc, argv));
    execvp(argv[0], argv);
    int e = errno;
    fprintf(stderr, "forkvm-agent: %s: %s\n", argv[0], strerror(e));
    _exit(e == ENOENT ? 127 : 126);
}

#endif
