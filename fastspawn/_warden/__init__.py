"""The warden: a small process of the caller's that kills the process
groups of its fork and spawn launches once the caller is gone, however it
died (``main``, run as a script: no fastspawn import), and the caller's
handle on it (``client``)."""
