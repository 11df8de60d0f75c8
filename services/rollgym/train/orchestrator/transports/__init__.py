"""How a step's batch reaches a trainer in another process, and how the trainer says it is done.

`base` (the contract both ends rely on), `folders` (step folders on a shared disk: the batch, its marker,
the trainer's ADAPTER file), `http` (the step server: the same "step N is done" as an HTTP call, and the
run's status).
"""
