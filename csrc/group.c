#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fastspawn.h"

struct anchor_args {
    volatile int err;   /* written by the child before it exits */
};

static int anchor_main(void *opaque)
{
    struct anchor_args *args = opaque;

    /* Its zombie's name (ps shows "[fastspawn-group] <defunct>"), how the
     * zygote's spare anchor is told from a leak; kept in step with
     * oscall.ANCHOR_NAME.  A name is no reason to fail: its result goes. */
    (void)prctl(PR_SET_NAME, (unsigned long)"fastspawn-group", 0UL, 0UL, 0UL);
    if (setpgid(0, 0) != 0)
        args->err = errno ? errno : EINVAL;
    _exit(0);
    return 0;
}

/* Start a process that makes a new process group and exits at once, and
 * return its pid: the id of that group.  Left unreaped, its zombie keeps the
 * group (and the id) in existence, so others can join it with setpgid(2);
 * once they have, fs_group_anchor_release() reaps it and the group lives on
 * with them.  A group led this way leaves none of its real members its
 * leader, and so free to setsid(2).
 *
 * clone(2) with CLONE_VM | CLONE_VFORK, as fs_launch: nothing is copied, and
 * the child runs two system calls on a stack of the caller's, which is
 * suspended meanwhile.  Every signal stays blocked in the child: no handler
 * of the caller's can run on the shared memory.  Its exit signal is none, so
 * the caller gets no SIGCHLD for it and a wait for any child (waitpid(-1),
 * without __WALL) neither sees nor reaps it.  EPERM and the like come back
 * as -1 with the child's errno, the child reaped.
 */
int fs_group_anchor(void)
{
    char stack[16 * 1024] __attribute__((aligned(16)));
    struct anchor_args args;
    sigset_t all, old;
    pid_t pid;
    int saved;

    args.err = 0;
    sigfillset(&all);
    /* pthread_sigmask returns its error, and leaves errno alone. */
    saved = pthread_sigmask(SIG_SETMASK, &all, &old);
    if (saved != 0) {
        errno = saved;
        return -1;
    }
    pid = clone(anchor_main, stack + sizeof(stack), CLONE_VM | CLONE_VFORK, &args);
    saved = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (pid < 0) {
        errno = saved;
        return -1;
    }
    if (args.err != 0) {
        fs_group_anchor_release(pid);
        errno = args.err;
        return -1;
    }
    return pid;
}

/* Reap an anchor from fs_group_anchor (its group lives on while it has
 * members). */
int fs_group_anchor_release(pid_t anchor)
{
    int status;

    while (waitpid(anchor, &status, __WALL) < 0)
        if (errno != EINTR)
            return -1;
    return 0;
}
