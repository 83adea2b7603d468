"""torch compatibility: ``patch_torch`` (``patch``), the ``SpawnContext``
torch code builds from its own processes (``spawn_context``), torch's
elastic agent starting its workers through ``fastspawn.elastic``
(``agent``), and ``fastspawn run`` with torch's dynamic rendezvous
(``torchrun``).  torch itself is imported only where it is used.
"""
