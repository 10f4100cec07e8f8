"""torch.distributed pieces for multi-process rollouts (the torchrun launchers, a GRPO loop):
process groups with timeouts (group), a per-rank phase log that names the missing peer
when a collective fails (phases), byte/number collectives without pickle (collectives),
prompt loading and the data-parallel rollout (prompts, dp_rollout), the launchers' shared
options (launch_args), free_port (ports), and tensor parallelism: an engine's TP group and its
collectives (tp), one process driving spawned TP workers (tp_engine).

Two layers of docs/architecture.md meet here. tp, group, phases, collectives, ports and
prompts are base pieces that know no engine (the model shards itself over tp); tp_engine,
dp_rollout and launch_args drive Engines and sit at the top with the server.

Nothing is imported here: `import rollout.distributed.ports` stays cheap.
"""
