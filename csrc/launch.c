#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fastspawn.h"
#include "sigbits.h"

#ifndef CLONE_PIDFD
#define CLONE_PIDFD 0x00001000
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

/* The child's stack.  The child only runs the short, async-signal-safe
 * sequence below, so this is generous. */
#define CHILD_STACK_SIZE (64 * 1024)

struct child_args {
    const struct fs_launch_spec *spec;
    pid_t parent;
    sigset_t parent_mask;
    /* Written by the child, read after it exec'd or died: */
    volatile int step;  /* the enum fs_launch_step that failed */
    volatile int err;   /* its errno; non-zero means the launch failed */
};

/* Between clone and exec the child shares the parent's memory (CLONE_VM), so
 * it may only make async-signal-safe calls and must not touch the heap.  It
 * reports a failure by storing the failed step and its errno in `args` and
 * exiting: the parent (suspended by CLONE_VFORK until exec or exit) reads
 * them after.  Two stores to memory and _exit(2): async-signal-safe. */
__attribute__((noreturn))
static void child_fail(struct child_args *args, enum fs_launch_step step)
{
    int err = errno;

    args->step = step;
    args->err = err ? err : EINVAL;
    _exit(127);
}

static int set_inheritable(int fd)
{
    int flags = fcntl(fd, F_GETFD);

    if (flags < 0)
        return -1;
    return fcntl(fd, F_SETFD, flags & ~FD_CLOEXEC);
}

/* Mark every fd >= 3 close-on-exec.  close_range(2) does it in one call on
 * Linux >= 5.11; before that, walk up to the soft fd limit. */
static int cloexec_from(int lowfd)
{
    struct rlimit rl;
    int fd;

    if (syscall(SYS_close_range, (unsigned)lowfd, ~0U, CLOSE_RANGE_CLOEXEC) == 0)
        return 0;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY)
        rl.rlim_cur = 65536;
    for (fd = lowfd; fd < (int)rl.rlim_cur; fd++) {
        int flags = fcntl(fd, F_GETFD);
        if (flags >= 0 && !(flags & FD_CLOEXEC))
            fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
    }
    return 0;
}

/* Reset every caught signal to its default.  Signals are blocked (the parent
 * blocked them before clone), and must stay so until this ran: a handler of
 * the parent's running here would run on shared memory.  SIGPIPE goes back
 * to default as well; Python ignores it and binaries expect the default.
 * So do the ignored signals in default_signals (the zygote ignores SIGINT,
 * Python SIGXFSZ). */
static void reset_signal_handlers(uint64_t default_signals)
{
    struct sigaction sa;
    int sig;

    memset(&sa, 0, sizeof(sa));
    for (sig = 1; sig < NSIG; sig++) {
        struct sigaction old;
        if (sig == SIGKILL || sig == SIGSTOP)
            continue;
        if (sigaction(sig, NULL, &old) != 0)
            continue;
        if (old.sa_handler != SIG_DFL &&
            (old.sa_handler != SIG_IGN || sig == SIGPIPE ||
             (sig <= 64 && (default_signals & (1ULL << (sig - 1)))))) {
            sa.sa_handler = SIG_DFL;
            sigaction(sig, &sa, NULL);
        }
    }
}

/* setsid(), or setpgid() into a new group or the spec's one: 0, or -1 with
 * errno. */
static int set_group(const struct fs_launch_spec *s)
{
    if (s->new_session)
        return setsid() < 0 ? -1 : 0;
    if (s->new_process_group)
        return setpgid(0, 0);
    if (s->process_group > 0)
        return setpgid(0, s->process_group);
    return 0;
}

/* Put the spec's stdin/stdout/stderr fds on 0..2, inheritable. */
static int redirect_stdio(const struct fs_launch_spec *s)
{
    int std_fds[3];
    int i;

    std_fds[0] = s->stdin_fd;
    std_fds[1] = s->stdout_fd;
    std_fds[2] = s->stderr_fd;
    /* First move sources that sit on 0..2 out of the way, so that e.g.
     * stdout_fd == 2 and stderr_fd == 1 do not clobber each other. */
    for (i = 0; i < 3; i++) {
        if (std_fds[i] >= 0 && std_fds[i] < 3 && std_fds[i] != i) {
            int moved = fcntl(std_fds[i], F_DUPFD_CLOEXEC, 3);
            if (moved < 0)
                return -1;
            std_fds[i] = moved;
        }
    }
    for (i = 0; i < 3; i++) {
        if (std_fds[i] < 0)
            continue;
        if (std_fds[i] == i) {
            if (set_inheritable(i) != 0)
                return -1;
        } else if (dup2(std_fds[i], i) < 0) {
            return -1;
        }
    }
    return 0;
}

/* Every fd >= 3 close-on-exec but the spec's keep_fds. */
static int keep_only_keep_fds(const struct fs_launch_spec *s)
{
    int i;

    cloexec_from(3);
    for (i = 0; i < s->n_keep_fds; i++)
        if (s->keep_fds[i] >= 3 && set_inheritable(s->keep_fds[i]) != 0)
            return -1;
    return 0;
}

/* The signal mask the program starts with: the one the spec gives, or the
 * parent's from before the launch blocked everything. */
static int set_program_mask(const struct fs_launch_spec *s, const sigset_t *parent_mask)
{
    sigset_t mask;

    if (!s->set_sigmask)
        return sigprocmask(SIG_SETMASK, parent_mask, NULL);
    /* The parent's own mask is a held one (every signal blocked across a
     * launch), which a program must not start with. */
    fs_sigset_from_bits(s->sigmask, &mask);
    return sigprocmask(SIG_SETMASK, &mask, NULL);
}

/* A refused process setting, noted on the child's stderr (write(2) only:
 * async-signal-safe). */
static void note_kept(const char *what)
{
    static const char head[] = "fastspawn: this rank keeps its launcher's ";
    ssize_t ignored;

    ignored = write(2, head, sizeof(head) - 1);
    ignored = write(2, what, strlen(what));
    ignored = write(2, "\n", 1);
    (void)ignored;
}

/* The spec's umask, nice value, CPU affinity and resource limits, as a
 * fresh child of the caller would have them.  Best effort, as for a forked
 * worker (_procstate.apply): what the kernel refuses (a lower nice value or
 * a higher hard limit without the privilege, a CPU outside the cpuset) is
 * noted and left as inherited. */
static void apply_process_settings(const struct fs_launch_spec *s)
{
    int i;

    if (s->set_umask)
        umask((mode_t)s->umask);
    if (s->set_nice && setpriority(PRIO_PROCESS, 0, s->nice) != 0)
        note_kept("nice value");
    if (s->affinity != NULL &&
        sched_setaffinity(0, s->affinity_size, (const cpu_set_t *)s->affinity) != 0)
        note_kept("CPU affinity");
    for (i = 0; i < s->n_rlimits; i++) {
        struct rlimit rl;

        rl.rlim_cur = (rlim_t)s->rlimits[i].soft;
        rl.rlim_max = (rlim_t)s->rlimits[i].hard;
        if (setrlimit(s->rlimits[i].resource, &rl) != 0)
            note_kept("resource limit");
    }
}

static int child_main(void *opaque)
{
    struct child_args *args = opaque;
    const struct fs_launch_spec *s = args->spec;

    reset_signal_handlers(s->default_signals);
    if (s->pdeathsig > 0 && fs_set_pdeathsig(s->pdeathsig, args->parent) != 0)
        child_fail(args, FS_STEP_PDEATHSIG);
    if (set_group(s) != 0)
        child_fail(args, s->new_session ? FS_STEP_SETSID : FS_STEP_SETPGID);
    if (redirect_stdio(s) != 0)
        child_fail(args, FS_STEP_STDIO);
    /* Before the settings: a lower soft RLIMIT_NOFILE than the parent's
     * would end cloexec_from's walk (kernels before 5.11) short of the
     * parent's higher fds. */
    if (keep_only_keep_fds(s) != 0)
        child_fail(args, FS_STEP_KEEP_FDS);
    apply_process_settings(s);
    if (s->cwd != NULL && chdir(s->cwd) != 0)
        child_fail(args, FS_STEP_CHDIR);
    if (set_program_mask(s, &args->parent_mask) != 0)
        child_fail(args, FS_STEP_SIGMASK);
    execve(s->path, s->argv, s->envp);
    child_fail(args, FS_STEP_EXEC);
}

/* Start `spec->path` as a new process and return its pid, with a pidfd in
 * *pidfd and FS_STEP_NONE in *failed_step.
 *
 * clone(2) with CLONE_VM | CLONE_VFORK, as posix_spawn(3) does: no page
 * tables are copied, so the cost does not grow with the parent's memory, and
 * the parent sleeps until the child has exec'd or failed.  CLONE_PIDFD hands
 * back a pidfd atomically.  In the child, before exec: signal handlers reset,
 * PR_SET_PDEATHSIG armed and the parent re-checked (fs_set_pdeathsig), an
 * optional setsid() or setpgid() (a new group, or joining one), stdio
 * redirected, every fd but 0..2 and keep_fds closed on exec, cwd changed, the
 * signal mask set (the parent's, or the one the spec gives).  A failure in any
 * of those steps, the exec included, comes back here as -1 with the child's
 * errno (ENOENT, EACCES, ...), the step in *failed_step, and the child
 * already reaped: so ENOENT from FS_STEP_CHDIR is the cwd's, not the
 * binary's.  A failure before the child ran (the mmap of its stack, clone(2)
 * itself) is FS_STEP_CLONE.
 *
 * PR_SET_PDEATHSIG is tied to the calling *thread*: call this from a thread
 * that lives as long as the process.
 */
int fs_launch(const struct fs_launch_spec *spec, int *pidfd, int *failed_step)
{
    struct child_args args;
    sigset_t all;
    void *stack;
    pid_t pid;
    int saved;

    memset(&args, 0, sizeof(args));
    args.spec = spec;
    args.parent = getpid();
    *pidfd = -1;
    *failed_step = FS_STEP_CLONE;

    stack = mmap(NULL, CHILD_STACK_SIZE, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (stack == MAP_FAILED)
        return -1;

    sigfillset(&all);
    /* pthread_sigmask returns its error, and leaves errno alone. */
    saved = pthread_sigmask(SIG_SETMASK, &all, &args.parent_mask);
    if (saved != 0) {
        munmap(stack, CHILD_STACK_SIZE);
        errno = saved;
        return -1;
    }
    pid = clone(child_main, (char *)stack + CHILD_STACK_SIZE,
                CLONE_VM | CLONE_VFORK | CLONE_PIDFD | SIGCHLD, &args, pidfd);
    saved = errno;
    pthread_sigmask(SIG_SETMASK, &args.parent_mask, NULL);
    munmap(stack, CHILD_STACK_SIZE);

    if (pid < 0) {
        errno = saved;
        return -1;
    }
    if (args.err != 0) {
        int status;
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
            ;
        if (*pidfd >= 0)
            close(*pidfd);
        *pidfd = -1;
        *failed_step = args.step;
        errno = args.err;
        return -1;
    }
    *failed_step = FS_STEP_NONE;
    return pid;
}
