"""`python -m aioprefill.bench`: open-loop prefill benchmark, batching policies side by side.

Modules: `cli` (flags to `Options`), `presets` (sim cost models), `workload` (arrivals and
prompt lengths), `traces` (Azure / Mooncake readers), `runner` (drives an `Engine` per policy),
`metrics` and `costmodel` (figures from the results), `report` (table, JSON, targets), `plot`.
It uses only the public API and never imports paddle (the engine's workers do).
"""
