"""``ddp_even.allreduce_hook``: a rank lost inside DDP's own all-reduce is named by ddp_even.

* SIGKILL of a rank just before its ``backward()``, while the others wait for it in DDP's
  all-reduce of the gradients (rank 1 of 2; rank 0 of 2, whose process hosts the TCP store;
  rank 2 of 3): every survivor's ``backward()`` raises ``PeerTimeoutError`` naming it as dead
  within ``timeout`` + 2 s, instead of gloo's ``RuntimeError``;
* SIGSTOP there: named as stalled when gloo gives up on it, at the training group's timeout;
  continued, it raises too (``late``);
* in join mode the loop need not register the hook: ddp_even registers it on the joinable
  DDP model, and the kill is named on 2 ranks and on 8;
* a pause there of 2x the timeout is waited for, as DDP waits: no error, the same batches;
* the gradients are DDP's own: a model trained through the hook ends with the parameters of
  one trained without it, in truncate mode and in join mode (where the ranks that ran out
  shadow the others' all-reduces through the hook, outside any backward pass);
* a model with a communication hook of its own keeps it (ddp_even says so);
* the torch internals the hook relies on behave as assumed.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.liveness_job import Act, Job, expected_epochs, run_on_ranks
from tests.helpers.spawn import RankError, run_ranks

TIMEOUT = 2.0


@pytest.mark.multirank
@pytest.mark.timing
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("victim", "ranks"), [(1, 2), (0, 2), (2, 3)], ids=str)
def test_a_rank_killed_in_ddps_all_reduce_is_named_dead(victim: int, ranks: int) -> None:
    job = Job((Act("inside_backward", victim, "kill"),), "known", TIMEOUT, ddp=True, hook=True)
    results, faults = run_on_ranks(job, ranks, timeout=120, tcp_store=victim == 0)
    killed_at = faults[victim, "inside_backward"]
    for survivor in (result for rank, result in enumerate(results) if rank != victim):
        assert isinstance(survivor, dict), survivor  # ddp_even's error, not gloo's RuntimeError
        assert survivor["error"] == "PeerTimeoutError", survivor
        assert survivor["missing"] == (victim,), survivor
        assert survivor["states"] == {victim: "dead"}, survivor
        assert "DDP's gradient all-reduce" in survivor["message"], survivor
        assert f"rank {victim} is dead" in survivor["message"], survivor
        assert survivor["at"] - killed_at <= TIMEOUT + 2, survivor
        # It failed in the third step, before that step's optimizer step.
        assert [len(epoch) for epoch in survivor["seen"]] == [3], survivor
    died = f"rank {victim} died (signal SIGKILL) without a result"
    assert results[victim] == RankError("ProcessExited", died)


@pytest.mark.multirank
@pytest.mark.timing
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("victim", "ranks"), [(1, 2), (5, 8)], ids=str)
def test_in_join_mode_ddp_even_registers_the_hook_itself(victim: int, ranks: int) -> None:
    """The loop registers no hook: the DDP model is join mode's joinable, and ddp_even makes
    it average through its hook, so a rank killed in ``backward()`` is named on every survivor
    (8 ranks: the survivors' last within ``timeout`` + 5 s)."""
    job = Job((Act("inside_backward", victim, "kill"),), "known", TIMEOUT, True, False, "join")
    results, faults = run_on_ranks(job, ranks, timeout=200)
    killed_at = faults[victim, "inside_backward"]
    survivors = [result for rank, result in enumerate(results) if rank != victim]
    for survivor in survivors:
        assert isinstance(survivor, dict), survivor  # ddp_even's error, not gloo's RuntimeError
        assert survivor["error"] == "PeerTimeoutError", survivor
        assert survivor["missing"] == (victim,) and survivor["states"] == {victim: "dead"}
        assert "DDP's gradient all-reduce" in survivor["message"], survivor
    assert max(survivor["at"] for survivor in survivors) - killed_at <= TIMEOUT + 5, survivors


@pytest.mark.multirank
@pytest.mark.timing
@pytest.mark.timeout(150)
def test_a_rank_frozen_in_ddps_all_reduce_is_named_stalled_at_the_training_timeout() -> None:
    training_timeout = 6.0
    job = Job(
        (Act("inside_backward", 1, "stop", training_timeout + 8),), "known", TIMEOUT, True, True
    )
    results, faults = run_on_ranks(job, 2, timeout=120, pg_timeout=training_timeout)
    frozen_at = faults[1, "inside_backward"]
    survivor, woken = results
    assert isinstance(survivor, dict) and survivor["error"] == "PeerTimeoutError", survivor
    assert survivor["missing"] == (1,) and survivor["states"] == {1: "stalled"}, survivor
    assert "rank 1" in survivor["message"] and "stalled" in survivor["message"], survivor
    assert not survivor["late"], survivor
    # Gloo gives up at the training group's timeout, counted from the survivor's all-reduce,
    # which it issued before the victim froze (up to a second or two on a busy machine); the
    # survivor has read the silent heartbeat meanwhile, so it names the rank at once.
    assert training_timeout - 2 <= survivor["at"] - frozen_at <= training_timeout + 3, survivor
    # Continued, the frozen rank raises too, naming itself.
    assert isinstance(woken, dict) and woken["error"] == "PeerTimeoutError", woken
    assert woken["late"] and woken["missing"] == (1,), woken


@pytest.mark.multirank
@pytest.mark.timing
@pytest.mark.timeout(150)
def test_a_pause_before_backward_is_waited_for() -> None:
    job = Job(
        (Act("inside_backward", 1, "pause", 2 * TIMEOUT),), "known", TIMEOUT, ddp=True, hook=True
    )
    results, _ = run_on_ranks(job, 2, timeout=120)
    for rank, result in enumerate(results):
        assert isinstance(result, dict) and result["error"] is None, (rank, result)
        assert result["seen"] == expected_epochs(rank), (rank, result)


def train_both_ways(rank: int, world_size: int, mode: str) -> list[list[float]]:
    """Rank ``rank`` trains two identical models on its uneven shard through an EvenLoader,
    one with ``ddp_even.allreduce_hook``, one without; each one's parameters at the end."""
    import torch.distributed as dist

    import ddp_even

    shard = [torch.full((2, 3), float(rank * 10 + step)) for step in range(3 + 2 * rank)]
    parameters = []
    for hook in (False, True):
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
        if hook:
            model.register_comm_hook(None, ddp_even.allreduce_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        joinables = [model] if mode == "join" else []
        loader = ddp_even.EvenLoader(shard, mode, joinables=joinables, timeout=30)
        for _ in range(2):
            for inputs in loader:
                model(inputs).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        parameters.append([value for p in model.parameters() for value in p.flatten().tolist()])
    dist.barrier()
    return parameters


@pytest.mark.multirank
@pytest.mark.in_memory
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["truncate", "join"])
def test_the_gradients_are_ddps_own(mode: str) -> None:
    per_rank = run_ranks(train_both_ways, 2, mode, timeout=100)
    for without_hook, with_hook in per_rank:
        assert with_hook == pytest.approx(without_hook, rel=1e-6, abs=1e-7)
    # The ranks agree, and the training moved the parameters.
    assert per_rank[0] == per_rank[1]
    torch.manual_seed(0)
    untrained = [v for p in torch.nn.Linear(3, 1).parameters() for v in p.flatten().tolist()]
    assert per_rank[0][0] != pytest.approx(untrained)


def test_the_engine_runs_a_queued_callback_at_the_end_of_backward_and_raises_its_error() -> None:
    """The torch internal the hook relies on (``gradient_hook.py``; torch 2.13)."""
    engine = torch.autograd.Variable._execution_engine
    with pytest.raises(RuntimeError, match="during backward pass"):
        engine.queue_callback(lambda: None)

    class Failed(Exception):
        pass

    ran = []

    def fail() -> None:
        ran.append("callback")
        raise Failed("from the callback")

    weight = torch.ones(2, requires_grad=True)
    weight.register_hook(lambda grad: engine.queue_callback(fail))
    with pytest.raises(Failed, match="from the callback"):
        weight.sum().backward()
    assert ran == ["callback"]


def test_a_model_with_a_hook_of_its_own_keeps_it(caplog: pytest.LogCaptureFixture) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from ddp_even.liveness.gradient_hook import register_on

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        model.register_comm_hook(None, allreduce_hook)  # torch's own
        with caplog.at_level("INFO", logger="ddp_even"):
            assert not register_on(model)
        assert [hook for hook, _ in model._comm_hooks] == [allreduce_hook]
        assert "a communication hook of its own (allreduce_hook)" in caplog.text
        model(torch.ones(3, 2)).sum().backward()  # still trains, through torch's hook
        assert model.module.bias.grad is not None and float(model.module.bias.grad) == 3.0
        del model
    finally:
        dist.destroy_process_group()
