"""The caller's launch engine: ``start_processes`` and ``spawn`` (``api``),
the workers of a launch joined together (``context``), one worker's handle
(``process``), the exceptions (``errors``), the ranks' stacks taken through
``/proc`` (``stacks``), a notebook's output caught up (``kernel_output``),
and the start methods (``methods/``), the only door to the zygote's and the
warden's clients.
"""
