"""Short versions of the long runs (make soak, make bench): each starts its own
server and fake upstream through the same tools, on free loopback ports."""
