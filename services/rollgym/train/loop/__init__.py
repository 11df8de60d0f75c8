"""What `rollgym train PLAN.yaml` drives.

`plan` (the YAML, validated), `epochs` (`TrainLoop`: each epoch's phases in order, resumable phase by
phase), `collect` (the collect phase and every collection through the stack), `validation` (the validate
phase) and `validation_metrics` (the metrics a plan may name), `curation` (rollouts → the records a trainer
takes), `optimize` (the trainer instances of a run, one step through them, the trainer's arguments),
`apply` (the stack and getting an artefact served), `guard` (a worse model does not stay), `async_driver`
(`mode: async`: the orchestrator streams batches while the trainer steps), `run_folder` (the output
folder's layout: plan, state, history, epoch folders, rewind, pruning), `history` (each finished epoch's
line to history.jsonl, the tracker and the plots, best-effort past the file), `tracking`, `plots`,
`errors` (`TrainError`).

May import `orchestrator/`, `trainers/`, the rollouts, data, stack and eval wings and the kernel.
"""
