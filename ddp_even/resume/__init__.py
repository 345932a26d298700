"""Resuming mid-epoch: :mod:`~ddp_even.resume.state` (the saved state, its checks, where a
resumed epoch starts); the plan re-plans the rows not yet read (``ShardPlan.own_tails`` and
``ShardPlan.rest``, :mod:`ddp_even.planning.plans`).
"""
