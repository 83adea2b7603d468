#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#include "fastspawn.h"

/* Python's object allocator (pymalloc) takes memory from the system in
 * arenas of 1 MiB (256 KiB before 3.10), each its own mmap(2).  The kernel
 * places them wherever it likes, so a zygote's few MiB of objects end up in
 * several mappings with few whole 2 MiB-aligned stretches: madvise(2)
 * MADV_COLLAPSE cannot turn them into huge pages, and every fork() copies,
 * and every child's exit clears, one page-table entry per 4 KiB of them.
 *
 * fs_arena_place() hands pymalloc an arena allocator (the hook of
 * PyObject_SetArenaAllocator, "Customize pymalloc Arena Allocator" in the C
 * API docs) that carves arenas out of one reserved, 2 MiB-aligned region,
 * lowest free slot first, so that the objects of a process lie together and
 * can be collapsed.
 *
 * This is the one piece of global state in the C core, because the hook is
 * process-wide: one region per process, inherited across fork() like the
 * rest of the heap.  Concurrent calls (interpreters with their own GIL,
 * Python 3.12+) are safe: the slot bitmap and the high-water mark change only
 * through atomic operations.  Requests the region cannot serve (another
 * size, the region full, an arena allocated before the switch) go to the
 * allocator that was installed before.
 */

/* PyObjectArenaAllocator's layout, Include/cpython/objimpl.h (unchanged
 * since Python 3.4).  Declared here because the C core is built against the
 * limited API, which leaves the hook out.  Weak, so that an interpreter
 * without the hook (PyPy) still loads the module and gets ENOSYS. */
typedef struct {
    void *ctx;
    void *(*alloc)(void *ctx, size_t size);
    void (*free)(void *ctx, void *ptr, size_t size);
} fs_arena_allocator;

extern void PyObject_GetArenaAllocator(fs_arena_allocator *allocator) __attribute__((weak));
extern void PyObject_SetArenaAllocator(fs_arena_allocator *allocator) __attribute__((weak));

#define FS_ALIGN (2UL << 20)
/* Python's data-stack chunks come through the hook too; they are smaller. */
#define FS_MIN_SLOT (256UL << 10)
#define FS_MAX_REGION (1UL << 30)
#define FS_WORDS (FS_MAX_REGION / FS_MIN_SLOT / 64)

static struct {
    fs_arena_allocator previous;
    char *base;
    size_t size;                 /* bytes reserved */
    size_t slot;                 /* arena size, fixed by the first request */
    size_t slots;                /* size / slot */
    size_t high;                 /* slots handed out at least once (atomic) */
    uint64_t free_map[FS_WORDS]; /* set bit: slot below high, free (atomic) */
} region;

static int slot_in_region(const void *ptr, size_t *index)
{
    const char *p = ptr;
    if (region.slot == 0 || p < region.base || p >= region.base + region.size)
        return 0;
    *index = (size_t)(p - region.base) / region.slot;
    return 1;
}

/* A slot freed earlier, lowest first; its pages are zero (MADV_DONTNEED). */
static void *reuse_slot(void)
{
    size_t words = (region.slots + 63) / 64;
    for (size_t w = 0; w < words; w++) {
        uint64_t bits = __atomic_load_n(&region.free_map[w], __ATOMIC_ACQUIRE);
        while (bits != 0) {
            uint64_t bit = bits & -bits;
            uint64_t before = __atomic_fetch_and(&region.free_map[w], ~bit, __ATOMIC_ACQ_REL);
            if (before & bit)
                return region.base + (w * 64 + (size_t)__builtin_ctzll(bit)) * region.slot;
            bits = before & ~bit; /* another thread took it: try the rest */
        }
    }
    return NULL;
}

static void *arena_alloc(void *ctx, size_t size)
{
    (void)ctx;
    if (region.slot == 0 && size >= FS_MIN_SLOT && size <= FS_ALIGN && (size & (size - 1)) == 0) {
        size_t expected = 0;
        if (__atomic_compare_exchange_n(&region.slot, &expected, size, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            __atomic_store_n(&region.slots, region.size / size, __ATOMIC_RELEASE);
    }
    if (size == __atomic_load_n(&region.slot, __ATOMIC_ACQUIRE)) {
        void *p = reuse_slot();
        if (p != NULL)
            return p;
        size_t index = __atomic_fetch_add(&region.high, 1, __ATOMIC_ACQ_REL);
        if (index < __atomic_load_n(&region.slots, __ATOMIC_ACQUIRE)) {
            /* Reserved PROT_NONE: committing it here charges the memory as
             * a fresh mmap would.  Whole 2 MiB stretches, so that the last
             * one can be collapsed too; they merge into one mapping. */
            char *stretch = region.base + index * size / FS_ALIGN * FS_ALIGN;
            if (mprotect(stretch, FS_ALIGN, PROT_READ | PROT_WRITE) == 0)
                return region.base + index * size;
        }
    }
    return region.previous.alloc(region.previous.ctx, size);
}

static void arena_free(void *ctx, void *ptr, size_t size)
{
    (void)ctx;
    size_t index;
    if (!slot_in_region(ptr, &index)) {
        region.previous.free(region.previous.ctx, ptr, size);
        return;
    }
    /* Give the pages back, keep the slot mapped for the next arena. */
    madvise(ptr, size, MADV_DONTNEED);
    __atomic_fetch_or(&region.free_map[index / 64], 1ULL << (index % 64), __ATOMIC_ACQ_REL);
}

/* Reserve `size` bytes (a multiple of 2 MiB, at most 1 GiB) of address space,
 * 2 MiB-aligned and PROT_NONE (nothing is committed until an arena is handed
 * out), and route pymalloc's new arenas there.  Call it early, before the
 * imports whose objects should land in the region; arenas that exist already
 * stay where they are.
 *
 * The region is address space only, but it counts against RLIMIT_AS
 * (ulimit -v) like any mapping.
 *
 * Returns -1 with errno EINVAL (bad size), EBUSY (already placed in this
 * process), ENOSYS (no arena hook in this interpreter) or mmap(2)'s errno.
 */
int fs_arena_place(size_t size)
{
    if (size == 0 || size % FS_ALIGN != 0 || size > FS_MAX_REGION) {
        errno = EINVAL;
        return -1;
    }
    if (region.base != NULL) {
        errno = EBUSY;
        return -1;
    }
    if (PyObject_GetArenaAllocator == NULL || PyObject_SetArenaAllocator == NULL) {
        errno = ENOSYS;
        return -1;
    }
    /* Over-reserve by one alignment unit, then trim both ends. */
    char *raw = mmap(NULL, size + FS_ALIGN, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
    if (raw == MAP_FAILED)
        return -1;
    char *base = (char *)(((uintptr_t)raw + FS_ALIGN - 1) & ~(uintptr_t)(FS_ALIGN - 1));
    if (base > raw)
        munmap(raw, (size_t)(base - raw));
    munmap(base + size, (size_t)(raw + FS_ALIGN - base));
    region.base = base;
    region.size = size;
    PyObject_GetArenaAllocator(&region.previous);
    fs_arena_allocator mine = {NULL, arena_alloc, arena_free};
    PyObject_SetArenaAllocator(&mine);
    return 0;
}

/* Where the region lies: its start and size, and how many of its bytes have
 * been handed out at least once.  All zero before fs_arena_place(). */
int fs_arena_region(uintptr_t *base, size_t *size, size_t *used)
{
    size_t high = __atomic_load_n(&region.high, __ATOMIC_ACQUIRE);
    size_t slots = __atomic_load_n(&region.slots, __ATOMIC_ACQUIRE);
    *base = (uintptr_t)region.base;
    *size = region.size;
    *used = (high < slots ? high : slots) * region.slot;
    return 0;
}
