#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>

#include "fastspawn.h"

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 /* Linux 6.1; older libc headers lack it */
#endif

/* Back [addr, addr + len) with transparent huge pages now, synchronously:
 * madvise(2) MADV_COLLAPSE.  The range should be 2 MiB-aligned anonymous
 * memory.
 *
 * Why a fork server wants this: fork() copies one page-table entry per
 * mapped 4 KiB page and every child's exit clears them again; a collapsed
 * range costs one entry per 2 MiB on both paths.  A child that writes into
 * the range splits the mapping in its own page tables only.
 *
 * Returns -1 with errno EINVAL on kernels before 6.1 (and for ranges that
 * cannot be collapsed), EAGAIN or ENOMEM when no huge page could be had:
 * the caller treats all of these as "leave it as it is".
 */
int fs_collapse_hugepages(uintptr_t addr, size_t len)
{
    return madvise((void *)addr, len, MADV_COLLAPSE);
}
