/* Internal to the C core (not part of fastspawn.h, which cffi reads): a
 * signal mask given as bits, bit n-1 for signal n, as the API passes them. */
#ifndef FASTSPAWN_SIGBITS_H
#define FASTSPAWN_SIGBITS_H

#include <signal.h>
#include <stdint.h>

/* `set` holds the signals of `bits`; those glibc keeps for itself (EINVAL
 * from sigaddset) are skipped. */
static inline void fs_sigset_from_bits(uint64_t bits, sigset_t *set)
{
    sigemptyset(set);
    for (int sig = 1; sig <= 64 && sig < NSIG; sig++)
        if (bits & (1ULL << (sig - 1)))
            sigaddset(set, sig);
}

#endif
