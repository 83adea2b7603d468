"""The kernel, through the C core: the lowest layer.

Only this subpackage imports the C extension (``_core``); everything above
calls the kernel through ``oscall`` and the modules beside it: the limits a
launch must fit, the caller's process state that workers adopt, children
and process groups, NUMA and huge pages, the long-lived launcher thread,
signals held across a step that must not be cut in two (``held``), and
the plumbing the helper processes (zygote, warden) share.
"""
