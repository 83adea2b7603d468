#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <sys/epoll.h>

#include "fastspawn.h"

/* A sentinel waiter is one epoll(7) set.  Each entry is an fd (a pidfd, a
 * pipe, a socket) with a 64-bit token chosen by the caller; add and remove
 * are O(1), and a wait costs O(ready entries), whatever the set's size.
 */
int fs_waiter_new(void)
{
    return epoll_create1(EPOLL_CLOEXEC);
}

/* Watch `fd` for readability (a pidfd is readable once its process exited;
 * a pipe or socket on data, EOF or error).  EEXIST if already watched.
 */
int fs_waiter_add(int epfd, int fd, uint64_t token)
{
    struct epoll_event ev;

    ev.events = EPOLLIN;
    ev.data.u64 = token;
    return epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev);
}

/* Stop watching `fd`.  Remove an fd before closing it: epoll tracks the open
 * file description, so a closed fd whose file is still open elsewhere (a
 * duplicate) would otherwise keep reporting.  ENOENT if not watched.
 */
int fs_waiter_remove(int epfd, int fd)
{
    struct epoll_event ev = {0};

    return epoll_ctl(epfd, EPOLL_CTL_DEL, fd, &ev);
}

/* Wait up to `timeout_ms` (-1: forever) for watched fds to become ready and
 * store up to `max_tokens` of their tokens: all that are ready, in one
 * epoll_wait (a second call would report the same level-triggered fds again).
 * Returns the count (0 on timeout).  EINTR is returned, not retried, so
 * Python signal handlers run (epoll_wait(2)).
 */
int fs_waiter_wait(int epfd, uint64_t *tokens, int max_tokens, int timeout_ms)
{
    struct epoll_event small[64];
    struct epoll_event *events = small;
    int n, i, saved;

    if (max_tokens <= 0) {
        errno = EINVAL;
        return -1;
    }
    if (max_tokens > 64) {
        events = malloc(sizeof(*events) * (size_t)max_tokens);
        if (events == NULL)
            return -1;
    }
    n = epoll_wait(epfd, events, max_tokens, timeout_ms);
    saved = errno;
    for (i = 0; i < n; i++)
        tokens[i] = events[i].data.u64;
    if (events != small)
        free(events);
    errno = saved;
    return n;
}
