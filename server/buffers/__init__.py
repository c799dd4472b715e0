"""The buffer store: registered flat buffers, one slice's state, gradient contributions in rank
order, optimizer steps, captures for snapshots and non-finite checks."""
