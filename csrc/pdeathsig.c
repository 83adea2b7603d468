#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "fastspawn.h"

/* Arm PR_SET_PDEATHSIG(2const) with `sig` for the calling process, then
 * re-check the parent.
 *
 * The signal only fires on the parent's death *after* prctl() ran: a parent
 * that died between fork() and here has already reparented us, and nothing
 * would ever fire.  So the caller passes the parent pid it recorded before
 * forking; if getppid() no longer matches, this returns -1 with errno ESRCH and
 * the caller must exit.  Async-signal-safe: usable between fork and exec.
 *
 * Note the kernel sends the signal when the parent *thread* that forked us
 * exits, not the parent process: fork from a thread that lives as long as
 * the process.
 */
int fs_set_pdeathsig(int sig, pid_t expected_ppid)
{
    if (prctl(PR_SET_PDEATHSIG, (unsigned long)sig, 0UL, 0UL, 0UL) != 0)
        return -1;
    if (expected_ppid > 0 && getppid() != expected_ppid) {
        errno = ESRCH;
        return -1;
    }
    return 0;
}

/* Make the calling process a child subreaper (PR_SET_CHILD_SUBREAPER(2const)):
 * orphaned descendants are reparented to it instead of to init, so it can
 * find and kill what its children left running.  Not inherited by fork.
 */
int fs_set_child_subreaper(void)
{
    return prctl(PR_SET_CHILD_SUBREAPER, 1UL, 0UL, 0UL, 0UL);
}

/* Name the calling thread `name` (PR_SET_NAME(2const): its comm, truncated
 * to 15 bytes), which for a single-threaded process is the process's name,
 * as a write to /proc/self/comm sets it, without a file to open or write.
 */
int fs_set_name(const char *name)
{
    return prctl(PR_SET_NAME, (unsigned long)name, 0UL, 0UL, 0UL);
}
