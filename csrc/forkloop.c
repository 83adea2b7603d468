#define _GNU_SOURCE 1
/* The stable ABI only (PyGILState_*, PyOS_*Fork*), as the cffi module. */
#define Py_LIMITED_API 0x030A0000
#include <Python.h>

#include <errno.h>
#include <unistd.h>

#include "fastspawn.h"

/* A child's own set-up, before the interpreter's after-fork work: its
 * process group and its parent-death signal with the race check.  Only
 * async-signal-safe calls.  Returns 0, or the step that failed with errno
 * set. */
static int child_set_up(const struct fs_fork_plan *plan)
{
    if (plan->group > 0 && setpgid(0, plan->group) != 0)
        return FS_FORK_CHILD_SETPGID;
    if (plan->pdeathsig > 0 && fs_set_pdeathsig(plan->pdeathsig, plan->parent) != 0)
        return FS_FORK_PDEATHSIG;
    return FS_FORK_OK;
}

/* Fork ranks plan->next .. plan->nprocs - 1 of a launch from the calling
 * Python process, in one loop that runs no Python between two forks: every
 * page the forking process writes between two forks stays with the child
 * forked before as a page of that child's own (the parent takes a copy),
 * and a Python loop writes a few dozen (frames, refcounts, the pid list).
 *
 * What os.fork() does around fork(2) is done once around the loop: the
 * interpreter's before-fork work (its locks taken, os.register_at_fork's
 * "before" callables), then its after-fork work in the parent once the
 * loop ends, and in each child before it returns.  The loop holds the GIL,
 * as os.fork() does (cffi released it for the call).  os.fork()'s audit
 * event is not raised.
 *
 * Per rank, in the parent: a stack file at plan->stacks_fd when
 * plan->stacks_prefix is set (fs_stacks_file), fork(), setpgid(pid, group)
 * when plan->group > 0 (as shells do: set in both processes; EACCES, EPERM
 * and ESRCH mean the child did it or moved on, and are not failures).
 * In each child: setpgid(0, group), PR_SET_PDEATHSIG with the check that
 * the parent is still plan->parent, and the interpreter's after-fork work.
 * The signal mask stays the parent's: a signal the caller blocked for the
 * loop is let through by the rank's own code once it can handle what a
 * handler raises (here, the first Python to run after the return would
 * be the caller's loop, in the child).
 *
 * Returns, in a child, its rank; -2 in a child whose set-up failed, its
 * rank in plan->next, the step that failed in plan->failed_step, errno in
 * plan->error (the child's own copy).  In the parent: -1,
 * pids[rank] set for every rank forked and plan->next the rank to fork next;
 * plan->failed_step says why the loop stopped early (FS_FORK_OK: it did
 * not), with errno in plan->error: a stack file that could not be made
 * (no rank forked for it: the caller may go on without stacks) or fork(),
 * setpgid() failing (the rank at plan->next - 1 forked, not in its group).
 */
int fs_fork_ranks(struct fs_fork_plan *plan, pid_t *pids)
{
    int nprocs = plan->nprocs;
    int next = plan->next;
    int step = FS_FORK_OK;
    int error = 0;
    int rank = -1;
    PyGILState_STATE gil = PyGILState_Ensure();

    PyOS_BeforeFork();
    while (next < nprocs) {
        if (plan->stacks_prefix != NULL
            && fs_stacks_file(plan->stacks_prefix, next, plan->stacks_fd) != 0) {
            step = FS_FORK_STACKS;
            error = errno;
            break;
        }
        pid_t pid = fork();
        if (pid == 0) {
            rank = next;
            break;
        }
        if (pid < 0) {
            step = FS_FORK_FORK;
            error = errno;
            break;
        }
        pids[next++] = pid;
        if (plan->group > 0 && setpgid(pid, plan->group) != 0
            && errno != EACCES && errno != EPERM && errno != ESRCH) {
            step = FS_FORK_SETPGID;
            error = errno;
            break;
        }
    }
    if (rank >= 0) {
        step = child_set_up(plan);
        error = step == FS_FORK_OK ? 0 : errno;
        PyOS_AfterFork_Child();
    } else {
        PyOS_AfterFork_Parent();
    }
    plan->next = next;
    plan->failed_step = step;
    plan->error = error;
    PyGILState_Release(gil);
    if (rank >= 0 && step != FS_FORK_OK)
        return -2;
    return rank;
}
