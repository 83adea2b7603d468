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
    zygote = fastspawn._zygote.client.zygote_pid()
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
    assert fastspawn._launch.context.log.name == "fastspawn._context"
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


@pytest.mark.parametrize("start_method", ["zygote", "spawn", "forkserver"])
def test_a_tensor_argument_travels_in_shared_memory(start_method):
    # torch's reductions (multiprocessing's ForkingPickler) put its storage
    # in shared memory, whose fd goes with the launch: every rank writes the
    # caller's tensor, not a copy in the pickled arguments.
    import torch

    tensor = torch.zeros(4)
    ctx = fastspawn.start_processes(
        workers.add_one_at_rank, (tensor,), nprocs=4, start_method=start_method
    )
    assert ctx.return_values == {rank: True for rank in range(4)}
    assert tensor.tolist() == [1.0, 1.0, 1.0, 1.0]


def test_torch_works_in_zygote_workers(patched):
    ctx = torch_mp.spawn(workers.torch_sum, nprocs=2, preload=["torch"])
    assert ctx.return_values == {0: 6.0, 1: 7.0}


def test_omp_num_threads_of_a_rank_sizes_torchs_pool():
    # torch read OMP_NUM_THREADS when the zygote imported it; a rank given
    # its own value must run with it, as a spawned interpreter would.
    envs = {0: {"OMP_NUM_THREADS": "1"}, 1: {"OMP_NUM_THREADS": "2"}}
    ctx = fastspawn.start_processes(workers.torch_threads, nprocs=2, envs=envs, preload=["torch"])
    assert ctx.return_values == {0: ("1", 1), 1: ("2", 2)}


def test_patched_start_processes_takes_start_method_none(patched, monkeypatch):
    # torch's ParallelForkServerShouldWorkTest: no start_method, a queue
    # from the default context, the parallel start knob set.
    monkeypatch.setenv(torch_mp.ENV_VAR_PARALLEL_START, "1")
    queue = torch_mp.get_context(None).SimpleQueue()
    try:
        torch_mp.start_processes(workers.put_rank, args=(queue,), nprocs=2, start_method=None)
        assert sorted([queue.get(), queue.get()]) == [0, 1]
    finally:
        queue.close()


def test_patched_spawn_context_takes_torchs_arguments(patched, tmp_path):
    # Processes started with torch's own wrapper, which pickles a traceback
    # to the error file it is given; the context built as torch builds it.
    from torch.multiprocessing.spawn import _wrap

    error_files = [str(tmp_path / f"pytorch-errorfile-{rank}.pickle") for rank in range(2)]
    processes = [
        torch_mp.get_context("fork").Process(
            target=_wrap, args=(workers.raise_on, rank, (1, 30.0), error_files[rank])
        )
        for rank in range(2)
    ]
    for proc in processes:
        proc.start()
    try:
        with pytest.warns(UserWarning, match="SpawnContext is renamed to ProcessContext"):
            ctx = torch_mp.SpawnContext(processes, error_files)
        with pytest.raises(
            torch_mp.ProcessRaisedException,
            match="\nValueError: legitimate exception from process 1",
        ):
            while not ctx.join(timeout=60):
                pass
        with pytest.raises(torch_mp.ProcessExitedException, match="process 0 terminated with"):
            ctx.join()
        assert ctx.join() is True
    finally:
        for proc in processes:
            if proc.is_alive():
                proc.kill()
            proc.join(30)
            proc.close()


@pytest.mark.parametrize("allowed", [set(range(12)), set(range(12)) - {1, 5, 9}])
@pytest.mark.parametrize("mode", ["node", "socket", "exclusive", "core-complex"])
def test_numa_modes_match_torchs_own(tmp_path, monkeypatch, mode, allowed):
    # torch.numa.binding's own functions, reading the same sysfs tree and
    # seeing the same GPUs and allowed CPUs, pick the same CPUs as ours.
    import os

    from helpers import TWELVE_CPUS_GPUS, twelve_cpus

    from fastspawn._os import numa

    binding = pytest.importorskip("torch.numa.binding")
    root = str(twelve_cpus(tmp_path))

    def in_tree(path):
        return root + path[len("/sys") :] if str(path).startswith("/sys/") else path

    real_open, real_listdir = open, os.listdir
    monkeypatch.setattr(
        binding, "open", lambda p, *a, **k: real_open(in_tree(p), *a, **k), raising=False
    )
    monkeypatch.setattr(os, "listdir", lambda p: real_listdir(in_tree(p)))
    monkeypatch.setattr(
        binding,
        "_get_numa_node_index_for_gpu_index",
        lambda *, gpu_index: TWELVE_CPUS_GPUS[gpu_index],
    )
    monkeypatch.setattr(binding, "_get_gpu_count", lambda: len(TWELVE_CPUS_GPUS))
    monkeypatch.setattr(
        binding, "_get_allowed_cpu_indices_for_current_thread", lambda: set(allowed)
    )
    ours = numa.Topology(
        root, TWELVE_CPUS_GPUS.__getitem__, lambda: len(TWELVE_CPUS_GPUS), set(allowed)
    )
    options = binding.NumaOptions(affinity_mode=binding.AffinityMode(mode))
    for gpu in TWELVE_CPUS_GPUS:
        theirs = binding._get_logical_cpus_to_bind_to(gpu_index=gpu, numa_options=options)
        assert numa.cpus_for(mode, gpu, ours) == theirs, gpu


def test_torchs_numa_options_say_why_they_cannot_apply(tmp_path):
    from torch.numa.binding import AffinityMode, NumaOptions

    from fastspawn import elastic

    with pytest.raises(RuntimeError, match="numa_options cannot apply"):
        elastic.start_processes(
            "t",
            workers.elastic_add,
            {0: (1, 2)},
            {0: {}},
            str(tmp_path),
            numa_options=NumaOptions(affinity_mode=AffinityMode.NODE),
        )


def test_patch_torch_routes_the_elastic_agents_worker_start(patched):
    pytest.importorskip("torch.distributed.elastic")
    import torch.distributed.elastic.multiprocessing as torch_elastic_mp
    from torch.distributed.elastic.agent.server import local_elastic_agent

    from fastspawn._torch import agent as _agent

    # The agent's own binding (imported at its import) and the package's
    # (read by code imported later) both start workers through fastspawn.
    assert local_elastic_agent.start_processes is _agent.start_processes
    assert torch_elastic_mp.start_processes is _agent.start_processes
    fastspawn.unpatch_torch()
    assert local_elastic_agent.start_processes.__module__.startswith("torch.")
    assert torch_elastic_mp.start_processes is local_elastic_agent.start_processes
    fastspawn.patch_torch(preload=False)  # the fixture unpatches again
