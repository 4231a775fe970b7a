/*
 * forkvm-agent: runs commands the host sends over virtio-vsock (docs/guest-abi.md).
 *
 *   forkvm-agent [--background] [--no-adopt] [PORT]
 *                           listen on vsock port PORT (default 1024), one process per
 *                           connection, forked before the connection comes (a spare
 *                           waiting in accept, the next one forked at the lowest
 *                           priority once it took one); prints "forkvm-agent:
 *                           listening on port PORT".
 *                           With --background it returns once listening and serves from
 *                           a child (init uses it: see docs/guest-kernel.md on why the
 *                           guest's command must not start while the agent starts).
 *
 * In a new clone (the identity block's generation changed since the agent last looked),
 * the agent adopts the clone's identity in the connection's process before serving the
 * connection (once per clone: the generation adopted is kept in memory its processes
 * share), as `forkvm-clone --adopt` would (forkvm-adopt.h): reseed the RNG, drain
 * /dev/hwrng, sync the clock, take the clone's network identity. --no-adopt leaves that
 * to the host.
 *
 * Protocol, per connection (what `vmm exec` speaks):
 *   host:  "<cmdlen> <stdinlen>\n", then cmdlen bytes of command, stdinlen bytes of input
 *   agent: runs `sh -c <command>` with that input on stdin, stdout and stderr together,
 *          then sends "<status> <outlen>\n" and outlen bytes of output, and closes.
 *          status is the exit code, 128+N when killed by signal N, 255 if it could not
 *          run. Output beyond 16 MiB is cut.
 * Streaming, when the head is "<cmdlen> <stdinlen> stream\n" (what the containerd shim
 * speaks): the command is a program's argv, its words each ended by a NUL byte, run
 * with no shell (its first word looked up on PATH; forkvm-oci runs in the agent's own
 * forked process, forkvm-oci.h, with no exec of the tool), in a process group of its
 * own, and the agent sends its
 * output as it comes, "out <len>\n" or "err <len>\n" and len bytes, then
 * "exit <status>\n" once the command has ended, and closes. What the command left
 * running in its group is killed then. Meanwhile the host may send "sig <N>\n": the
 * agent sends signal N to the command's group. The host closing the connection kills
 * the group.
 * With " stdin" after "stream" (the head's stdinlen then 0), the command's stdin is a
 * pipe the host feeds: "in <len>\n" and len bytes (at most 65536) are written to it,
 * "eof\n" closes it. With " tty" (alone or after " stdin"), the command runs on a new
 * pseudo-terminal as its controlling terminal (a session of its own): its output, both
 * streams, comes as "out" frames; "in" frames are typed on it, "eof" types the
 * terminal's end-of-file character, and "winch <rows> <cols>\n" sets its size. Input
 * the command does not take yet waits in the agent, which reads nothing more from the
 * host meanwhile (output keeps flowing).
 * The connections a clone inherits from its parent are reset at the clone point; the
 * listening socket keeps working, so every clone answers on its own vsock socket.
 */
#include "forkvm-adopt.h"
#include "forkvm-oci.h"

#include <fcntl.h>
#include <poll.h>
#include <termios.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/futex.h>
#include <linux/vm_sockets.h>

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

static int write_full(int fd, const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        buf += n;
        len -= (size_t)n;
    }
    return 0;
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
    while (len > 0) {
        ssize_t n = send(fd, buf, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        buf += n;
        len -= (size_t)n;
    }
    return 0;
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

/* What the agent's processes share (a page mapped shared before they are forked): the
 * identity block generation the last adoption took, a lock so that one process adopts
 * at a time, and how many spare connection processes wait in accept (a futex: a spare
 * wakes those waiting for one as it starts to wait). */
struct shared {
    uint64_t generation;
    int lock;
    int ready;
};
static struct shared *shared;

static void futex_wait(int *word, int value, int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    syscall(SYS_futex, word, FUTEX_WAIT, value, &ts, NULL, 0);
}

static void futex_wake(int *word)
{
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* In a spare connection process, the main process's end of the pipe on which it says
 * it needs the guest's CPU no more than a running command does (-1 once said). */
static int release_fd = -1;

/* Tells the main process that this connection's start is over (its command's first
 * output or its end, or a second passed), so it may fork the next spare now: forked
 * sooner, at whatever priority, it takes the guest's one CPU in the waits of the
 * start (the host's answers) and holds it past them (a guest kernel path is not
 * preempted). */
static void release(void)
{
    if (release_fd < 0)
        return;
    ssize_t told = write(release_fd, "r", 1);
    (void)told;
    close(release_fd);
    release_fd = -1;
}

/* How long a stream's start holds back the next spare at most, ms. */
#define START_MS 1000

/* What a command's process does once it knows its command `cmd` (cmdlen bytes, argv
 * words) and its files: fds[0] its input, fds[1] and fds[2] its output and error, or
 * with `tty` fds[0] the terminal. Never returns. */
static void become_command(char *cmd, unsigned long cmdlen, int tty, const int fds[3])
{
    if (tty) {
        /* A session of its own, the terminal its controlling one. */
        setsid();
        int t = fds[0];
        if (ioctl(t, TIOCSCTTY, 0) != 0) {
            fprintf(stderr, "forkvm-agent: the terminal: %s\n", strerror(errno));
            _exit(255);
        }
        dup2(t, 1);
        dup2(t, 2);
        if (t != 0)
            dup2(t, 0);
        if (t > 2)
            close(t);
        run_argv(cmd, cmdlen, 0);
    }
    setpgid(0, 0);
    dup2(fds[1], 1);
    dup2(fds[2], 2);
    run_argv(cmd, cmdlen, fds[0]);
}

/* A command's process forked ahead, in a spare before its connection: its pid and the
 * socket on which it waits for its command (-1: none). */
static pid_t ahead_pid = -1;
static int ahead_chan = -1;

/* The head of what a command's process forked ahead is sent: then cmdlen bytes. */
struct command_head {
    uint32_t flags;
    uint32_t nfds;
    uint64_t cmdlen;
};

/* A command's process forked ahead: it writes the memory a command's start writes
 * (its stack, its heap, the argv table), so that in a clone of a VM holding it none of
 * that is copied on the first write (a guest page fault each, emulated on the PVM
 * host), then waits on `chan` for its command and its files and becomes it. Nothing
 * sent (its spare served no command, or ended) ends it. */
static void command_ahead(int chan)
{
    /* What forkvm-oci's start uses: a few pages of each (more would be unmapped again
     * by the exec, at a cost too). */
    volatile char stack[16 << 10];
    for (size_t k = 0; k < sizeof stack; k += 4096)
        stack[k] = 0;
    char *heap = malloc(16 << 10);
    if (heap) {
        memset(heap, 0, 16 << 10);
        free(heap);
    }
    memset(argv_words, 0, 4096);
    setpriority(PRIO_PROCESS, 0, 0);
    /* Ready: its spare waits for this before it counts itself ready. */
    if (write(chan, "a", 1) != 1)
        _exit(0);
    struct command_head head;
    int fds[3] = {-1, -1, -1};
    char space[CMSG_SPACE(sizeof fds)];
    struct iovec iov = {.iov_base = &head, .iov_len = sizeof head};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = space,
                       .msg_controllen = sizeof space};
    ssize_t got;
    do {
        got = recvmsg(chan, &m, MSG_CMSG_CLOEXEC | MSG_WAITALL);
    } while (got < 0 && errno == EINTR);
    if (got != (ssize_t)sizeof head)
        _exit(0);
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    if (!c || c->cmsg_type != SCM_RIGHTS || head.nfds > 3 ||
        c->cmsg_len != CMSG_LEN(head.nfds * sizeof(int)))
        _exit(255);
    memcpy(fds, CMSG_DATA(c), head.nfds * sizeof(int));
    char *cmd = malloc(head.cmdlen + 1);
    if (!cmd || read_full(chan, cmd, head.cmdlen) != 0)
        _exit(255);
    cmd[head.cmdlen] = 0;
    close(chan);
    become_command(cmd, head.cmdlen, (head.flags & STREAM_TTY) != 0, fds);
}

/* Forks the command's process ahead (command_ahead), unless one waits already, and
 * returns once it waits; it closes the spare's listening socket `s` and its pipe
 * `notify`. */
static void fork_command_ahead(int s, int notify)
{
    if (ahead_pid > 0)
        return;
    int chan[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, chan) != 0)
        return;
    pid_t pid = fork();
    if (pid == 0) {
        close(chan[0]);
        close(s);
        close(notify);
        command_ahead(chan[1]);
    }
    close(chan[1]);
    char ready;
    if (pid < 0 || read(chan[0], &ready, 1) != 1) {
        close(chan[0]);
        if (pid > 0)
            waitpid(pid, NULL, 0);
        return;
    }
    ahead_pid = pid;
    ahead_chan = chan[0];
}

/* Hands command `cmd` and its files `fds` (nfds of them) to the process forked ahead:
 * its pid, or -1 if there is none or it cannot take it (it is let go either way). */
static pid_t command_to_ahead(char *cmd, unsigned long cmdlen, int flags, const int *fds,
                              int nfds)
{
    pid_t pid = ahead_pid;
    int chan = ahead_chan;
    ahead_pid = -1;
    ahead_chan = -1;
    if (pid <= 0)
        return -1;
    struct command_head head = {.flags = (uint32_t)flags, .nfds = (uint32_t)nfds,
                                .cmdlen = cmdlen};
    char space[CMSG_SPACE(3 * sizeof(int))];
    memset(space, 0, sizeof space);
    struct iovec iov = {.iov_base = &head, .iov_len = sizeof head};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = space,
                       .msg_controllen = CMSG_SPACE(nfds * sizeof(int))};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
    memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
    ssize_t sent;
    do {
        sent = sendmsg(chan, &m, MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    int ok = sent == (ssize_t)sizeof head && send_full(chan, cmd, cmdlen) == 0;
    close(chan);
    if (!ok) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return -1;
    }
    return pid;
}

/* Runs argv `cmd` in a group of its own with input `infd` (or input the host feeds,
 * or on a terminal, as `flags` say), its stdout and stderr sent as they come, then its
 * exit status (the streaming protocol above). */
static void serve_stream(int conn, char *cmd, unsigned long cmdlen, int infd, int flags)
{
    static struct input in;
    in.fd = -1;
    in.tty = (flags & STREAM_TTY) != 0;
    in.len = in.off = 0;
    int out[2] = {-1, -1}, err[2] = {-1, -1}, feed_pipe[2] = {-1, -1}, master = -1;
    char *slave = NULL;
    int ok;
    if (in.tty) {
        master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
        ok = master >= 0 && grantpt(master) == 0 && unlockpt(master) == 0 &&
             (slave = ptsname(master)) != NULL;
    } else {
        ok = pipe2(out, O_CLOEXEC) == 0 && pipe2(err, O_CLOEXEC) == 0 &&
             (!(flags & STREAM_STDIN) || pipe2(feed_pipe, O_CLOEXEC) == 0);
    }
    if (!ok) {
        send_full(conn, "exit 255\n", 9);
        return;
    }
    int fds[3] = {feed_pipe[0] >= 0 ? feed_pipe[0] : infd, out[1], err[1]}, nfds = 3;
    if (in.tty) {
        fds[0] = open(slave, O_RDWR | O_NOCTTY | O_CLOEXEC);
        nfds = 1;
        if (fds[0] < 0) {
            send_full(conn, "exit 255\n", 9);
            return;
        }
    }
    /* The process forked ahead takes it, or one is forked now. */
    pid_t pid = command_to_ahead(cmd, cmdlen, flags, fds, nfds);
    if (pid < 0) {
        pid = fork();
        if (pid == 0)
            become_command(cmd, cmdlen, in.tty, fds);
    }
    if (in.tty) {
        close(fds[0]);
        /* The terminal's output is the command's stdout and stderr both. */
        out[0] = master;
        in.fd = dup(master);
    } else {
        close(out[1]);
        close(err[1]);
        if (feed_pipe[0] >= 0) {
            close(feed_pipe[0]);
            in.fd = feed_pipe[1];
        }
    }
    if (pid < 0) {
        send_full(conn, "exit 255\n", 9);
        return;
    }
    /* Its own group (a terminal's command leads a session of its own instead: made a
     * group leader first, its setsid would fail). */
    if (!in.tty)
        setpgid(pid, pid);
    fcntl(out[0], F_SETFL, O_NONBLOCK);
    if (err[0] >= 0)
        fcntl(err[0], F_SETFL, O_NONBLOCK);
    if (in.fd >= 0)
        fcntl(in.fd, F_SETFL, O_NONBLOCK);
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    int gone = 0, out_open = 1, err_open = err[0] >= 0, running = 1, status = 255;
    struct timespec begun;
    clock_gettime(CLOCK_MONOTONIC, &begun);
    while (running || (pidfd < 0 && (out_open || err_open))) {
        /* Input the command has not taken: nothing more is read from the host until
         * it has. */
        int waiting = in.fd >= 0 && in.len > in.off;
        struct pollfd p[5] = {
            {.fd = out_open ? out[0] : -1, .events = POLLIN},
            {.fd = err_open ? err[0] : -1, .events = POLLIN},
            {.fd = gone || waiting ? -1 : conn, .events = POLLIN},
            {.fd = pidfd, .events = POLLIN},
            {.fd = waiting ? in.fd : -1, .events = POLLOUT},
        };
        int timeout = -1;
        if (release_fd >= 0) {
            struct timespec now;
            clock_gettime(CLOCK_MONOTONIC, &now);
            long ms = (now.tv_sec - begun.tv_sec) * 1000 + (now.tv_nsec - begun.tv_nsec) / 1000000;
            timeout = ms >= START_MS ? 0 : (int)(START_MS - ms);
            if (timeout == 0)
                release();
        }
        int ready = poll(p, 5, release_fd >= 0 ? timeout : -1);
        if (ready < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        /* A terminal whose last user has gone reads EIO: its end. */
        if (p[0].revents && forward(out[0], "out", conn, &gone) != 0)
            out_open = 0;
        if (p[1].revents && forward(err[0], "err", conn, &gone) != 0)
            err_open = 0;
        /* Its first output on its way to the host (or its end): the start is over. */
        if (p[0].revents || p[1].revents || p[3].revents)
            release();
        if (p[2].revents && control(conn, pid, &in) != 0)
            gone = 1;
        if (p[4].revents)
            feed(&in);
        if (gone)
            kill(-pid, SIGKILL);
        if (pidfd < 0 ? !out_open && !err_open : p[3].revents != 0)
            running = 0;
    }
    int st;
    if (waitpid(pid, &st, 0) == pid)
        status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    /* What it wrote before it ended, then what it left behind goes. */
    if (out_open)
        forward(out[0], "out", conn, &gone);
    if (err_open)
        forward(err[0], "err", conn, &gone);
    kill(-pid, SIGKILL);
    if (in.fd >= 0)
        close(in.fd);
    char head[32];
    int h = snprintf(head, sizeof(head), "exit %d\n", status);
    if (!gone)
        send_full(conn, head, (size_t)h);
}

static void serve(int conn)
{
    unsigned long cmdlen, inlen;
    int stream;
    if (read_request_line(conn, &cmdlen, &inlen, &stream) != 0)
        return;
    char *cmd = malloc(cmdlen + 1);
    char *in = malloc(inlen + 1);
    if (!cmd || !in || read_full(conn, cmd, cmdlen) != 0 || read_full(conn, in, inlen) != 0)
        return;
    cmd[cmdlen] = 0;

    /* The input goes through a file so that writing it cannot block on reading output;
     * no input is /dev/null (a file made, written and removed is a dozen thousand
     * emulated guest kernel instructions more). */
    int infd;
    if (inlen == 0) {
        infd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    } else {
        char path[] = "/tmp/forkvm-agent-XXXXXX";
        infd = mkstemp(path);
        if (infd >= 0 && (write_full(infd, in, inlen) != 0 || lseek(infd, 0, SEEK_SET) != 0)) {
            close(infd);
            infd = -1;
        }
        if (infd >= 0)
            unlink(path);
    }
    if (!stream)
        release();
    if (stream) {
        if (infd < 0)
            send_full(conn, "exit 255\n", 9);
        else
            serve_stream(conn, cmd, cmdlen, infd, stream);
        return;
    }
    int pipefd[2];
    int status = 255;
    size_t outlen = 0;
    char *out = malloc(MAX_OUT);
    if (out && infd >= 0 && pipe(pipefd) == 0) {
        pid_t pid = fork();
        if (pid == 0) {
            dup2(infd, 0);
            close(infd);
            dup2(pipefd[1], 1);
            dup2(pipefd[1], 2);
            close(pipefd[0]);
            close(pipefd[1]);
            close(conn);
            execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
            _exit(255);
        }
        close(pipefd[1]);
        /* Read straight into the reply, with no copy in user space: on the PVM host a
         * large memcpy here came out with 16-byte runs of zeros (the vector registers
         * glibc's memcpy keeps its first and last 16 bytes in were lost across the guest
         * kernel's entries; docs/guest-kernel.md, "Known host problems"). Beyond MAX_OUT
         * the output is read and dropped, so the command never blocks on a full pipe. */
        for (;;) {
            char sink[4096];
            int full = outlen == MAX_OUT;
            ssize_t n = full ? read(pipefd[0], sink, sizeof(sink))
                             : read(pipefd[0], out + outlen, MAX_OUT - outlen);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0)
                break;
            if (!full)
                outlen += (size_t)n;
        }
        close(pipefd[0]);
        int st;
        if (pid > 0 && waitpid(pid, &st, 0) == pid)
            status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    char head[64];
    int h = snprintf(head, sizeof(head), "%d %zu\n", status, outlen);
    if (write_full(conn, head, (size_t)h) == 0)
        write_full(conn, out, outlen);
}

/* Takes the new clone's identity in this process (forkvm-adopt.h: what `forkvm-clone
 * --adopt` does, without a process of its own). Only failures are printed (on the
 * console: a line written there costs about 12,000 emulated guest kernel instructions
 * on the PVM host, in every clone). */
static void adopt_here(int ports)
{
    int rc = adopt(ports, NULL);
    if (rc != 0)
        fprintf(stderr, "forkvm-agent: adopting the clone's identity failed (status %d)\n", rc);
}

/* Adopts the clone's identity (adopt_here) unless one of the agent's processes did in
 * this clone already; returns once it is adopted. */
static void adopt_once(int ports)
{
    struct shared *sh = shared;
    uint64_t now = ports_generation(ports);
    if (__atomic_load_n(&sh->generation, __ATOMIC_ACQUIRE) == now)
        return;
    /* One at a time; a holder that died is waited for 2 s at most. */
    for (int waited_ms = 0; __atomic_exchange_n(&sh->lock, 1, __ATOMIC_ACQUIRE) &&
                            waited_ms < 2000;
         waited_ms++) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (__atomic_load_n(&sh->generation, __ATOMIC_ACQUIRE) != now) {
        adopt_here(ports);
        __atomic_store_n(&sh->generation, now, __ATOMIC_RELEASE);
    }
    __atomic_store_n(&sh->lock, 0, __ATOMIC_RELEASE);
}

/* A connection's process, forked before its connection comes: it says so on `notify`
 * ('w') as it starts to wait in accept, takes the next connection on `s` itself, adopts
 * a new clone's identity if no process of the agent has yet, serves the connection,
 * says when its start is over ('r', release) so that the main process forks the next
 * spare, and keeps the connection open until that one waits in accept (a second at
 * most), so that a VM paused or snapshotted once its last command's connection closed
 * holds a spare. Then the first request in each clone of it is served with no fork
 * (tens of thousands of emulated guest kernel instructions on the PVM host). */
static void spare(int s, int notify, int ports)
{
    signal(SIGCHLD, SIG_DFL);
    /* Its command's process forked ahead too. */
    fork_command_ahead(s, notify);
    /* Made at the main process's lowest priority; a connection is served at the
     * normal one. */
    setpriority(PRIO_PROCESS, 0, 0);
    __atomic_add_fetch(&shared->ready, 1, __ATOMIC_RELEASE);
    futex_wake(&shared->ready);
    ssize_t told = write(notify, "w", 1);
    (void)told;
    int c;
    while ((c = accept4(s, NULL, NULL, SOCK_CLOEXEC)) < 0) {
        if (errno == EINTR || errno == ECONNRESET || errno == ECONNABORTED)
            continue;
        perror("forkvm-agent: accept");
        sleep(1);
    }
    __atomic_sub_fetch(&shared->ready, 1, __ATOMIC_RELEASE);
    close(s);
    release_fd = notify;
    if (ports >= 0)
        adopt_once(ports);
    serve(c);
    release();
    /* A command's process forked ahead and not used: ended and reaped here. */
    if (ahead_pid > 0) {
        close(ahead_chan);
        waitpid(ahead_pid, NULL, 0);
    }
    struct timespec begun, now;
    clock_gettime(CLOCK_MONOTONIC, &begun);
    for (;;) {
        int ready = __atomic_load_n(&shared->ready, __ATOMIC_ACQUIRE);
        clock_gettime(CLOCK_MONOTONIC, &now);
        long ms = (now.tv_sec - begun.tv_sec) * 1000 + (now.tv_nsec - begun.tv_nsec) / 1000000;
        if (ready > 0 || ms >= 1000)
            break;
        futex_wait(&shared->ready, ready, (int)(1000 - ms));
    }
    /* The connection closes as this process exits, after its memory is gone: a host
     * that waits for the close before it pauses or snapshots the VM leaves no exit
     * half done in it. */
    _exit(0);
}

int main(int argc, char **argv)
{
    int background = 0, do_adopt = 1;
    while (argc > 1 && argv[1][0] == '-') {
        if (strcmp(argv[1], "--background") == 0)
            background = 1;
        else if (strcmp(argv[1], "--no-adopt") == 0)
            do_adopt = 0;
        else
            break;
        argc--;
        argv++;
    }
    int ports = do_adopt ? ports_open() : -1;
    shared = mmap(NULL, sizeof(struct shared), PROT_READ | PROT_WRITE,
                  MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED) {
        perror("forkvm-agent: mmap");
        return 1;
    }
    shared->generation = ports >= 0 ? ports_generation(ports) : 0;
    unsigned port = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 0) : 1024;
    /* The disk slots' devices, recorded once for forkvm-oci (forkvm-oci.h). */
    oci_map_slots();
    int s = socket(AF_VSOCK, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_vm addr = {
        .svm_family = AF_VSOCK,
        .svm_port = port,
        .svm_cid = VMADDR_CID_ANY,
    };
    int notify[2];
    if (s < 0 || bind(s, (struct sockaddr *)&addr, sizeof(addr)) != 0 || listen(s, 64) != 0 ||
        pipe2(notify, O_CLOEXEC) != 0) {
        perror("forkvm-agent");
        return 1;
    }
    /* Reap connection handlers automatically. */
    signal(SIGCHLD, SIG_IGN);
    printf("forkvm-agent: listening on port %u\n", port);
    fflush(stdout);
    if (background) {
        pid_t pid = fork();
        if (pid < 0) {
            perror("forkvm-agent: fork");
            return 1;
        }
        if (pid > 0)
            _exit(0);
    }
    /* A spare connection process waiting in accept: the first forked now, each next
     * one once the last one's start is over (at the lowest priority: 'r'), or at once
     * (at the normal one) when a connection waits and no spare does. One is forked at
     * a time: the next not before this one said it waits ('w') or ended. */
    int need = 1, nice = 0, pidfd = -1;
    for (;;) {
        if (need && pidfd < 0 && __atomic_load_n(&shared->ready, __ATOMIC_ACQUIRE) <= 0) {
            setpriority(PRIO_PROCESS, 0, nice);
            pid_t pid = fork();
            if (pid == 0) {
                close(notify[0]);
                spare(s, notify[1], ports);
            }
            if (pid < 0) {
                perror("forkvm-agent: fork");
                sleep(1);
                continue;
            }
            need = 0;
            pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
            if (pidfd < 0) {
                perror("forkvm-agent: pidfd_open");
                pidfd = -1;
            }
        }
        struct pollfd p[3] = {
            {.fd = notify[0], .events = POLLIN},
            {.fd = pidfd, .events = POLLIN},
            {.fd = s, .events = POLLIN},
        };
        if (poll(p, 3, -1) < 0) {
            if (errno != EINTR) {
                perror("forkvm-agent: poll");
                sleep(1);
            }
            continue;
        }
        if (p[0].revents) {
            char said[64];
            ssize_t n = read(notify[0], said, sizeof said);
            for (ssize_t k = 0; k < n; k++) {
                if (said[k] == 'r') {
                    need = 1;
                    nice = 19;
                } else if (said[k] == 'w' && pidfd >= 0) {
                    close(pidfd);
                    pidfd = -1;
                }
            }
        }
        if (pidfd >= 0 && p[1].revents) {
            /* It ended before it waited: another is forked. */
            close(pidfd);
            pidfd = -1;
            need = 1;
        }
        if (p[2].revents) {
            /* Woken with the spare that takes the connection: only a connection still
             * waiting once no spare is left needs one forked now. */
            struct pollfd again = {.fd = s, .events = POLLIN};
            if (__atomic_load_n(&shared->ready, __ATOMIC_ACQUIRE) <= 0 && pidfd < 0) {
                if (poll(&again, 1, 0) == 1) {
                    need = 1;
                    nice = 0;
                }
            } else {
                /* A spare is taking it, or about to wait. */
                struct timespec ts = {0, 1000 * 1000};
                nanosleep(&ts, NULL);
            }
        }
    }
}
