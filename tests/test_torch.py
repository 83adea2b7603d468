"""fastspawn.patch_torch(), when torch is installed."""

from __future__ import annotations

import pytest
import workers

import fastspawn

torch_mp = pytest.importorskip("torch.multiprocessing")


@pytest.fixture
def patched():
    fastspawn.patch_torch(preload=False)
    yield
    fastspawn.unpatch_torch()


def test_patch_torch_routes_spawn_to_fastspawn(patched):
    import sys

    assert torch_mp.spawn is fastspawn.spawn
    assert torch_mp.start_processes is fastspawn.start_processes
    assert sys.modules["torch.multiprocessing.spawn"].ProcessExitedException is (
        fastspawn.ProcessExitedException
    )
    ctx = torch_mp.spawn(workers.pid_and_ppid, nprocs=2)
    zygote = fastspawn._zygote_client.zygote_pid()
    assert {ppid for _pid, ppid in ctx.return_values.values()} == {zygote}


def test_patched_exceptions_are_catchable_by_torch_names(patched):
    with pytest.raises(torch_mp.ProcessRaisedException, match="legitimate exception"):
        torch_mp.start_processes(workers.raise_on, (0, 0.0), nprocs=2, start_method="spawn")


def test_unpatch_restores_torch(patched):
    fastspawn.unpatch_torch()
    assert torch_mp.spawn is not fastspawn.spawn
    assert torch_mp.spawn.__module__ == "torch.multiprocessing.spawn"
    # A name torch did not have before the patch is gone again, not None.
    assert getattr(torch_mp, "ProcessException", "absent") is not None
    assert fastspawn._context.log.name == "fastspawn._context"
    fastspawn.patch_torch(preload=False)  # the fixture unpatches again


def test_patched_warnings_use_torchs_logger(patched, caplog):
    # Logging set up for torch's spawn (a level, a handler) applies.
    import logging

    def fail_one():
        with pytest.raises(torch_mp.ProcessRaisedException):
            torch_mp.start_processes(workers.raise_on, (0, 30.0), nprocs=2, start_method="spawn")
        return [r for r in caplog.records if "Terminating process" in r.getMessage()]

    (record,) = fail_one()
    assert record.name == "torch.multiprocessing.spawn"
    caplog.clear()
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        assert fail_one() == []
    finally:
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.NOTSET)


def test_torch_works_in_zygote_workers(patched):
    ctx = torch_mp.spawn(workers.torch_sum, nprocs=2, preload=["torch"])
    assert ctx.return_values == {0: 6.0, 1: 7.0}


def test_omp_num_threads_of_a_rank_sizes_torchs_pool():
    # torch read OMP_NUM_THREADS when the zygote imported it; a rank given
    # its own value must run with it, as a spawned interpreter would.
    envs = {0: {"OMP_NUM_THREADS": "1"}, 1: {"OMP_NUM_THREADS": "2"}}
    ctx = fastspawn.start_processes(workers.torch_threads, nprocs=2, envs=envs, preload=["torch"])
    assert ctx.return_values == {0: ("1", 1), 1: ("2", 2)}


def test_patch_torch_routes_the_elastic_agents_worker_start(patched):
    pytest.importorskip("torch.distributed.elastic")
    import torch.distributed.elastic.multiprocessing as torch_elastic_mp
    from torch.distributed.elastic.agent.server import local_elastic_agent

    from fastspawn import _agent

    # The agent's own binding (imported at its import) and the package's
    # (read by code imported later) both start workers through fastspawn.
    assert local_elastic_agent.start_processes is _agent.start_processes
    assert torch_elastic_mp.start_processes is _agent.start_processes
    fastspawn.unpatch_torch()
    assert local_elastic_agent.start_processes.__module__.startswith("torch.")
    assert torch_elastic_mp.start_processes is local_elastic_agent.start_processes
    fastspawn.patch_torch(preload=False)  # the fixture unpatches again
