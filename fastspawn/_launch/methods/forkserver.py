"""Start method "forkserver": multiprocessing's name for a long-lived
process that forks the workers, which fastspawn's zygote is.  The same
method as "zygote" under torch's (and multiprocessing's) name; unlike the
zygote, ``fastspawn.spawn()`` warns for it, as torch's spawn() does."""

from __future__ import annotations

from fastspawn._launch.methods.zygote import Zygote


class Forkserver(Zygote):
    name = "forkserver"
    spawn_accepts = False


METHOD = Forkserver()
