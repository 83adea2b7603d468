#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "fastspawn.h"

#ifndef SYS_memfd_create
#if defined(__x86_64__)
#define SYS_memfd_create 319
#elif defined(__aarch64__)
#define SYS_memfd_create 279
#endif
#endif
#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif

/* memfd_create(2), dup3(2), close(2): put a new, empty memfd named
 * "<prefix>:<rank>" at fd `target` (which must be open), close-on-exec.
 *
 * For a fork loop that gives each child a file of its own at one fd number,
 * the one faulthandler was registered on in the parent (see the Python
 * ForkStacks): done here rather than in Python, the parent writes none of
 * its pages between two forks.  Each page it wrote there would stay with
 * the child forked before as a page of that child's own (the parent takes
 * a copy, the child keeps the original): some 15 pages a rank, measured,
 * for the same three calls made from Python.
 *
 * Returns 0, or -1 with errno (EMFILE, ENFILE, ENOMEM; EINVAL for a name
 * past memfd's 249 bytes), `target` then left as it was.
 */
int fs_stacks_file(const char *prefix, int rank, int target)
{
    char name[256];
    int n = snprintf(name, sizeof name, "%s:%d", prefix, rank);

    if (n < 0 || n >= 250) {
        errno = EINVAL;
        return -1;
    }
    int fd = (int)syscall(SYS_memfd_create, name, MFD_CLOEXEC);
    if (fd < 0)
        return -1;
    if (dup3(fd, target, O_CLOEXEC) < 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    close(fd);
    return 0;
}
