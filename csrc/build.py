"""cffi build script for fastspawn._core (API mode, compiled at install)."""

from cffi import FFI

ffibuilder = FFI()
ffibuilder.cdef(
    """
    typedef int... pid_t;

    int fs_set_pdeathsig(int sig, pid_t expected_ppid);
    int fs_set_child_subreaper(void);

    int fs_pidfd_open(pid_t pid, unsigned int flags);
    int fs_pidfd_send_signal(int pidfd, int sig);
    int fs_pidfd_wait(int pidfd, int nohang, pid_t *pid, int *exit_status);

    int fs_waiter_new(void);
    int fs_waiter_add(int epfd, int fd, uint64_t token);
    int fs_waiter_remove(int epfd, int fd);
    int fs_waiter_wait(int epfd, uint64_t *tokens, int max_tokens, int timeout_ms);

    int fs_collapse_hugepages(uintptr_t addr, size_t len);
    int fs_arena_place(size_t size);
    int fs_arena_region(uintptr_t *base, size_t *size, size_t *used);

    struct fs_launch_spec {
        const char *path;
        char *const *argv;
        char *const *envp;
        const char *cwd;
        int stdin_fd;
        int stdout_fd;
        int stderr_fd;
        const int *keep_fds;
        int n_keep_fds;
        int pdeathsig;
        int new_session;
        int new_process_group;
        int process_group;
        int set_sigmask;
        uint64_t sigmask;
    };
    int fs_launch(const struct fs_launch_spec *spec, int *pidfd);
    int fs_group_anchor(void);
    int fs_group_anchor_release(pid_t anchor);
    int fs_same_file(int a, int b);
    int fs_fd_is(int fd, uint64_t dev, uint64_t ino);
    """
)
ffibuilder.set_source(
    "fastspawn._core",
    '#include "fastspawn.h"',
    # setuptools wants paths relative to the project root.
    sources=[
        f"csrc/{name}"
        for name in (
            "pdeathsig.c",
            "pidfd.c",
            "waiter.c",
            "memory.c",
            "arena.c",
            "launch.c",
            "group.c",
            "fdidentity.c",
        )
    ],
    include_dirs=["csrc"],
    extra_compile_args=["-Wall", "-Wextra", "-O2"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
