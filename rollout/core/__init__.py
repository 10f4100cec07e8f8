"""The engine's working parts behind the `Engine` facade: request intake (validation ->
Reqs), the step loop (launch / read back / overlap) and its hooks, outputs, sleep / wake
memory and pauses; with the scheduler (rollout/scheduler.py) they are the core layer of
docs/architecture.md. build.py, the composition root, sits above them and the features."""
