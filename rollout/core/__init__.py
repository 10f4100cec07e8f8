"""The engine's working parts behind the `Engine` facade: construction (build), request
intake (validation -> Reqs), the step loop (launch / read back / overlap) and outputs."""
