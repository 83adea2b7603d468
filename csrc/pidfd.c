#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fastspawn.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif
#ifndef P_PIDFD
#define P_PIDFD 3
#endif

/* pidfd_open(2): a file descriptor that refers to process `pid`.  It stays
 * bound to that process even after the pid is recycled (pid_max may be as
 * low as 32768), polls readable once the process has exited, and is
 * close-on-exec.  ENOSYS on kernels before 5.3 stays visible to the caller.
 */
int fs_pidfd_open(pid_t pid, unsigned int flags)
{
    return (int)syscall(SYS_pidfd_open, pid, flags);
}

/* pidfd_send_signal(2): signal the process behind `pidfd`, never a process
 * that happened to reuse its pid.  ESRCH once it has exited.
 */
int fs_pidfd_send_signal(int pidfd, int sig)
{
    return (int)syscall(SYS_pidfd_send_signal, pidfd, sig, NULL, 0U);
}

/* tgkill(2): send `sig` to thread `tid` of thread group `tgid`, and to no
 * other thread.  A process-directed kill(2) goes to any thread that does not
 * block the signal, so a signal the main thread blocks (pthread_sigmask
 * blocks it in the calling thread only) can still reach, and by its default
 * action kill, a process through a thread started before the block.  ESRCH
 * when `tid` is not a thread of `tgid` (gone, or both reused).
 */
int fs_tgkill(pid_t tgid, pid_t tid, int sig)
{
    return (int)syscall(SYS_tgkill, tgid, tid, sig);
}

/* waitid(2) with P_PIDFD and WEXITED: reap the child behind `pidfd`.
 *
 * On success *pid is the reaped pid (0 when `nohang` is set and the child is
 * still running) and *exit_status follows multiprocessing's convention: the
 * exit code, or minus the signal number for a child killed by a signal.
 * Blocking waits return EINTR instead of retrying, so Python signal handlers
 * (Ctrl-C) run.  ECHILD: not our child, or already reaped.
 */
int fs_pidfd_wait(int pidfd, int nohang, pid_t *pid, int *exit_status)
{
    siginfo_t info;

    memset(&info, 0, sizeof(info));
    if (waitid((idtype_t)P_PIDFD, (id_t)pidfd, &info,
               WEXITED | (nohang ? WNOHANG : 0)) != 0)
        return -1;
    *pid = info.si_pid;
    if (info.si_pid == 0)
        *exit_status = 0;
    else if (info.si_code == CLD_EXITED)
        *exit_status = info.si_status;
    else
        *exit_status = -info.si_status;
    return 0;
}
