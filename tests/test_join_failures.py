"""A failure is never lost, a limit never overflows: join's teardown, ranks'
forked children, and timeouts of any size."""

from __future__ import annotations

import pytest
import workers

import fastspawn
from fastspawn import elastic

INF = float("inf")
NAN = float("nan")


def start(fn, args=(), nprocs=3, start_method="zygote", **kwargs):
    return fastspawn.start_processes(
        fn, args, nprocs=nprocs, join=False, start_method=start_method, **kwargs
    )


# ------------------------------------------------------------- timeouts


def test_join_timeout_inf_means_no_limit(start_method):
    ctx = start(workers.sleep_for, (0.5,), nprocs=2, start_method=start_method)
    for bad, error in ((NAN, ValueError), ("x", TypeError)):
        with pytest.raises(error, match="timeout"):
            ctx.join(timeout=bad)
        with pytest.raises(error, match="timeout"):
            ctx.processes[0].join(bad)
    ctx.processes[0].join(INF)
    assert ctx.processes[0].exitcode == 0
    # A finite timeout past what one wait takes (a C int of milliseconds) too.
    ctx.join(timeout=1e12)
    while not ctx.join(timeout=INF):
        pass
    assert ctx.return_values == {0: None, 1: None}


def test_elastic_wait_timeout_inf_means_no_limit(tmp_path):
    ctx = elastic.start_processes("t", workers.elastic_add, {0: (1, 2)}, {0: {}}, str(tmp_path))
    for bad, error in ((NAN, ValueError), ("x", TypeError)):
        with pytest.raises(error, match="timeout"):
            ctx.wait(timeout=bad)
        with pytest.raises(error, match="timeout"):
            ctx.close(timeout=bad)
    result = ctx.wait(timeout=INF)
    assert result is not None and result.return_values == {0: 3}
    ctx.close(timeout=INF)
