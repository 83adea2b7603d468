/* fastspawn C core: thin wrappers over the Linux process syscalls.
 *
 * Every function returns >= 0 on success and -1 with errno set on failure.
 * Results come back through out-pointers.  Nothing here prints or exits the
 * calling process; the policy lives in Python.  The one piece of global
 * state is arena.c's region, as the allocator hook it serves is process-wide.
 *
 * This header is the one definition of the API: build.py strips its comments
 * and preprocessor lines and hands the rest to cffi's cdef.  So below the
 * includes it holds only what cdef parses: declarations of functions,
 * structs and enums (no macros, no inline functions); a system type other
 * than the <stdint.h> ones needs a line in build.py, as pid_t has.
 */
#ifndef FASTSPAWN_H
#define FASTSPAWN_H

#include <stdint.h>
#include <sys/types.h>

/* pdeathsig.c */
int fs_set_pdeathsig(int sig, pid_t expected_ppid);
int fs_set_child_subreaper(void);
int fs_set_name(const char *name);

/* pidfd.c */
int fs_pidfd_open(pid_t pid, unsigned int flags);
int fs_pidfd_send_signal(int pidfd, int sig);
int fs_tgkill(pid_t tgid, pid_t tid, int sig);
int fs_pidfd_wait(int pidfd, int nohang, pid_t *pid, int *exit_status);

/* waiter.c */
int fs_waiter_new(void);
int fs_waiter_add(int epfd, int fd, uint64_t token);
int fs_waiter_remove(int epfd, int fd);
int fs_waiter_wait(int epfd, uint64_t *tokens, int max_tokens, int timeout_ms);

/* memory.c */
int fs_collapse_hugepages(uintptr_t addr, size_t len);

/* arena.c */
int fs_arena_place(size_t size);
int fs_arena_region(uintptr_t *base, size_t *size, size_t *used);

/* launch.c: clone + exec of a binary */
struct fs_rlimit {
    int resource;              /* RLIMIT_* */
    uint64_t soft;             /* RLIM_INFINITY is ~0 */
    uint64_t hard;
};

struct fs_launch_spec {
    const char *path;          /* absolute or relative path of the binary */
    char *const *argv;         /* NULL-terminated */
    char *const *envp;         /* NULL-terminated */
    const char *cwd;           /* NULL: inherit */
    int stdin_fd;              /* -1: inherit the parent's fd 0 */
    int stdout_fd;             /* -1: inherit the parent's fd 1 */
    int stderr_fd;             /* -1: inherit the parent's fd 2 */
    const int *keep_fds;       /* fds >= 3 kept open, at the same numbers */
    int n_keep_fds;
    int pdeathsig;             /* 0: none */
    int new_session;           /* non-zero: setsid() in the child */
    int new_process_group;     /* non-zero: setpgid(0, 0) in the child */
    int process_group;         /* > 0: setpgid(0, it) in the child */
    int set_sigmask;           /* non-zero: the child's signal mask is sigmask */
    uint64_t sigmask;          /* bit n-1 blocks signal n; else the parent's mask */
    uint64_t default_signals;  /* bit n-1: signal n back to SIG_DFL even if ignored */
    /* The process settings a child would otherwise inherit (see _procstate):
     * applied best effort, a refusal noted on the child's stderr. */
    int set_umask;             /* non-zero: umask(umask) */
    unsigned int umask;
    int set_nice;              /* non-zero: setpriority(PRIO_PROCESS, 0, nice) */
    int nice;
    const unsigned long *affinity;  /* a CPU mask (sched_setaffinity(2)); NULL: inherit */
    size_t affinity_size;      /* its size in bytes */
    const struct fs_rlimit *rlimits;  /* setrlimit() each */
    int n_rlimits;
};


/* The step of a launch that failed, fs_launch's *failed_step: what errno is
 * about (ENOENT from FS_STEP_CHDIR is the cwd's, not the binary's). */
enum fs_launch_step {
    FS_STEP_NONE = 0,          /* the launch succeeded */
    FS_STEP_CLONE = 1,         /* in the caller: the child's stack, clone(2) */
    FS_STEP_PDEATHSIG = 2,     /* in the child: PR_SET_PDEATHSIG, ppid check */
    FS_STEP_SETSID = 3,        /* setsid() for new_session */
    FS_STEP_SETPGID = 4,       /* setpgid(): new_process_group, process_group */
    FS_STEP_STDIO = 5,         /* stdin_fd, stdout_fd, stderr_fd onto 0..2 */
    FS_STEP_KEEP_FDS = 6,      /* keep_fds made inheritable */
    FS_STEP_CHDIR = 7,         /* chdir(cwd) */
    FS_STEP_SIGMASK = 8,       /* the program's signal mask */
    FS_STEP_EXEC = 9           /* execve(path) */
};
int fs_launch(const struct fs_launch_spec *spec, int *pidfd, int *failed_step);

/* group.c: process groups whose leader is gone */
int fs_group_anchor(void);
int fs_group_anchor_release(pid_t anchor);

/* fdidentity.c: which file, or open file description, an fd is */
int fs_same_file(int a, int b);
int fs_fd_is(int fd, uint64_t dev, uint64_t ino);

/* stacks.c: each forked rank's own file for its stack dump */
int fs_stacks_file(const char *prefix, int rank, int target);

/* forkloop.c: a launch's fork loop in the zygote (see fs_fork_ranks) */
struct fs_fork_plan {
    int nprocs;                /* ranks in the launch */
    int next;                  /* in: the rank to fork first; out: the next */
    pid_t parent;              /* the forking process: the pdeathsig check */
    int pdeathsig;             /* armed in each rank; 0: none */
    int group;                 /* > 0: the process group of every rank */
    const char *stacks_prefix; /* non-NULL: each rank's stack file (stacks.c) */
    int stacks_fd;             /* at this fd */
    int failed_step;           /* out: an fs_fork_step */
    int error;                 /* out: its errno */
};

/* What failed in fs_fork_ranks, its plan's failed_step. */
enum fs_fork_step {
    FS_FORK_OK = 0,
    FS_FORK_STACKS = 1,        /* in the parent: the rank's stack file */
    FS_FORK_FORK = 2,          /* fork(2) */
    FS_FORK_SETPGID = 3,       /* setpgid(pid, group) */
    FS_FORK_CHILD_SETPGID = 4, /* in the child: setpgid(0, group) */
    FS_FORK_PDEATHSIG = 5      /* PR_SET_PDEATHSIG, the parent check (ESRCH) */
};
int fs_fork_ranks(struct fs_fork_plan *plan, pid_t *pids);

#endif
