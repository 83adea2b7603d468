#define _GNU_SOURCE
#include <errno.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "fastspawn.h"

#ifndef SYS_kcmp
#define SYS_kcmp 312
#endif
#ifndef KCMP_FILE
#define KCMP_FILE 0
#endif

/* kcmp(2) with KCMP_FILE: whether fds `a` and `b` of this process refer to
 * the same open file description (dup'd, inherited or passed over a socket:
 * one file offset, one set of status flags).  Returns 1 if so, 0 if not.
 * ENOSYS without CONFIG_KCMP, EPERM where a seccomp policy (some container
 * runtimes) or ptrace restrictions refuse it: the caller then cannot tell.
 */
int fs_same_file(int a, int b)
{
    pid_t self = getpid();
    long r = syscall(SYS_kcmp, self, self, KCMP_FILE, (unsigned long)a, (unsigned long)b);

    if (r < 0)
        return -1;
    return r == 0 ? 1 : 0;
}

/* fstat(2) reduced to a yes/no: 1 if `fd` is open on the file whose device
 * and inode numbers are `dev` and `ino`, 0 if it is open on another one or
 * closed (EBADF).  A worker checks its report channel with it before each
 * report: the same check from Python would build a stat result, and the
 * pages that takes would be copied in every worker.
 */
int fs_fd_is(int fd, uint64_t dev, uint64_t ino)
{
    struct stat st;

    if (fstat(fd, &st) != 0)
        return errno == EBADF ? 0 : -1;
    return (uint64_t)st.st_dev == dev && (uint64_t)st.st_ino == ino;
}
