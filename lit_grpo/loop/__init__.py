"""The training loop: the Lightning module and everything that happens at the end of its step.

module.py          GRPOModule: policy, frozen reference, one step that reads like the maths
optimizer_step.py  what an optimizer step reads of the config (the loss settings) and records: its
                   normalizers and weighted metrics, and its update taken (clipped) or skipped
micro_batches.py   which rows go through one forward: slices of the batch, or token-bounded groups
skipped_steps.py   optimizer steps not taken (non-finite, or no learning signal), decided by all ranks together
step_sequence.py   after each step, in a fixed order: weight sync, checkpoint, evaluation, metrics
metrics.py         a step's metrics merged over ranks, the history, the loggers
mfu.py             a step's model FLOPs by phase, and their utilization of the machine's peak (`perf/mfu`)
evaluation.py      greedy accuracy on held-out rows
rollout_evaluation.py  the cookbook's `evaluation_fn` hook
optim.py           AdamW and the learning-rate schedule
signals.py         SIGTERM / SIGINT stop a run within seconds
distributed.py     the few collectives the loop needs, no-ops in one process
"""
