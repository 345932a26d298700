"""Resuming mid-epoch, in one place: :mod:`~ddp_even.resume.state` holds the loader's saved
state, the checks before resuming from it and where a resumed epoch starts;
:mod:`~ddp_even.resume.remainder` re-plans the rows not yet read (on as many ranks or on
another number). ``EvenLoader.state_dict`` and ``load_state_dict`` are thin calls into them.
"""
