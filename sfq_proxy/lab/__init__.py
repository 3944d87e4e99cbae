"""The scenario lab: scenarios, ordering policies, the simulator, load generation against a
real proxy, reports, and the demo."""
