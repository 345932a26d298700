"""Resuming mid-epoch: :mod:`~ddp_even.resume.state` (the saved state, its checks, where a
resumed epoch starts) and :mod:`~ddp_even.resume.remainder` (the rows not yet read, re-planned).
"""
