"""Start methods: how the workers of a launch come to life.

One module per method (``fork``, ``spawn``, ``zygote``, ``forkserver``),
each a StartMethod (``base``); ``registry`` is the one place names map to
methods.  What fork and spawn share (the caller's own children, in a process
group the warden guards) is in ``common``; what the rest of fastspawn may
ask of the long-lived helpers (the zygote, the warden) is in ``helpers``,
and only this package imports their clients.
"""
