"""Cloud instance metadata: spot / preemption notices."""
