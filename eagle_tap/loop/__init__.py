"""The closed loop: a draft registry, rounds of training on captured traffic, swaps into running replicas."""
