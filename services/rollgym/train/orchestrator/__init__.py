"""The generation side of asynchronous RL (`rollgym orchestrate CONFIG.yaml`, or inside `rollgym train`).

`config` (the `orchestrator:` section), `orchestrator` (`Orchestrator`: steps, versions, the trainer's
calls, the run), `dispatch` (groups started within the staleness bound), `batches` (groups judged, placed
and annotated into a step's batch), `sources` (task sources, dedupe, env ratios, easy/hard pools),
`policy_versions` (hot-loads, model_version → step), `metrics` (each step's history line), `resume` (where
a killed run continues), `transports/` (how batches reach a trainer in another process: step folders, and
the step server's HTTP signal).

Imports the rollouts and data wings and the kernel; never `loop/` or `trainers/`.
"""
