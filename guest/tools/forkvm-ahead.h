/*
 * forkvm-ahead.h: a command's process forked ahead of its command (forkvm-agent's
 * spares fork one each before their connection comes), which takes its argv and its
 * files over a socket pair (SCM_RIGHTS) and becomes the command; and what any command's
 * process does once it knows its command.
 */
#ifndef FORKVM_AHEAD_H
#define FORKVM_AHEAD_H

#include "forkvm-stream.h"

#include <sys/resource.h>
#include <sys/wait.h>

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

#endif
