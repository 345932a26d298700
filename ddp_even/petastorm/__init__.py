"""Everything that knows petastorm's internals (petastorm 0.12.1, pinned in constraints.txt)."""
