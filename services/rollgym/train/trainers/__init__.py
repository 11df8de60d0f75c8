"""The optimize side: trainers behind one contract, run here, in a child process, or elsewhere.

`base` (the contract: `Trainer.fit`, `RemoteTrainer.submit`, `Artefact`, `TrainConfig`, the built-in names),
`jobs` (a step in a child process, and that child's entry point), `trl_trainers` (SFT and DPO on TRL + PEFT),
`grpo_config`, `grpo_loss`, `grpo_trainer` and `grpo_process` (rollgym's GRPO trainer: its settings, its
objective, the model with its optimizer, the long-lived process that keeps them), `policy` (the model a
trainer trains), `gguf_export` (merged weights the embedded model serves), `servable` (a safetensors folder
vLLM or SGLang serves).

Imports the data wing and the kernel; never `loop/` or `orchestrator/`.
"""
