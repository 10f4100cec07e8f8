"""Parts the benchmark programs share: steady-state decode and phase timers (`steady`),
random adapters of a shape (`adapters`), the compiled peer of the rollout benchmark
(`compiled_peer`), Triton compiles in a timed stretch (`compiles`), where a kernel benchmark
runs (`kernel_device`), and the speculative and structured-output benchmarks' workloads
(`spec*`, `structured`). The packages (rollout, lora, speculative, weightsync) never import
benchmarks/."""
